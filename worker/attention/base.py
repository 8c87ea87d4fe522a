"""Attention backend interface and the per-step metadata every backend shares.

A forward step runs a flattened ragged batch: request r owns the contiguous token rows
`[query_start, query_start + query_len)` in request order, at positions
`seq_len - query_len .. seq_len - 1`. Metadata is built once per step for all layers (one
`GroupAttentionMetadata` per KV group) from host-side lists, always into fresh tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from specserve.worker.kv_cache import kv_write_rows
from specserve.worker.model_config import KVLayerGroup

_T = TypeVar("_T")


@dataclass(frozen=True)
class SequenceStep:
    """One request's share of a forward step.

    `causal=False` marks a draft block (DFlash): its queries see all context and every query
    token of the block, in both directions. Normal prefill, decode and multi-token verification
    are causal.
    """

    query_len: int
    seq_len: int  # context length once this step's tokens are written
    block_tables: Sequence[Sequence[int]]  # one table per KV group
    causal: bool = True

    @property
    def first_position(self) -> int:
        return self.seq_len - self.query_len


@dataclass(frozen=True)
class GroupAttentionMetadata:
    """What one KV group's layers need; backends subclass it with their own tensors."""

    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V is written
    sliding_window: int | None

    def kv_write_rows(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`kv_write_rows(slot_mapping)`, computed by the group's first layer for all."""
        return once_per_step(
            self,
            ("kv_write_rows", block_size),
            lambda: kv_write_rows(self.slot_mapping, block_size),
        )


def once_per_step(metadata: object, key: Hashable, compute: Callable[[], _T]) -> _T:
    """`compute()`, remembered on a (frozen) metadata object under `key`.

    Metadata is built afresh for every step and shared by all layers, so a value derived from
    it is computed by the first layer that needs it and can never be stale.
    """
    memo: dict[Hashable, Any] = metadata.__dict__.setdefault("_once_per_step", {})
    if key not in memo:
        memo[key] = compute()
    return memo[key]


@dataclass(frozen=True)
class AttentionMetadata:
    num_tokens: int
    groups: tuple[GroupAttentionMetadata, ...]  # indexed like `ModelConfig.kv_groups`


class AttentionBackend(ABC):
    """Builds per-step metadata and computes attention over the paged cache."""

    @abstractmethod
    def build_metadata(
        self,
        steps: Sequence[SequenceStep],
        kv_groups: Sequence[KVLayerGroup],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata: ...

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: GroupAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """`query [T, num_heads, head_dim]` -> `[T, num_heads, head_dim]`.

        `kv_cache` is the layer's `[num_blocks, 2, block_size, num_kv_heads, head_dim]` tensor,
        already holding this step's K/V.
        """


def validate_steps(steps: Sequence[SequenceStep], num_groups: int, block_size: int) -> None:
    """Reject steps whose lengths or block tables cannot describe a valid batch."""
    if not steps:
        raise ValueError("a forward step needs at least one request")
    for i, step in enumerate(steps):
        if step.query_len < 1 or step.seq_len < step.query_len:
            raise ValueError(
                f"request {i}: need 1 <= query_len <= seq_len, "
                f"got query_len={step.query_len} seq_len={step.seq_len}"
            )
        if len(step.block_tables) != num_groups:
            raise ValueError(
                f"request {i}: {len(step.block_tables)} block tables for {num_groups} KV groups"
            )
        for g, table in enumerate(step.block_tables):
            if len(table) * block_size < step.seq_len:
                raise ValueError(
                    f"request {i}, KV group {g}: {len(table)} blocks of {block_size} cannot hold "
                    f"{step.seq_len} tokens"
                )


def block_table_tensor(
    steps: Sequence[SequenceStep], group: int, device: torch.device | str
) -> torch.Tensor:
    """`[R, max_blocks]` int64 block tables of one group, padded with the null block."""
    width = max(len(s.block_tables[group]) for s in steps)
    rows = [list(s.block_tables[group]) + [0] * (width - len(s.block_tables[group])) for s in steps]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def slot_mapping(
    steps: Sequence[SequenceStep], tables: torch.Tensor, block_size: int
) -> torch.Tensor:
    """`[T]` slots of the step's new tokens, in flattened batch order."""
    device = tables.device
    query_lens = torch.tensor([s.query_len for s in steps], dtype=torch.int64, device=device)
    firsts = torch.tensor([s.first_position for s in steps], dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(torch.arange(len(steps), device=device), query_lens)
    starts = torch.cumsum(query_lens, 0) - query_lens
    offsets_in_query = torch.arange(int(query_lens.sum()), device=device) - starts[rows]
    positions = firsts[rows] + offsets_in_query
    blocks = tables[rows, positions // block_size]
    return blocks * block_size + positions % block_size
