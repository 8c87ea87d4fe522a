"""Torch attention backend against a dense reference, and the paged KV cache.

Tolerance: float64 throughout, atol 1e-10 against the dense softmax reference.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function

from specserve.shared.config import AttentionType
from specserve.worker.attention.base import SequenceStep
from specserve.worker.attention.metadata import kv_span
from specserve.worker.attention.torch_backend import LONG_QUERY_ROWS, TorchAttentionBackend
from specserve.worker.kv_cache import (
    NULL_BLOCK,
    PagedKVCache,
    bytes_per_block,
    num_blocks_for_budget,
)
from specserve.worker.model_config import KVLayerGroup

ATOL = 1e-10
HQ, HKV, D, BS = 4, 2, 8, 4


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """q `[Q, HQ, D]`, k/v `[L, HKV, D]`, mask `[Q, L]` bool -> `[Q, HQ, D]` (GQA by repeat)."""
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _run_case(
    specs: list[tuple[int, int, bool]],
    window: int | None,
    dtype: torch.dtype = torch.float64,
    block_size: int = BS,
    head_dim: int = D,
    multi_row_kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(query_len, seq_len, causal) per request -> (backend output, float64 dense reference).

    Inputs are drawn in float64 and stored in `dtype`; the reference uses the stored values."""
    torch.manual_seed(0)
    rng = random.Random(0)
    kind = AttentionType.FULL if window is None else AttentionType.SLIDING
    group = KVLayerGroup(kind, window, (0,))
    num_blocks = max(64, 1 + sum(-(-seq_len // block_size) for _, seq_len, _ in specs))
    cache = PagedKVCache([group], num_blocks, block_size, HKV, head_dim, dtype, "cpu")
    free = list(range(1, num_blocks))
    rng.shuffle(free)  # scattered, non-contiguous block tables
    steps, queries, expected = [], [], []
    for q_len, seq_len, causal in specs:
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        k, v = (
            torch.randn(seq_len, HKV, head_dim, dtype=torch.float64).to(dtype).double(),
            torch.randn(seq_len, HKV, head_dim, dtype=torch.float64).to(dtype).double(),
        )
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        )
        cache.write(0, k, v, slots)
        q = torch.randn(q_len, HQ, head_dim, dtype=torch.float64).to(dtype)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        mask = k_pos <= q_pos if causal else torch.ones(q_len, seq_len, dtype=torch.bool)
        if window is not None:
            mask &= k_pos > q_pos - window
        steps.append(SequenceStep(q_len, seq_len, [table], causal))
        queries.append(q)
        expected.append(_dense_attention(q.double(), k, v, mask))
    backend = TorchAttentionBackend(multi_row_kernel)
    meta = backend.build_metadata(steps, [group], block_size, "cpu")
    out = backend.forward(torch.cat(queries), cache.layer(0), meta.groups[0], head_dim**-0.5)
    return out, torch.cat(expected)


MIXED = [
    (5, 16, False),  # DFlash draft block: 11 context tokens + 5 bidirectional query tokens
    (3, 9, True),  # verification / prefill chunk with context
    (1, 7, True),  # decode
    (6, 6, True),  # fresh prefill
    (1, 13, True),  # decode
    (4, 4, False),  # draft block without context
]


@pytest.mark.parametrize("window", [None, 3, 5])
def test_mixed_batch_matches_dense_reference(window: int | None) -> None:
    out, expected = _run_case(MIXED, window)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


LONG = LONG_QUERY_ROWS
LONG_MIXED = [
    (LONG + 8, LONG + 8, True),  # a prompt's first chunk: SDPA's causal kernel, no mask
    (1, 7, True),  # decode
    (LONG, 3 * LONG + 5, True),  # a later chunk: causal mask over the earlier context
    (3, 9, True),  # verification block (padded batch)
    (LONG + 1, 2 * LONG, False),  # a long draft block over context: no mask
    (LONG, LONG, False),  # a long draft block alone: no mask
]


@pytest.mark.parametrize("window", [None, 3, LONG + 20, 4 * LONG])
def test_prompt_chunks_are_attended_alone_and_match_dense_reference(window: int | None) -> None:
    """Queries of LONG_QUERY_ROWS rows or more get one SDPA call each, over exactly their keys
    (no padding to the step's longest request), beside the padded decode and short batches."""
    out, expected = _run_case(LONG_MIXED, window)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    group = KVLayerGroup(AttentionType.SLIDING if window else AttentionType.FULL, window, (0,))
    steps = [SequenceStep(q, n, [list(range(-(-n // BS)))], c) for q, n, c in LONG_MIXED]
    sdpa = TorchAttentionBackend(multi_row_kernel=False)
    meta = sdpa.build_metadata(steps, [group], BS, "cpu").groups[0]
    assert [b.query_index.shape for b in meta.batches] == [(1, 1), (1, 3)]
    keys = [kv_span(s, BS, window).kv_len for s in steps if s.query_len >= LONG]
    assert [lq.num_keys for lq in meta.long_queries] == keys
    paths = [(lq.start, lq.is_causal, lq.mask is not None) for lq in meta.long_queries]
    # With a window of 3 every long query needs a mask; a window longer than the first chunk
    # still leaves it to the causal kernel, though it hides keys of the later chunk.
    first = (0, window != 3, window == 3)
    later = (LONG + 9, False, True)
    draft = (2 * LONG + 12, False, window in (3, LONG + 20))
    alone = (3 * LONG + 13, False, window == 3)
    assert paths == [first, later, draft, alone]


def test_one_prompt_chunk_is_the_whole_step() -> None:
    steps = [SequenceStep(LONG + 3, LONG + 3, [list(range(1, 20))])]
    group = KVLayerGroup(AttentionType.FULL, None, (0,))
    sdpa = TorchAttentionBackend(multi_row_kernel=False)
    meta = sdpa.build_metadata(steps, [group], BS, "cpu").groups[0]
    assert meta.whole and not meta.batches and len(meta.long_queries) == 1
    out, expected = _run_case([(LONG + 3, LONG + 3, True)], None)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


WHOLE_STEPS = {
    "decodes": [(1, 7, True), (1, 13, True), (1, 2, True)],
    "one prefill": [(6, 9, True)],
    "equal chunks": [(3, 9, True), (3, 5, True)],
    "draft blocks": [(4, 4, False), (4, 10, False)],
}


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("specs", WHOLE_STEPS.values(), ids=WHOLE_STEPS.keys())
def test_whole_step_batches_match_dense_reference(
    specs: list[tuple[int, int, bool]], window: int | None
) -> None:
    """A step that is one unpadded batch skips the query gather and output scatter; one of
    decodes also runs its grouped query heads as rows of one SDPA problem."""
    group = KVLayerGroup(AttentionType.FULL, None, (0,))
    steps = [SequenceStep(q, n, [list(range(1, 5))], c) for q, n, c in specs]
    sdpa = TorchAttentionBackend(multi_row_kernel=False)
    (batch,) = sdpa.build_metadata(steps, [group], BS, "cpu").groups[0].batches
    assert batch.whole
    out, expected = _run_case(specs, window)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_non_causal_block_sees_later_block_tokens() -> None:
    """The draft block's first query must differ from what a causal query would compute."""
    out_nc, _ = _run_case([(5, 16, False)], None)
    out_c, _ = _run_case([(5, 16, True)], None)
    assert not torch.allclose(out_nc[0], out_c[0])
    torch.testing.assert_close(out_nc[-1], out_c[-1], atol=ATOL, rtol=0)


def test_window_rule_is_transformers_rule() -> None:
    """Our dense reference's window rule equals transformers' sliding-window causal mask."""
    window, n = 5, 12
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    zero = torch.tensor(0)
    theirs = sliding_window_causal_mask_function(window)(zero, zero, q, k)
    assert torch.equal((k <= q) & (k > q - window), theirs)


def test_invalid_steps_raise() -> None:
    group = KVLayerGroup(AttentionType.FULL, None, (0,))
    backend = TorchAttentionBackend()
    with pytest.raises(ValueError, match="cannot hold"):
        backend.build_metadata([SequenceStep(2, 9, [[1, 2]])], [group], BS, "cpu")
    with pytest.raises(ValueError, match="query_len"):
        backend.build_metadata([SequenceStep(3, 2, [[1]])], [group], BS, "cpu")
    with pytest.raises(ValueError, match="block tables"):
        backend.build_metadata([SequenceStep(1, 1, [[1], [2]])], [group], BS, "cpu")


def test_slot_mapping_follows_block_tables() -> None:
    groups = [
        KVLayerGroup(AttentionType.FULL, None, (0,)),
        KVLayerGroup(AttentionType.SLIDING, 4, (1,)),
    ]
    steps = [SequenceStep(3, 6, [[7, 3], [0, 5]]), SequenceStep(1, 1, [[9], [2]])]
    meta = TorchAttentionBackend().build_metadata(steps, groups, BS, "cpu")
    # positions 3, 4, 5 of request 0, then position 0 of request 1
    assert meta.groups[0].slot_mapping.tolist() == [7 * BS + 3, 3 * BS + 0, 3 * BS + 1, 9 * BS]
    assert meta.groups[1].slot_mapping.tolist() == [0 * BS + 3, 5 * BS + 0, 5 * BS + 1, 2 * BS]
    assert meta.groups[1].sliding_window == 4 and meta.num_tokens == 4


def test_kv_cache_layout_and_write() -> None:
    groups = [
        KVLayerGroup(AttentionType.FULL, None, (0, 2)),
        KVLayerGroup(AttentionType.SLIDING, 8, (1,)),
    ]
    cache = PagedKVCache(groups, 6, BS, HKV, D, torch.float32, "cpu")
    assert cache.layer(1).shape == (6, 2, BS, HKV, D)
    assert cache.group_of_layer == {0: 0, 2: 0, 1: 1}
    k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    cache.write(2, k, v, torch.tensor([5 * BS + 1, -1, 2 * BS + 3]))  # -1: padding
    torch.testing.assert_close(cache.layer(2)[5, 0, 1], k[0])
    torch.testing.assert_close(cache.layer(2)[5, 1, 1], v[0])
    torch.testing.assert_close(cache.layer(2)[2, 1, 3], v[2])
    torch.testing.assert_close(cache.layer(2)[NULL_BLOCK, 0, 0], k[1])  # padding -> null block
    written = (cache.layer(2)[1:] != 0).flatten(2).any(-1)  # [blocks, K/V] outside the null block
    assert int(written.sum()) == 4  # 2 real slots x (K, V)
    assert not cache.layer(0).any()


def test_write_rows_are_computed_once_per_step_from_that_steps_slots() -> None:
    """Every layer of a step reuses the rows its first layer computed; the next step's
    metadata object computes its own, so no layer ever writes with another step's slots."""
    group = KVLayerGroup(AttentionType.FULL, None, (0,))
    backend = TorchAttentionBackend()
    step1 = backend.build_metadata([SequenceStep(1, 6, [[7, 3]])], [group], BS, "cpu").groups[0]
    step2 = backend.build_metadata([SequenceStep(1, 7, [[7, 3]])], [group], BS, "cpu").groups[0]
    rows1 = step1.kv_write_rows(BS)
    assert step1.kv_write_rows(BS) is rows1  # memoised for the other layers
    # position 5 -> block 3, offset 1; cache rows are [block][K/V][offset]
    assert [r.tolist() for r in rows1] == [[3 * 2 * BS + 1], [3 * 2 * BS + BS + 1]]
    rows2 = step2.kv_write_rows(BS)
    assert [r.tolist() for r in rows2] == [[3 * 2 * BS + 2], [3 * 2 * BS + BS + 2]]


def test_num_blocks_for_budget() -> None:
    # 3 layers x (K, V) x 4 tokens x 2 heads x 8 dims x 2 bytes = 768 bytes per block
    assert (
        num_blocks_for_budget(768 * 10 + 767, bytes_per_block(3, BS, HKV, D, torch.bfloat16)) == 10
    )
    with pytest.raises(ValueError, match="at least 2"):
        num_blocks_for_budget(768 * 2 - 1, bytes_per_block(3, BS, HKV, D, torch.bfloat16))
