"""The greedy screen (`worker/cpu/greedy_screen.py`): a float32 head's argmax from a bfloat16
or int8 read of it, which must be the float32 head's own argmax (first index on ties) on every
row it answers, however close the logits, and must decline (None) rows it cannot promise. Both
copies are checked wherever the tests run, whichever this CPU's screen reads.

Each copy's bound is checked column by column where its error adds up; the engine's greedy
output with the screen against the output without it, with and without speculation.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from specserve.llm import LLM
from specserve.shared.protocol import SamplingParams
from specserve.worker.cpu import greedy_screen, kernels, narrow_panels
from specserve.worker.cpu.greedy_screen import (
    MAX_CANDIDATES,
    WIDENED_MAX_LOGIT_ROWS,
    WIDENED_MAX_ROWS,
    GreedyScreen,
    default_copy,
)
from specserve.worker.cpu.linear import linear, pack_weight
from specserve.worker.sampler import argmax_rows

pytestmark = pytest.mark.skipif(
    torch.bfloat16 not in kernels.linear_dtypes(),
    reason="the greedy screen needs the bfloat16 panel kernel (AVX-512, or AVX2 with FMA)",
)

VOCAB, DEPTH = 4099, 576  # a partial last panel


COPIES = pytest.mark.parametrize("copy", ["bfloat16", "int8"])


def _head(weight: torch.Tensor, copy: str):
    """The packed head and its screen reading `copy`, answering any number of rows (its
    exactness does not depend on `widened`, which only says where it pays)."""
    packed = pack_weight(weight)
    assert packed is not None and packed.panels
    screen = GreedyScreen.of(packed, copy)
    assert screen is not None
    return packed, dataclasses.replace(screen, widened=False)


def _full_argmax(hidden: torch.Tensor, weight: torch.Tensor, packed) -> torch.Tensor:
    return argmax_rows(linear(hidden, weight, None, packed))


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
@COPIES
def test_the_screen_gives_the_float32_heads_argmax(rows: int, copy: str) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(VOCAB, DEPTH) * 0.05
    packed, screen = _head(weight, copy)
    answered = 0
    for scale in (0.1, 1.0, 10.0, 1000.0):
        hidden = torch.randn(rows, DEPTH) * scale
        got = screen.argmax(hidden)
        if got is not None:
            answered += 1
            assert torch.equal(got, _full_argmax(hidden, weight, packed))
    assert answered >= 3


@COPIES
def test_near_ties_and_exact_ties_go_to_the_float32_heads_first_index(copy: str) -> None:
    """Columns whose logits differ by a float32 ulp or less, far below bfloat16's resolution:
    only the float32 recomputation can tell them apart, and equal ones go to the lowest id."""
    torch.manual_seed(0)
    base = torch.randn(DEPTH) * 0.05
    weight = torch.randn(VOCAB, DEPTH) * 0.01
    near = [7, 8, 100, 2049, 4098]
    for i, column in enumerate(near):  # the same row, nudged by a few float32 ulps
        weight[column] = base + torch.randn(DEPTH) * 1e-7 * i
    weight[3000] = weight[100]  # an exact tie with a later index
    packed, screen = _head(weight, copy)
    checked = 0
    for seed in range(40):
        torch.manual_seed(seed)
        hidden = base[None] * 40 + torch.randn(4, DEPTH) * 0.01
        got = screen.argmax(hidden)
        assert got is not None
        full = linear(hidden, weight, None, packed)
        assert torch.equal(got, argmax_rows(full))
        checked += int((full[:, near].max(dim=1).values == full.max(dim=1).values).sum())
    assert checked > 100  # the argmax was among the near-tied columns nearly every time
    hidden = base[None] * 40
    full = linear(hidden, weight, None, packed)
    if full[0, 100] == full.max():  # the exact tie holds the maximum: the lower id wins
        assert screen.argmax(hidden).tolist() == [100]


@COPIES
def test_columns_apart_by_less_than_the_copy_can_see_are_told_apart(copy: str) -> None:
    """A ladder of columns around one direction, apart by 1e-6 to 1e-2 of it: the screen's own
    order of them is often wrong (the copy's rounding), so only the bound keeps the float32
    argmax among the columns recomputed."""
    torch.manual_seed(3)
    base = torch.randn(DEPTH) * 0.05
    weight = torch.randn(VOCAB, DEPTH) * 0.01
    ladder = torch.arange(0, VOCAB, 7)
    steps = torch.logspace(-6, -2, ladder.numel())
    weight[ladder] = base + steps[:, None] * torch.randn(ladder.numel(), DEPTH) * 0.05
    packed, screen = _head(weight, copy)
    hidden = base[None] * 40 + torch.randn(64, DEPTH) * 0.05
    full = linear(hidden, weight, None, packed)
    screened_order_wrong = int((argmax_rows(screen.logits(hidden)) != argmax_rows(full)).sum())
    assert screened_order_wrong > 8  # the case is hard for a screen that ignores its error
    for rows in (hidden[:1], hidden[1:17], hidden):
        got = screen.argmax(rows)
        assert got is not None
        assert torch.equal(got, argmax_rows(linear(rows, weight, None, packed)))


@COPIES
def test_rows_it_cannot_promise_are_declined(copy: str) -> None:
    torch.manual_seed(1)
    weight = torch.randn(VOCAB, DEPTH) * 0.05
    packed, screen = _head(weight, copy)
    hidden = torch.randn(3, DEPTH)
    for bad in (float("nan"), float("inf"), -float("inf")):
        poisoned = hidden.clone()
        poisoned[1, 5] = bad
        assert screen.argmax(poisoned) is None
    assert screen.argmax(hidden.to(torch.bfloat16)) is None  # not the float32 head's input
    assert screen.argmax(hidden[:0]) is None
    packed.min_rows = 4  # the head's own call would take F.linear below 4 rows
    assert screen.argmax(hidden) is None
    assert screen.argmax(torch.randn(4, DEPTH)) is not None
    # All columns alike: every one passes the test, more than the screen recomputes.
    same = pack_weight(torch.ones(MAX_CANDIDATES + 16, 64))
    same.narrow_rows = 0  # read from its float32 panels (ones are also 4-bit blocks)
    assert GreedyScreen.of(same, copy).argmax(torch.randn(1, 64)) is None


def test_where_bfloat16_is_widened_the_screen_answers_only_few_rows() -> None:
    """On AVX2 the screen multiplies at float32's rate: from `WIDENED_MAX_ROWS` rows on the
    float32 head is as fast, so the screen declines; elsewhere it answers as many rows as the
    head's panels take."""
    torch.manual_seed(4)
    screen = GreedyScreen.of(pack_weight(torch.randn(VOCAB, DEPTH) * 0.05))
    assert screen is not None
    widened = kernels.linear_widens_bfloat16()
    assert screen.widened == widened
    assert screen.argmax(torch.randn(WIDENED_MAX_ROWS, DEPTH)) is not None
    beyond = screen.argmax(torch.randn(WIDENED_MAX_ROWS + 1, DEPTH))
    assert (beyond is None) == widened
    assert screen.pays(WIDENED_MAX_LOGIT_ROWS, exact=False)
    assert screen.pays(WIDENED_MAX_LOGIT_ROWS + 1, exact=False) == (not widened)


@COPIES
def test_a_head_that_reads_fewer_bits_itself_is_not_screened(copy: str) -> None:
    """A head of 8-bit blocks reads 8.5 bits a weight where its narrow panels run: the screen
    declines those rows (the head's own logits are exact and no dearer), and answers beyond
    its limit; a head of bfloat16 values declines a bfloat16 copy, not an int8 one."""
    torch.manual_seed(5)
    head = pack_weight(narrow_panels.round_to_q8_blocks(torch.randn(VOCAB, DEPTH) * 0.05))
    assert head is not None and head.bits == 8
    head.narrow_rows = 4
    screen = dataclasses.replace(GreedyScreen.of(head, copy), widened=False)
    assert not screen.pays(4) and not screen.pays(1, exact=False)
    assert screen.argmax(torch.randn(4, DEPTH)) is None
    assert screen.pays(5) and screen.argmax(torch.randn(5, DEPTH)) is not None
    halves = pack_weight((torch.randn(VOCAB, DEPTH) * 0.05).to(torch.bfloat16).float())
    assert halves is not None and halves.bits == 16
    screen = dataclasses.replace(GreedyScreen.of(halves, copy), widened=False)
    assert screen.pays(1) == (copy == "int8")


def test_the_narrow_head_keeps_the_rows_where_it_beats_a_bfloat16_screen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the copy multiplies as bfloat16, the head's 8-bit panels keep greedy rows only up
    to the most rows at which they were timed faster than the screen. A clock that charges the
    narrow head a unit a row and the screen 2 units plus half a unit a row makes them tie at 4
    rows (kept: the screen must be faster) and the screen win at 8; a head below
    `CALIBRATE_MIN_BYTES` is not timed and keeps its narrow panels' own limit."""
    torch.manual_seed(6)
    head = pack_weight(narrow_panels.round_to_q8_blocks(torch.randn(VOCAB, DEPTH) * 0.05))
    assert head is not None and head.bits == 8
    head.narrow_rows = 24
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])  # as `_best_passes` reads it
    panel_linear = kernels.panel_linear

    def narrow_head(x, *args):
        clock[0] += x.shape[0] if len(args) == 5 else 0.0
        return panel_linear(x, *args)

    screened = GreedyScreen._screened_argmax

    def screen_argmax(self, x):
        clock[0] += 2 + 0.5 * x.shape[0]
        return screened(self, x)

    monkeypatch.setattr(kernels, "panel_linear", narrow_head)
    monkeypatch.setattr(GreedyScreen, "_screened_argmax", screen_argmax)
    monkeypatch.setattr(kernels, "linear_widens_bfloat16", lambda: False)
    small = GreedyScreen.of(head, "bfloat16")
    assert small is not None and small.narrow_head_rows == 24  # too small to time
    monkeypatch.setattr(greedy_screen, "CALIBRATE_MIN_BYTES", 1)
    screen = GreedyScreen.of(head, "bfloat16")
    assert screen is not None and not screen.widened and screen.narrow_head_rows == 4
    assert not screen.pays(4) and screen.pays(5) and screen.pays(24) and screen.pays(25)
    monkeypatch.setattr(kernels, "panel_linear", panel_linear)
    rows = torch.randn(5, DEPTH)
    assert torch.equal(screen.argmax(rows), argmax_rows(linear(rows, head.weight, None, head)))
    assert GreedyScreen.of(head, "int8").narrow_head_rows == 2**31 - 1  # widened: not timed


