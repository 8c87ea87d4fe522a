"""Decoder-layer parts with autograd, named as Hugging Face checkpoints name them.

The serving modules (`worker/models.py`) run over a paged KV cache without gradients; a
drafter is trained over whole sequences with dense masks, so it gets these plain modules. The
parameter names (`self_attn.q_proj`, `mlp.gate_proj`, ...) are the checkpoint's, so a
`state_dict` is what the drafter loaders read. RoPE is the serving code's (`rope_cos_sin`,
`apply_rope`), so training and serving rotate identically.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specserve.worker.model_config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm in float32, scaled in the input dtype (as the serving `RMSNorm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU with separate gate and up projections (the checkpoint layout)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SelfAttention(nn.Module):
    """q/k/v/o projections (optionally reading wider inputs) and optional per-head q/k norms."""

    def __init__(self, config: ModelConfig, in_features: int, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(in_features, q_out, bias=False)
        self.k_proj = nn.Linear(in_features, kv_out, bias=False)
        self.v_proj = nn.Linear(in_features, kv_out, bias=False)
        self.o_proj = nn.Linear(q_out, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)
        return q if self.q_norm is None else self.q_norm(q)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        return (k if self.k_norm is None else self.k_norm(k)), v

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, kv_heads, D]` -> `[T, heads, D]` (grouped-query attention)."""
        return x.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Linear weights N(0, std), norms 1: the usual start for a decoder trained from scratch."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            nn.init.normal_(sub.weight, std=std)
        elif isinstance(sub, RMSNorm):
            nn.init.ones_(sub.weight)
