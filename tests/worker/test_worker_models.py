"""Our paged decoder against transformers on tiny random checkpoints.

Tolerances: prefill logits and hidden states in float32 must match within atol 1e-4 (the two
implementations run the same float32 ops, differing only in fused projections and reduction
order). Greedy generation runs both models in float64 so argmax ties cannot flip a token, and
must match token for token.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_reference import hf_greedy, prompts
from model_checkpoints import Checkpoint
from paged_driver import PagedDriver

from specserve.worker.attention.base import SequenceStep
from specserve.worker.loader import load_model
from specserve.worker.models import DecoderModel, ReadOut

ATOL_FP32 = 1e-4
NEW_TOKENS = 64
ALL_CKPTS = ["llama_ckpt", "qwen2_ckpt", "qwen3_ckpt", "qwen3_hybrid_ckpt"]


def _ckpt(request: pytest.FixtureRequest, name: str) -> Checkpoint:
    return request.getfixturevalue(name)


def _fp64_pair(ckpt: Checkpoint) -> tuple[DecoderModel, torch.nn.Module]:
    ours = load_model(ckpt.path, torch.float64)
    ref = copy.deepcopy(ckpt.hf_model).to(torch.float64)
    return ours, ref


def _driver(model: DecoderModel, **kw: object) -> PagedDriver:
    # Hybrid models run with out-of-window blocks nulled and the null block full of NaN.
    hybrid = len(model.config.kv_groups) > 1
    return PagedDriver(model, drop_out_of_window=hybrid, **kw)


@pytest.mark.parametrize("name", ALL_CKPTS)
def test_prefill_logits_match_transformers(request: pytest.FixtureRequest, name: str) -> None:
    """A ragged batch of three prompts, every row's logits against transformers."""
    ckpt = _ckpt(request, name)
    model = load_model(ckpt.path, torch.float32)
    driver = _driver(model)
    batch = prompts([24, 5, 13], seed=1)
    seqs = [driver.new_seq(p) for p in batch]
    logits = driver.step([(s, len(s.tokens)) for s in seqs], all_rows=True)
    expected = torch.cat([ckpt.hf_model(torch.tensor([p])).logits[0] for p in batch])
    torch.testing.assert_close(logits, expected.detach(), atol=ATOL_FP32, rtol=0)


def test_aux_hidden_states_match_transformers(qwen3_hybrid_ckpt: Checkpoint) -> None:
    """Layer i's hidden state is transformers' `hidden_states[i + 1]` (pre final norm)."""
    model = load_model(qwen3_hybrid_ckpt.path, torch.float32)
    driver = _driver(model)
    prompt = prompts([20], seed=2)[0]
    seq = driver.new_seq(prompt)
    driver.allocate(seq, len(prompt))
    meta = model.backend.build_metadata(
        [SequenceStep(len(prompt), len(prompt), seq.block_tables)],
        model.config.kv_groups,
        driver.block_size,
        "cpu",
    )
    final, aux = model.forward_with_aux(
        torch.tensor(prompt), torch.arange(len(prompt)), meta, driver.cache, [1, 0]
    )
    out = qwen3_hybrid_ckpt.hf_model(torch.tensor([prompt]), output_hidden_states=True)
    torch.testing.assert_close(aux[0], out.hidden_states[2][0].detach(), atol=ATOL_FP32, rtol=0)
    torch.testing.assert_close(aux[1], out.hidden_states[1][0].detach(), atol=ATOL_FP32, rtol=0)
    torch.testing.assert_close(final, out.hidden_states[-1][0].detach(), atol=ATOL_FP32, rtol=0)
    with pytest.raises(ValueError, match="out of range"):
        model.forward_with_aux(torch.tensor(prompt), torch.arange(20), meta, driver.cache, [3])