def test_only_a_float32_head_packed_as_panels_gets_a_screen() -> None:
    assert GreedyScreen.of(None) is None
    assert GreedyScreen.of(pack_weight(torch.randn(64, 32).to(torch.bfloat16))) is None


@pytest.mark.parametrize("rows", [1, 5, 6, 13])
def test_the_int8_kernel_sums_each_column_of_its_copy(rows: int) -> None:
    """`int8_panel_linear` against float64 sums of the same int8 values and scales: within a
    float32 sum's rounding, for tiles of 1-6 rows and a remainder, a partial last panel and
    rows a stride apart; and the panels hold the Q that was packed."""
    torch.manual_seed(rows)
    weight = torch.randn(VOCAB, DEPTH) * 0.05
    weight[5] = 0.0  # a zero column: scale 0, logits 0
    q, scale = kernels.quantize_int8(weight)
    panels = kernels.pack_panels(q)
    assert q.dtype == torch.int8 and q.shape == (VOCAB, DEPTH) and int(q.abs().max()) == 127
    assert torch.equal(_unpack_int8(panels), q)
    rounding = (weight.double() - q.double() * scale.double()[:, None]).abs()
    assert bool((rounding <= scale.double()[:, None] * (0.5 + 1e-4)).all())
    wide = torch.randn(rows, DEPTH + 7)
    x = wide[:, :DEPTH]  # rows DEPTH + 7 apart
    got = kernels.int8_panel_linear(x, panels, scale, VOCAB)
    expect = (x.double() @ q.double().T) * scale.double()
    magnitude = x.double().abs() @ q.double().abs().T * scale.double()
    assert got.dtype == torch.float32 and got.shape == (rows, VOCAB)
    assert bool(((got.double() - expect).abs() <= 2 * DEPTH * 2.0**-24 * magnitude + 1e-30).all())
    assert bool((got[:, 5] == 0).all())
    with pytest.raises(ValueError, match="scale"):
        kernels.int8_panel_linear(x.contiguous(), panels, scale[:-1], VOCAB)


