"""Paged KV cache: one `[num_blocks, 2, block_size, num_kv_heads, head_dim]` tensor per layer.

The layout is FlashInfer's NHD paged layout (index 0 of dim 1 is K, 1 is V), so a later GPU
backend can use the same storage. A token's slot is `block_id * block_size + offset`. Block 0 is
the null block: the scheduler never hands it out, so writes to it (padding, tables whose
out-of-window entries point at it) are harmless and it is never read as real context.

Layers are split into KV groups by attention type (`ModelConfig.kv_groups`); each group has its
own block table per request, and every group is given the same number of blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.worker.memory import zeros_in_huge_pages
from specserve.worker.model_config import KVLayerGroup

NULL_BLOCK = 0


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block index costs across all layers (K and V)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    """Largest block count whose caches fit in `budget_bytes`.

    `block_bytes` is what one block index costs across every layer that shares the block ids
    (`bytes_per_block`, plus a drafter's layers). Raises ValueError if the budget cannot hold the
    null block plus one usable block.
    """
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 2:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes holds {num_blocks} blocks of {block_bytes} bytes; "
            "need at least 2 (block 0 is the null block)"
        )
    return num_blocks


def kv_row_index(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Row of each slot's K in a layer cache viewed as `[num_blocks * 2 * block_size, H, D]`.

    The cache is contiguous, so that view is free, and one-index row copies (`index_select`,
    `index_copy_`) beat indexing the 5-D tensor with two index tensors. V is `block_size` rows on.
    """
    return (slots // block_size) * (2 * block_size) + slots % block_size


def kv_write_rows(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows (`kv_row_index`) where the tokens at `slot_mapping` are written.

    Negative slots (padding) are sent to the null block, which is harmless and keeps the
    write free of host-device synchronisation.
    """
    k_rows = kv_row_index(slot_mapping.clamp(min=NULL_BLOCK * block_size), block_size)
    return k_rows, k_rows + block_size


class PagedKVCache:
    """Per-layer paged K/V storage plus the layer -> KV group map."""

    def __init__(
        self,
        groups: Sequence[KVLayerGroup],
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is the null block)")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.groups = tuple(groups)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.group_of_layer: dict[int, int] = {
            layer: g for g, group in enumerate(self.groups) for layer in group.layer_ids
        }
        shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
        on_cpu = torch.device(device).type == "cpu"
        self.layers: dict[int, torch.Tensor] = {
            layer: zeros_in_huge_pages(shape, dtype)
            if on_cpu
            else torch.zeros(shape, dtype=dtype, device=device)
            for layer in sorted(self.group_of_layer)
        }
        # What the CPU's fused decode step keeps for this cache: its tables of layer addresses
        # (`fused_decode.stack_for`), which die with it.
        self.decode_stacks: dict[object, object] = {}  # and the packing generation they hold for

    def layer(self, layer: int) -> torch.Tensor:
        return self.layers[layer]

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store `k`, `v` (`[T, num_kv_heads, head_dim]`) at `slot_mapping` (`[T]`, int64)."""
        self.write_rows(layer, k, v, kv_write_rows(slot_mapping, self.block_size))

    def write_rows(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Store `k`, `v` at the K and V rows from `kv_write_rows` (computed once per step)."""
        cache = self.layers[layer]
        flat = cache.view(-1, *cache.shape[3:])
        k_rows, v_rows = rows
        flat.index_copy_(0, k_rows, k.to(cache.dtype))
        flat.index_copy_(0, v_rows, v.to(cache.dtype))
