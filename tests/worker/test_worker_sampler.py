"""Sampler: seeded determinism across batch compositions, exact filters, logprobs, validation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from specserve.shared.protocol import SamplingParams
from specserve.worker import sampler
from specserve.worker.sampler import (
    argmax_rows,
    filtered_probs,
    make_generator,
    sample,
    unseeded_exponential,
    validate_sampling,
)

V = 50


@dataclass(frozen=True)
class RowSampling:
    """Per-row sampling parameters, the fields the sampler reads (`logprobs`: None = none, N =
    chosen plus top N)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0
    min_p: float = 0.0
    logprobs: int | None = None


def _draw(
    logits: torch.Tensor, rows: list[RowSampling], seeds: list[int | None], steps: int
) -> list[list[int]]:
    """`steps` successive samples per row, each row keeping its own generator."""
    gens = [make_generator(s) if s is not None else None for s in seeds]
    out = [sample(logits, rows, gens).token_ids.tolist() for _ in range(steps)]
    return [list(col) for col in zip(*out, strict=True)]


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    torch.manual_seed(0)
    target_logits = torch.randn(V)
    target = RowSampling(temperature=0.9, top_k=20, top_p=0.95, min_p=0.01)
    alone = _draw(target_logits[None], [target], [1234], 30)[0]

    others = torch.randn(5, V)
    batch = torch.cat([others[:2], target_logits[None], others[2:]])
    rows = [
        RowSampling(temperature=1.3),
        RowSampling(temperature=0.0),
        target,
        RowSampling(temperature=0.7, top_p=0.5),
        RowSampling(temperature=1.0, min_p=0.2),
        RowSampling(temperature=2.0, top_k=3),
    ]
    mixed = _draw(batch, rows, [99, None, 1234, None, 7, 5], 30)
    assert mixed[2] == alone
    assert len(set(alone)) > 3  # really random, not collapsed to greedy
    different_seed = _draw(target_logits[None], [target], [4321], 30)[0]
    assert different_seed != alone


def test_greedy_rows_take_argmax_and_accept_shared_params() -> None:
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=0.0) for _ in range(4)]
    assert torch.equal(sample(logits, params).token_ids, logits.argmax(-1))


def _probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()[None]


P = [0.10, 0.50, 0.15, 0.25]


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        (RowSampling(top_k=2), [0.0, 0.5 / 0.75, 0.0, 0.25 / 0.75]),
        (RowSampling(top_k=1), [0.0, 1.0, 0.0, 0.0]),
        (RowSampling(top_k=10), P),
        (RowSampling(top_p=0.7), [0.0, 0.5 / 0.75, 0.0, 0.25 / 0.75]),  # .5 < .7 <= .75
        (RowSampling(top_p=0.8), [0.0, 0.5 / 0.9, 0.15 / 0.9, 0.25 / 0.9]),
        (RowSampling(top_p=0.3), [0.0, 1.0, 0.0, 0.0]),
        (RowSampling(min_p=0.4), [0.0, 0.5 / 0.75, 0.0, 0.25 / 0.75]),  # keep p >= 0.2
        (RowSampling(min_p=0.25), [0.0, 0.5 / 0.9, 0.15 / 0.9, 0.25 / 0.9]),  # keep p >= .125
        (RowSampling(top_k=3, top_p=0.6), [0.0, 0.5 / 0.75, 0.0, 0.25 / 0.75]),  # p over top-3
        (RowSampling(temperature=0.5), [p**2 / sum(x**2 for x in P) for p in P]),
    ],
)
def test_filters_exact(row: RowSampling, expected: list[float]) -> None:
    got = filtered_probs(_probs_logits(P), [row])[0]
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=0)


def test_samples_follow_filtered_distribution() -> None:
    n = 20000
    logits = _probs_logits(P).expand(n, -1)
    rows = [RowSampling(top_p=0.8)] * n
    counts = torch.bincount(sample(logits, rows).token_ids, minlength=4).float() / n
    expected = torch.tensor([0.0, 0.5 / 0.9, 0.15 / 0.9, 0.25 / 0.9])
    assert counts[0] == 0
    torch.testing.assert_close(counts, expected, atol=0.02, rtol=0)