def _unpack_int8(panels: torch.Tensor) -> torch.Tensor:
    """The `Q [VOCAB, DEPTH]` of `pack_panels(Q)`."""
    return panels.permute(0, 2, 1).reshape(-1, DEPTH)[:VOCAB]


@COPIES
def test_each_column_is_within_its_bound_even_where_the_error_adds_up(copy: str) -> None:
    """|head_j - screen_j| <= c_j ||x|| for every column, on random rows and on rows along a
    column's own rounding error (where the error of every product has the same sign: the
    Cauchy-Schwarz bound's worst case), at magnitudes from 1e-3 to 1e3."""
    torch.manual_seed(6)
    weight = torch.randn(VOCAB, DEPTH) * 0.05
    packed, screen = _head(weight, copy)
    copied = (
        weight.to(torch.bfloat16).double()
        if copy == "bfloat16"
        else _unpack_int8(screen.panels).double() * screen.scale.double()[:, None]
    )
    error = weight.double() - copied
    rows = [
        torch.randn(8, DEPTH),
        error[:8].float().sign(),
        (error[100:108] / error[100:108].norm(dim=1, keepdim=True)).float(),
    ]
    for hidden in rows:
        for magnitude in (1e-3, 1.0, 1e3):
            x = (hidden * magnitude).contiguous()
            head = linear(x, weight, None, packed).double()
            got = screen.logits(x).double()
            bound = x.double().norm(dim=1)[:, None] * screen.column_bounds.double()[None]
            assert bool(((head - got).abs() <= bound).all())


