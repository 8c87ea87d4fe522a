"""The CPU kernels as model code calls them: one function per op.

Each returns the kernel's result where the kernel applies (a CPU tensor of a dtype it runs,
the library built) and None where it does not, so a caller keeps its PyTorch ops as the one
fallback and never asks which kernels exist.
"""

from __future__ import annotations

import torch

from specserve.worker.cpu import kernels


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`(x + delta, rms_norm(x + delta) * weight)` for `[T, H]` rows (no add without delta)."""
    tensors = (x, weight[None]) if delta is None else (x, delta, weight[None])
    if x.dim() != 2 or not kernels.rows_supported(*tensors):
        return None
    return kernels.add_rms_norm(x, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """`silu(gate) * up` for `[T, 2I]` rows `[gate | up]`."""
    if gate_up.dim() != 2 or not kernels.rows_supported(gate_up):
        return None
    return kernels.silu_mul(gate_up)


def rope_write_kv(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    kv_cache: torch.Tensor,
    k_rows: torch.Tensor,
) -> bool:
    """q/k norms, RoPE and the K/V write in place on `qkv` (`kernels.rope_write_kv`); False
    where the kernel does not apply and nothing was done."""
    if qkv.dim() != 2 or not kernels.rope_supported(qkv, cos, kv_cache):
        return False
    kernels.rope_write_kv(qkv, heads, kv_heads, cos, sin, q_norm, k_norm, eps, kv_cache, k_rows)
    return True


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """`x.argmax(dim=-1)` of `[N, V]` rows (first index on ties)."""
    if x.dim() != 2 or not kernels.rows_supported(x):
        return None
    return kernels.argmax_rows(x)


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    k_pages: torch.Tensor,
    first_key_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor | None:
    """One query per request over its pages of the cache (`kernels.paged_decode_attention`)."""
    if not kernels.attention_supported(query, kv_cache):
        return None
    return kernels.paged_decode_attention(
        query, kv_cache, k_pages, first_key_pos, seq_lens, window, scale
    )


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    table: torch.Tensor,
    pages: torch.Tensor,
    window: int | None,
    scale: float,
    out: torch.Tensor,
) -> bool:
    """Multi-row queries over their pages of the cache, into `out`
    (`kernels.paged_prefill_attention`); False where the kernel does not apply and nothing
    was done."""
    if not kernels.prefill_supported(query, kv_cache):
        return False
    kernels.paged_prefill_attention(query, kv_cache, table, pages, window, scale, out)
    return True