def test_unseeded_rows_draw_from_their_distribution_over_a_large_vocabulary() -> None:
    """Unseeded rows invert their CDF: tokens with probability 0 (between others and at the
    end of a 49,152-entry vocabulary) are never drawn, the others at their rates."""
    n, batch, vocab = 6000, 500, 49152
    logits = torch.full((vocab,), -math.inf)
    picks = {7: 0.2, 8: 0.5, 20000: 0.299, vocab - 2: 0.001}
    for token, prob in picks.items():
        logits[token] = math.log(prob)
    rows = [RowSampling()] * batch
    tokens = torch.cat(
        [sample(logits.expand(batch, -1), rows).token_ids for _ in range(n // batch)]
    )
    counts = torch.bincount(tokens, minlength=vocab).double() / n
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(picks)
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[list(picks)] = torch.tensor(list(picks.values()), dtype=torch.float64)
    torch.testing.assert_close(counts, expected, atol=0.02, rtol=0)


def test_unseeded_noise_is_exponential() -> None:
    """The race's noise is Exp(1): P(E > t) = e^-t in the tails too (within 5 standard errors
    of 10^6 draws), positive and float32."""
    torch.manual_seed(0)
    noise = unseeded_exponential(100, 10_000, "cpu")
    assert noise.dtype == torch.float32 and noise.shape == (100, 10_000)
    assert bool((noise > 0).all())
    n = noise.numel()
    for t in (0.01, 0.5, 1.0, 3.0, 8.0):
        p = math.exp(-t)
        tail = (noise > t).sum().item() / n
        assert abs(tail - p) <= 5 * math.sqrt(p * (1 - p) / n), t
    assert abs(noise.double().mean().item() - 1.0) < 5e-3


def test_logprobs_chosen_and_top_n() -> None:
    logits = torch.randn(3, V)
    rows = [RowSampling(0.0, logprobs=2), RowSampling(0.0), RowSampling(0.0, logprobs=5)]
    out = sample(logits, rows)
    ref = logits.log_softmax(-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert out.top_token_ids is not None
    torch.testing.assert_close(out.logprobs, ref.gather(-1, out.token_ids[:, None])[:, 0])
    assert out.num_top_logprobs == [2, 0, 5]
    assert out.top_token_ids.shape == (3, 5)
    top = ref.topk(5, dim=-1)
    torch.testing.assert_close(out.top_logprobs, top.values)
    assert torch.equal(out.top_token_ids, top.indices)
    assert sample(logits, [RowSampling()] * 3).logprobs is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(logprobs=-1), "logprobs"),
    ],
)
def test_invalid_params_raise(kwargs: dict[str, float], message: str) -> None:
    args: dict = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0) | kwargs
    with pytest.raises(ValueError, match=message):
        validate_sampling(**args)
    with pytest.raises(ValueError, match=message):
        sample(torch.randn(1, V), [RowSampling(**args)])


def test_argmax_rows_takes_the_first_of_tied_maxima() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 3, (64, 49152), generator=g).float()  # every row has many ties
    x[7] = 0.0
    got = argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[7].item() == 0


# --- vanishing and extreme values: exact, never token 0 by overflow -------------------------

# The argmax is token 2 (so a NaN row, whose argmax is 0, cannot pass); token 4 is a near tie.
EXTREME = torch.tensor([[1.0, -3.0, 4.0, 0.5, 4.0 - 1e-4, -math.inf]])


@pytest.mark.parametrize(
    "row",
    [
        RowSampling(temperature=1e-39),  # subnormal in float32
        RowSampling(temperature=1e-45),  # rounds to float32's smallest subnormal
        RowSampling(temperature=5e-324),  # the smallest float64, 0 in float32
        RowSampling(temperature=2.0**-127),
        RowSampling(temperature=1e-38),  # normal in float64, below float32's smallest normal
        RowSampling(temperature=2.0**-126),  # the smallest normal: sampled, and exactly argmax
        RowSampling(temperature=1e-30),
        RowSampling(top_p=1e-46),  # 0 in float32
        RowSampling(top_p=1.4e-45),  # float32's smallest subnormal
        RowSampling(top_p=1e-40),
        RowSampling(temperature=1e-39, top_p=1e-46, top_k=3, min_p=1.0),
    ],
)
def test_vanishing_temperature_or_top_p_gives_the_argmax(row: RowSampling) -> None:
    for seed in (None, 0, 1, 2):
        gens = [make_generator(seed)] if seed is not None else None
        assert sample(EXTREME, [row], gens).token_ids.tolist() == [2]


def test_a_below_normal_temperature_is_greedy_everywhere() -> None:
    assert SamplingParams(temperature=1e-39).greedy
    assert SamplingParams(temperature=2.0**-127).greedy
    assert not SamplingParams(temperature=2.0**-126).greedy
    assert not SamplingParams(temperature=1e-30).greedy