def test_the_default_copy_is_int8_where_bfloat16_is_widened() -> None:
    expect = "int8" if kernels.linear_widens_bfloat16() else "bfloat16"
    assert default_copy() == expect
    screen = GreedyScreen.of(pack_weight(torch.randn(VOCAB, DEPTH) * 0.05))
    assert screen is not None and screen.copy == expect


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"spec_method": "ngram", "num_spec_tokens": 3, "spec_policy": "fixed"}],
    ids=["plain", "ngram"],
)
def test_the_engines_greedy_output_is_the_same_with_and_without_it(
    engine_args: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bundled model; a batch of greedy requests (the screen answers) and one with a
    sampled request beside them (the full logits). Its tied head is 8-bit blocks, which it
    reads itself where their panels run: they are switched off here so that the screen is
    what answers."""
    llm = LLM("smollm2-135m", enable_prefix_caching=False, **engine_args)
    model = llm.engine.runner.model
    head = model._head_packed()
    assert head.bits == 8 and not model.greedy_screen().pays(1)
    head.narrow_rows = 0
    prompts = [
        "List the planets of the solar system, one per line.",
        "Write a haiku about the sea.",
        "1, 2, 3, 4, 5, 6,",
    ]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    answered: list[tuple[int, torch.Tensor | None]] = []  # (rows, tokens) of each call
    real = model.greedy_tokens
    monkeypatch.setattr(
        model, "greedy_tokens", lambda h: answered.append((h.shape[0], real(h))) or answered[-1][1]
    )
    with_screen = [o.token_ids for o in llm.generate(prompts, greedy, chat=True)]
    mixed = [o.token_ids for o in llm.generate(prompts, [greedy, sampled, greedy], chat=True)]
    max_rows = WIDENED_MAX_ROWS if model.greedy_screen().widened else len(prompts) * 4
    assert any(rows <= max_rows for rows, _ in answered)
    assert all(tokens is not None for rows, tokens in answered if rows <= max_rows)
    monkeypatch.setattr(model, "greedy_tokens", lambda h: None)
    assert [o.token_ids for o in llm.generate(prompts, greedy, chat=True)] == with_screen
    again = [o.token_ids for o in llm.generate(prompts, [greedy, sampled, greedy], chat=True)]
    assert again == mixed
