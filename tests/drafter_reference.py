"""Dense reference forwards of the EAGLE-3 and DFlash drafters, written from the papers'
equations: plain torch over whole sequences (no paging, no fused projections) reading the
weights straight from checkpoint tensors, so they check the tensor-name mapping as well as the
math. Used by the drafter tests and the drafter-training tests."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from specserve.worker.models import DecoderModel
from specserve.worker.spec_decode.drafter import LayerAttention

Weights = Mapping[str, torch.Tensor]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Half-split RoPE on `[T, heads, head_dim]`."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions.float()[:, None] * inv[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    a, b = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`q [Tq, h, d]`, `k/v [Tk, kvh, d]`, `mask [Tq, Tk]` (True = visible) -> `[Tq, h*d]`."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).flatten(1)


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, kind: LayerAttention) -> torch.Tensor:
    mask = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    if kind.causal:
        mask &= k_pos[None, :] <= q_pos[:, None]
    if kind.sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - kind.sliding_window
    return mask


@dataclass(frozen=True)
class Dims:
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    theta: float

    @classmethod
    def of(cls, layer: Mapping[str, Any]) -> Dims:
        return cls(
            layer["num_attention_heads"],
            layer["num_key_value_heads"],
            layer["head_dim"],
            layer["rms_norm_eps"],
            layer.get("rope_theta") or layer["rope_parameters"]["rope_theta"],
        )


def _heads(x: torch.Tensor, n: int, d: Dims) -> torch.Tensor:
    return x.view(x.shape[0], n, d.head_dim)


def _qk_norm(w: Weights, p: str, name: str, x: torch.Tensor, d: Dims) -> torch.Tensor:
    key = f"{p}self_attn.{name}_norm.weight"
    return _rms(x, w[key], d.eps) if key in w else x


def _mlp_block(w: Weights, p: str, h: torch.Tensor, d: Dims) -> torch.Tensor:
    x = _rms(h, w[p + "post_attention_layernorm.weight"], d.eps)
    gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
    return h + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def _self_attn(
    w: Weights, p: str, x: torch.Tensor, pos: torch.Tensor, kind: LayerAttention, d: Dims
) -> torch.Tensor:
    """Ordinary attention of rows `x` (already input-normed) over themselves."""
    a = p + "self_attn."
    q = _rope(
        _qk_norm(w, p, "q", _heads(x @ w[a + "q_proj.weight"].T, d.heads, d), d), pos, d.theta
    )
    k = _rope(
        _qk_norm(w, p, "k", _heads(x @ w[a + "k_proj.weight"].T, d.kv_heads, d), d), pos, d.theta
    )
    v = _heads(x @ w[a + "v_proj.weight"].T, d.kv_heads, d)
    return _attend(q, k, v, _mask(pos, pos, kind)) @ w[a + "o_proj.weight"].T


def eagle3_dense(
    w: Weights,
    num_layers: int,
    norm_before_residual: bool,
    embed: torch.Tensor,
    ids: torch.Tensor,
    hidden: torch.Tensor,
    d: Dims,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request, positions 0..T-1, causal: `(norm(h), h)` per the EAGLE-3 semantics."""
    pos = torch.arange(len(ids))
    p0 = "midlayer." if "midlayer.hidden_norm.weight" in w else "layers.0."
    normed_hidden = _rms(hidden, w[p0 + "hidden_norm.weight"], d.eps)
    residual = normed_hidden if norm_before_residual else hidden
    x = torch.cat([_rms(embed[ids], w[p0 + "input_layernorm.weight"], d.eps), normed_hidden], -1)
    h = residual + _self_attn(w, p0, x, pos, LayerAttention(True), d)
    h = _mlp_block(w, p0, h, d)
    for i in range(1, num_layers):
        p = f"layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], d.eps)
        h = _mlp_block(w, p, h + _self_attn(w, p, x, pos, LayerAttention(True), d), d)
    return _rms(h, w["norm.weight"], d.eps), h


def dflash_dense(
    w: Weights,
    kinds: Sequence[LayerAttention],
    embed: torch.Tensor,
    features: torch.Tensor,
    block_ids: torch.Tensor,
    d: Dims,
) -> torch.Tensor:
    """One request: context = target features of positions 0..N-1, block at N..N+B-1.

    Per layer, queries come from the block only; keys/values are the fused context
    (fc -> hidden_norm -> k/v proj -> k_norm -> RoPE, no input_layernorm) followed by the
    block's own, as in the reference model.
    """
    n, b = features.shape[0], len(block_ids)
    ctx = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], d.eps)
    ctx_pos, blk_pos = torch.arange(n), torch.arange(n, n + b)
    key_pos = torch.cat([ctx_pos, blk_pos])
    h = embed[block_ids]
    for i, kind in enumerate(kinds):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        x = _rms(h, w[p + "input_layernorm.weight"], d.eps)
        q = _rope(
            _qk_norm(w, p, "q", _heads(x @ w[a + "q_proj.weight"].T, d.heads, d), d),
            blk_pos,
            d.theta,
        )
        both = torch.cat([ctx, x])
        k = _qk_norm(w, p, "k", _heads(both @ w[a + "k_proj.weight"].T, d.kv_heads, d), d)
        k = _rope(k, key_pos, d.theta)
        v = _heads(both @ w[a + "v_proj.weight"].T, d.kv_heads, d)
        out = _attend(q, k, v, _mask(blk_pos, key_pos, kind)) @ w[a + "o_proj.weight"].T
        h = _mlp_block(w, p, h + out, d)
    return _rms(h, w["norm.weight"], d.eps)


def borrowed_head_logits(target: DecoderModel, hidden: torch.Tensor) -> torch.Tensor:
    """What a drafter that borrows the target's LM head gets: the logits of the head's screen
    (a bfloat16 or int8 copy) where the target has one and it pays at this many rows (within
    the copy's rounding of the head's own logits), else the head."""
    full = target.compute_logits(hidden.to(target.dtype))
    screen = target.greedy_screen()
    if screen is None or not screen.pays(hidden.shape[0], exact=False):
        return full
    logits = screen.logits(hidden)
    torch.testing.assert_close(logits.float(), full, atol=0.02 * full.abs().max(), rtol=0)
    return logits