def test_small_temperatures_do_not_overflow_large_logits() -> None:
    # Unshifted, 1e30 / 1e-10 overflows float32: inf - inf made the whole row NaN.
    logits = torch.tensor([[0.0, 1e30, -1e30, 5e29]])
    row = RowSampling(temperature=1e-10)
    assert filtered_probs(logits, [row])[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert sample(logits, [row], [make_generator(7)]).token_ids.tolist() == [1]
    # A tied maximum stays a fair tie at any temperature.
    tied = torch.tensor([[1.0, 7.0, 2.0, 7.0]])
    assert filtered_probs(tied, [RowSampling(temperature=2.0**-126)])[0].tolist() == [
        0.0, 0.5, 0.0, 0.5,
    ]  # fmt: skip


def test_a_huge_temperature_is_uniform_over_the_finite_logits() -> None:
    got = filtered_probs(EXTREME, [RowSampling(temperature=1e300)])[0]
    torch.testing.assert_close(got, torch.tensor([0.2] * 5 + [0.0]), atol=1e-7, rtol=0)


# --- top-k and top-p without sorting the vocabulary: the sorted filters' results, bit for bit ---


def _sorted_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Top-k as a sort of each whole row states it (the reference)."""
    vocab = logits.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k])
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (ks - 1)[:, None])
    return torch.where(logits >= kth, logits, -math.inf)


def _sorted_top_p(probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Top-p as a stable sort of each whole row states it (the reference), row by row."""
    out = probs.clone()
    for i, p in enumerate(top_p):
        if p >= 1.0:
            continue
        sorted_probs, order = probs[i].sort(descending=True, stable=True)
        keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < torch.tensor(p)
        keep_sorted[0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        kept = torch.where(keep, probs[i], 0.0)
        out[i] = kept / kept.sum()
    return out


def _nucleus_rows(vocab: int) -> tuple[torch.Tensor, list[float]]:
    """Rows whose top-p sets hold from one token to most of the vocabulary, some with ties at
    every candidate boundary, with their top_p."""
    g = torch.Generator().manual_seed(11)
    rows, top_p = [], []
    for scale in (8.0, 3.0, 1.0, 0.3, 0.05, 0.0):
        for p in (0.5, 0.9, 0.95, 0.999):
            rows.append(torch.randn(vocab, generator=g) * scale)
            top_p.append(p)
    for p in (0.3, 0.9, 0.99):  # a few values repeated everywhere: ties at every boundary
        rows.append(torch.randint(0, 4, (vocab,), generator=g).float())
        top_p.append(p)
    steep = -torch.arange(vocab, dtype=torch.float32) * 0.02  # mass spread over ~1/0.02 tokens
    rows += [steep, steep.flip(0), torch.full((vocab,), -7.0)]
    top_p += [0.97, 0.97, 0.6]
    for groups in ((10, 30), (40, 900)):  # tied groups among the most likely tokens, the top-p
        row = torch.randn(vocab, generator=g) * 0.1 - 6.0  # set ending inside the second one
        spots = torch.randperm(vocab, generator=g)[: sum(groups)]
        row[spots[: groups[0]]], row[spots[groups[0] :]] = 5.0, 4.0
        rows.append(row)
        mass = torch.softmax(row, dim=-1)[spots].double()
        top_p.append(float(mass[: groups[0]].sum() + mass[groups[0] :].sum() / 2))
    return torch.softmax(torch.stack(rows), dim=-1), top_p


def test_top_p_equals_a_sort_of_the_whole_row_bit_for_bit(monkeypatch) -> None:
    probs, top_p = _nucleus_rows(49152)
    found_at: dict[int, int] = {}
    among = sampler._top_p_among

    def spy(p: torch.Tensor, t: torch.Tensor, size: int):
        found, index, kept = among(p, t, size)
        found_at[size] = found_at.get(size, 0) + int(found.sum())
        return found, index, kept

    monkeypatch.setattr(sampler, "_top_p_among", spy)
    rows = [RowSampling(top_p=p) for p in top_p]
    got = sampler._apply_top_p(probs, torch.tensor(top_p))
    assert torch.equal(got, _sorted_top_p(probs, top_p))
    # every way to the set was taken: each candidate size found some rows, and some rows
    # (the flat ones with top_p 0.999) needed the whole sort
    assert all(found_at.get(size, 0) > 0 for size in sampler.TOP_P_CANDIDATES)
    assert sum(found_at.values()) < len(rows)
    # through `filtered_probs`, mixed with rows that ask for no top-p
    logits = probs.log()
    mixed = [RowSampling(top_p=1.0), *rows[:5], RowSampling(top_p=1.0, min_p=0.1)]
    mixed_logits = torch.cat([logits[:1], logits[:5], logits[1:2]])
    expected = _sorted_top_p(torch.softmax(mixed_logits, -1), [r.top_p for r in mixed])
    got = filtered_probs(mixed_logits, mixed)
    assert torch.equal(got[:6], expected[:6])


def test_top_k_equals_a_sort_of_the_whole_row_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 49152, generator=g)
    logits[2] = torch.randint(0, 5, (49152,), generator=g).float()  # ties at the k-th value
    logits[3, :100] = -math.inf
    top_k = [1, 50, 1000, 0, 49152, 20000]
    assert torch.equal(sampler._apply_top_k(logits, top_k), _sorted_top_k(logits, top_k))
    wide = logits.double()  # rows without top-k beside rows with it, in float64
    assert torch.equal(sampler._apply_top_k(wide, top_k), _sorted_top_k(wide, top_k))


def test_a_row_without_top_p_or_min_p_is_the_same_beside_rows_with_them() -> None:
    """A row asking for no top-p (or min-p) is not filtered or renormalised because another row
    in its batch is: its probabilities are those it gets alone, bit for bit."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 49152, generator=g) * 2
    plain = RowSampling(temperature=0.9)
    alone = filtered_probs(logits[:1], [plain])
    beside = filtered_probs(logits, [plain, RowSampling(top_p=0.9), RowSampling(min_p=0.05)])
    assert torch.equal(beside[:1], alone)
    assert int((beside[1] > 0).sum()) < 49152 and int((beside[2] > 0).sum()) < 49152
