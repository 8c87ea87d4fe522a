"""Pure-PyTorch attention over the paged KV cache (CPU and CUDA).

Requests are split into two padded batches: single-token queries (decode) and the rest
(prefill chunks, verification blocks, draft blocks). Each batch gathers its requests' K/V from
the cache in one indexing op and runs one `scaled_dot_product_attention` call with an explicit
boolean mask, so a step costs two attention calls per layer whatever its size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.worker.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    GroupAttentionMetadata,
    SequenceStep,
    block_table_tensor,
    slot_mapping,
    validate_steps,
)
from specserve.worker.attention.metadata import first_visible_position, query_starts
from specserve.worker.config import KVLayerGroup
from specserve.worker.kv_cache import kv_row_index


@dataclass(frozen=True)
class PaddedBatch:
    """Requests padded to `[B, Q]` queries and `[B, L]` keys for one SDPA call."""

    query_index: torch.Tensor  # [B, Q] rows of the flattened batch (padding points at row 0)
    k_rows: torch.Tensor  # [B * L] K row of each gathered key (`kv_row_index`); V is bs rows on
    mask: torch.Tensor  # [B, 1, Q, L] bool, True where the query attends to the key
    out_rows: torch.Tensor  # [N] rows of the flattened batch that this batch computes
    out_select: torch.Tensor  # [N] their index into the flattened `[B * Q]` output


@dataclass(frozen=True)
class TorchGroupMetadata(GroupAttentionMetadata):
    batches: tuple[PaddedBatch, ...]


class TorchAttentionBackend(AttentionBackend):
    def build_metadata(
        self,
        steps: Sequence[SequenceStep],
        kv_groups: Sequence[KVLayerGroup],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        validate_steps(steps, len(kv_groups), block_size)
        starts = query_starts(steps)
        decode_rows = [i for i, s in enumerate(steps) if s.query_len == 1]
        other_rows = [i for i, s in enumerate(steps) if s.query_len > 1]
        groups = []
        for g, group in enumerate(kv_groups):
            tables = block_table_tensor(steps, g, device)
            batches = tuple(
                _padded_batch(steps, rows, starts, tables, block_size, group.sliding_window)
                for rows in (decode_rows, other_rows)
                if rows
            )
            groups.append(
                TorchGroupMetadata(
                    slot_mapping=slot_mapping(steps, tables, block_size),
                    sliding_window=group.sliding_window,
                    batches=batches,
                )
            )
        return AttentionMetadata(num_tokens=sum(s.query_len for s in steps), groups=tuple(groups))

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: GroupAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        assert isinstance(metadata, TorchGroupMetadata)
        out = torch.empty_like(query)
        num_heads, head_dim = query.shape[1], query.shape[2]
        rows = kv_cache.view(-1, *kv_cache.shape[3:])  # [num_blocks * 2 * bs, Hkv, D]
        block_size = kv_cache.shape[2]
        for batch in metadata.batches:
            q = query[batch.query_index].transpose(1, 2)  # [B, H, Q, D]
            shape = (q.shape[0], -1, *kv_cache.shape[3:])  # [B, L, Hkv, D]
            k = rows.index_select(0, batch.k_rows).view(shape).transpose(1, 2)
            v = rows.index_select(0, batch.k_rows + block_size).view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=batch.mask, scale=scale, enable_gqa=True
            )
            o = o.transpose(1, 2).reshape(-1, num_heads, head_dim)
            out[batch.out_rows] = o[batch.out_select]
        return out


def _padded_batch(
    steps: Sequence[SequenceStep],
    rows: list[int],
    query_starts: list[int],
    tables: torch.Tensor,
    block_size: int,
    window: int | None,
) -> PaddedBatch:
    """Index tensors and mask for requests `rows`, built with tensor ops (no per-token loops).

    Keys are gathered from the first position any query of the request can see: 0 for full
    attention, `first_position - window + 1` for a sliding window. A key at position `k` is
    visible to a query at position `p` when `k <= p` (causal) or `k < seq_len` (draft block),
    and, with a window, when `k > p - window` (transformers' sliding-window rule).
    """
    device = tables.device

    def column(values: list[int] | list[bool], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)[:, None]

    sub = [steps[r] for r in rows]
    q_lens = column([s.query_len for s in sub], torch.int64)
    seq_lens = column([s.seq_len for s in sub], torch.int64)
    causal = column([s.causal for s in sub], torch.bool)
    starts = column([query_starts[r] for r in rows], torch.int64)
    firsts = seq_lens - q_lens
    kv_starts = column([first_visible_position(s, window) for s in sub], torch.int64)

    # Sizes come from the host-side lists, so building never waits on the device.
    max_q = max(s.query_len for s in sub)
    max_kv = max(s.seq_len - first_visible_position(s, window) for s in sub)
    q_idx = torch.arange(max_q, device=device)[None, :]
    q_valid = q_idx < q_lens  # [B, Q]
    q_pos = firsts + q_idx
    k_pos = kv_starts + torch.arange(max_kv, device=device)[None, :]  # [B, L]
    k_valid = k_pos < seq_lens

    limit = torch.where(causal, q_pos, seq_lens - 1)  # last visible key per query
    mask = k_valid[:, None, :] & (k_pos[:, None, :] <= limit[:, :, None])
    if window is not None:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - window
    # Padded query rows get one visible key so the softmax stays finite; their output is dropped.
    mask[:, :, 0] |= ~q_valid

    # Padding keys re-read the request's last key: real data, so masked-out scores stay finite.
    gather_pos = torch.minimum(k_pos, seq_lens - 1)
    kv_slots = (
        tables[rows].gather(1, gather_pos // block_size) * block_size + gather_pos % block_size
    )
    flat_valid = q_valid.flatten()
    return PaddedBatch(
        query_index=torch.where(q_valid, starts + q_idx, 0),
        k_rows=kv_row_index(kv_slots, block_size).flatten(),
        mask=mask[:, None],
        out_rows=(starts + q_idx).flatten()[flat_valid],
        out_select=torch.nonzero(flat_valid).flatten(),
    )