def _prefill_step(driver: PagedDriver, work: list[tuple[list[int], int]]):
    """A step of `work`'s (prompt, rows) pairs, each a new sequence with those rows allocated:
    its sequence steps, ids, positions and metadata."""
    steps, ids = [], []
    for prompt, n in work:
        seq = driver.new_seq(prompt)
        driver.allocate(seq, n)
        steps.append(SequenceStep(n, n, [list(t) for t in seq.block_tables]))
        ids += prompt[:n]
    cfg = driver.model.config
    meta = driver.model.backend.build_metadata(steps, cfg.kv_groups, driver.block_size, "cpu")
    positions = [p for _, n in work for p in range(n)]
    return steps, torch.tensor(ids), torch.tensor(positions), meta


@pytest.mark.parametrize("name", ALL_CKPTS)
def test_a_last_layer_read_at_some_rows_writes_every_rows_kv(
    request: pytest.FixtureRequest, name: str
) -> None:
    """A step whose final hidden states are read at a few rows: those rows' states equal the
    full forward's, and every layer's K/V of every row (the last layer's included, which the
    other rows' later steps read) equals the full forward's. A prompt still in chunks reads
    no row at all."""
    ckpt = _ckpt(request, name)
    model, ref = _fp64_pair(ckpt)
    batch = prompts([24, 5, 13], seed=3)
    work = [(batch[0], 10), (batch[1], 5), (batch[2], 13)]  # the first prompt is a chunk
    full, part = _driver(model), _driver(model)
    steps, ids, positions, meta = _prefill_step(full, work)
    _, _, _, part_meta = _prefill_step(part, work)
    expected, _ = model.forward_with_aux(ids, positions, meta, full.cache, ())
    read = torch.tensor([14, 27])  # the last rows of the two whole prompts
    read_steps = [SequenceStep(1, s.seq_len, s.block_tables) for s in steps[1:]]
    read_meta = model.backend.build_metadata(
        read_steps, model.config.kv_groups, part.block_size, "cpu"
    )
    got, _ = model.forward_with_aux(
        ids, positions, part_meta, part.cache, (), ReadOut(read, read_meta)
    )
    torch.testing.assert_close(got, expected[read], rtol=1e-12, atol=1e-12)
    for layer in full.cache.layers:
        torch.testing.assert_close(
            part.cache.layers[layer], full.cache.layers[layer], equal_nan=True
        )
    logits = model.compute_logits(got)
    for row, prompt in zip(logits, batch[1:], strict=True):
        hf_logits = ref(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(row, hf_logits.detach(), rtol=0, atol=1e-5)  # RoPE in fp32
    chunk_only = [(batch[0], 10)]
    _, ids, positions, meta = _prefill_step(full, chunk_only)
    _, _, _, part_meta = _prefill_step(part, chunk_only)
    model.forward_with_aux(ids, positions, meta, full.cache, ())
    got, _ = model.forward_with_aux(
        ids,
        positions,
        part_meta,
        part.cache,
        (),
        ReadOut(torch.tensor([], dtype=torch.int64), None),
    )
    assert got.shape == (0, model.config.hidden_size)
    for layer in full.cache.layers:
        torch.testing.assert_close(
            part.cache.layers[layer], full.cache.layers[layer], equal_nan=True
        )
    last = model.config.num_layers - 1
    with pytest.raises(ValueError, match=f"layer {last} is captured"):
        model.forward_with_aux(ids, positions, part_meta, part.cache, [last], ReadOut(read, None))


@pytest.mark.parametrize("name", ALL_CKPTS)
def test_greedy_single_request(request: pytest.FixtureRequest, name: str) -> None:
    ours, ref = _fp64_pair(_ckpt(request, name))
    prompt = prompts([24], seed=3)[0]
    got = _driver(ours).generate_greedy([prompt], NEW_TOKENS)[0]
    assert got == hf_greedy(ref, prompt, NEW_TOKENS)


@pytest.mark.parametrize("name", ["llama_ckpt", "qwen3_hybrid_ckpt"])
def test_greedy_chunked_prefill(request: pytest.FixtureRequest, name: str) -> None:
    """The prompt goes in 5-token chunks (crossing block and window edges) before decoding."""
    ours, ref = _fp64_pair(_ckpt(request, name))
    prompt = prompts([24], seed=4)[0]
    got = _driver(ours).generate_greedy([prompt], NEW_TOKENS, chunk=5)[0]
    assert got == hf_greedy(ref, prompt, NEW_TOKENS)


@pytest.mark.parametrize("name", ["llama_ckpt", "qwen3_hybrid_ckpt"])
def test_greedy_ragged_batch(request: pytest.FixtureRequest, name: str) -> None:
    """Eight prompts of different lengths prefilled in one ragged batch, then decoded together."""
    ours, ref = _fp64_pair(_ckpt(request, name))
    batch = prompts([3, 17, 1, 24, 9, 12, 6, 30], seed=5)
    got = _driver(ours).generate_greedy(batch, NEW_TOKENS)
    assert got == [hf_greedy(ref, p, NEW_TOKENS) for p in batch]


def test_greedy_staggered_mixed_steps(qwen3_hybrid_ckpt: Checkpoint) -> None:
    """Requests join one per step, so prefills share steps with other requests' decodes."""
    ours, ref = _fp64_pair(qwen3_hybrid_ckpt)
    batch = prompts([11, 4, 19, 7], seed=6)
    num_new = 24
    driver = _driver(ours)
    seqs = [driver.new_seq(p) for p in batch]
    active: list = []
    while any(len(s.generated) < num_new for s in seqs):
        if len(active) < len(seqs):
            active.append(seqs[len(active)])
        work = [(s, len(s.tokens) - s.num_computed) for s in active if len(s.generated) < num_new]
        logits = driver.step(work)
        for (seq, _), row in zip(work, logits, strict=True):
            seq.tokens.append(int(row.argmax()))
            seq.generated.append(seq.tokens[-1])
    assert [s.generated for s in seqs] == [hf_greedy(ref, p, num_new) for p in batch]


@pytest.mark.parametrize("name", ["llama_ckpt", "qwen2_ckpt"])
def test_greedy_shared_prefix(request: pytest.FixtureRequest, name: str) -> None:
    """The second request reuses the first's prefix blocks and computes only its suffix."""
    ours, ref = _fp64_pair(_ckpt(request, name))
    first = prompts([20], seed=7)[0]
    second = first[:16] + prompts([9], seed=8)[0]
    driver = _driver(ours)
    a = driver.new_seq(first)
    driver.prefill([a])
    b = driver.fork(a, second, num_shared_blocks=16 // driver.block_size)
    computed_before = b.num_computed
    driver.prefill([b])
    assert computed_before == 16 and b.block_tables[0][:4] == a.block_tables[0][:4]
    driver.decode([a, b], NEW_TOKENS - 1)
    assert a.generated == hf_greedy(ref, first, NEW_TOKENS)
    assert b.generated == hf_greedy(ref, second, NEW_TOKENS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_hold_what_rope_cos_sin_computes(dtype: torch.dtype) -> None:
    """The drafters' RoPE lookups equal `rope_cos_sin` bit for bit: positions inside the
    tables, past them (the tables grow), and for another `inv_freq` (made again)."""
    from specserve.worker.models import RopeTables, rope_cos_sin

    tables = RopeTables()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    other = 1.0 / (500000.0 ** (torch.arange(0, 32, 2).float() / 32))
    generator = torch.Generator().manual_seed(0)
    cases = [
        (inv_freq, torch.tensor([0, 5, 1023])),
        (inv_freq, torch.tensor([1024, 3, 4999])),  # past the first tables
        (inv_freq, torch.randint(0, 20_000, (37,), generator=generator)),
        (other, torch.tensor([7, 7, 8])),
        (inv_freq, torch.tensor([9])),
    ]
    for freqs, positions in cases:
        got, expected = tables(freqs, positions, dtype), rope_cos_sin(freqs, positions, dtype)
        for table, direct in zip(got, expected, strict=True):
            assert table.shape == direct.shape == (len(positions), 1, 2 * len(freqs))
            assert table.dtype == dtype and table.is_contiguous()
            assert torch.equal(table, direct)
