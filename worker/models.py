"""One decoder for Llama, Qwen2 and Qwen3 over a flattened ragged batch and a paged KV cache.

The three architectures differ only in flags read from `ModelConfig`: q/k/v (and o_proj)
biases, per-head q/k RMSNorm (Qwen3), Llama-3 RoPE scaling, sliding-window layers and tied
embeddings. q/k/v and gate/up projections are fused into single matmuls; the loader
concatenates the checkpoint's separate weights.

Hidden-state convention: "hidden state of layer i" is the output of decoder layer i, i.e. the
residual stream after its attention and MLP blocks and before the final norm. It equals
transformers' `output_hidden_states=True` entry `hidden_states[i + 1]` (whose last entry is
instead taken after the final norm).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.worker.attention.base import AttentionBackend, AttentionMetadata
from specserve.worker.cpu import ops as cpu_ops
from specserve.worker.cpu.greedy_screen import GreedyScreen, ScreenCache
from specserve.worker.cpu.linear import Linear, PackedWeight, linear, pack_again, pack_weight
from specserve.worker.kv_cache import PagedKVCache
from specserve.worker.model_config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, then scaled in the model dtype (as transformers does).

    On CPU, 2-D inputs go through the fused kernel of `worker.cpu.ops` (same steps and roundings,
    one call instead of up to nine ops) when it is available."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_ops.add_rms_norm(x, None, self.weight, self.eps)
        if fused is not None:
            return fused[1]
        if x.dtype in (torch.float32, torch.float64):  # one fused kernel, same math
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(x + delta, self(x + delta))`: a residual add and the norm after it, in one kernel
        call where `forward` would use one."""
        fused = cpu_ops.add_rms_norm(x, delta, self.weight, self.eps)
        if fused is not None:
            return fused
        total = x + delta
        return total, self(total)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies in float32 (the precision the reference models use)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama-3 scaling: long wavelengths slowed by `factor`, short kept, a smooth ramp between."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, 1, head_dim]` cos and sign-folded sin for the half-split ("rotate_half") layout.

    Rotating `x = [x1, x2]` gives `[x1 cos - x2 sin, x2 cos + x1 sin]`, i.e. `x * cos +
    [x2, x1] * [-sin, sin]`: folding the sign into sin once per step saves a negation per layer,
    and the head axis of size 1 broadcasts over any number of heads.
    """
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    cos = torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :]
    sin = torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]
    return cos, sin


class RopeTables:
    """`rope_cos_sin` on a CPU read from tables of every position up to the furthest asked for
    (made again, twice as long, when a position passes them): for a drafter's passes of a few
    rows, one lookup instead of seven small ops (~40 us a call, a few calls an EAGLE-3 round
    at batch 1). The tables hold what `rope_cos_sin` computes for each position, element by
    element; elsewhere (a GPU: reading the furthest position would wait for the device) the
    tables are computed per call."""

    MIN_POSITIONS = 1024

    def __init__(self) -> None:
        self._inv_freq: torch.Tensor | None = None  # what the tables were made from, held
        self._dtype: torch.dtype | None = None
        self._cos = self._sin = torch.empty(0)

    def __call__(
        self, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.device.type != "cpu" or inv_freq.device.type != "cpu" or not len(positions):
            return rope_cos_sin(inv_freq, positions, dtype)
        furthest = int(positions.max())
        same = self._inv_freq is inv_freq and self._dtype == dtype
        held = self._cos.shape[0] if same else 0
        if furthest >= held:
            size = max(self.MIN_POSITIONS, furthest + 1, 2 * held)
            self._cos, self._sin = rope_cos_sin(inv_freq, torch.arange(size), dtype)
            self._inv_freq, self._dtype = inv_freq, dtype
        return self._cos[positions], self._sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [T, heads, head_dim]` with `rope_cos_sin`'s tables; rolling the last axis by
    half swaps the halves into `[x2, x1]`."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


class Attention(nn.Module):
    """Fused-q/k/v attention over the paged cache; `in_features` (default `hidden_size`) is the
    width q/k/v read, e.g. 2H for EAGLE-3's first layer."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        in_features: int | None = None,
    ):
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split = (q_size, kv_size, kv_size)
        in_features = config.hidden_size if in_features is None else in_features
        self.qkv_proj = Linear(in_features, sum(self.split), config.attention_bias, device, dtype)
        self.o_proj = Linear(q_size, config.hidden_size, config.o_proj_bias, device, dtype)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        group: int,
        metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        group_meta = metadata.groups[group]
        layer_cache = kv_cache.layer(self.layer_id)
        rows = group_meta.kv_write_rows(kv_cache.block_size)
        norms = [None if n is None else n.weight for n in (self.q_norm, self.k_norm)]
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        heads = (self.num_heads, self.num_kv_heads)
        if cpu_ops.rope_write_kv(qkv, *heads, cos, sin, *norms, eps, layer_cache, rows[0]):
            q = qkv[:, : self.split[0]].view(-1, self.num_heads, self.head_dim)
        else:
            q = self._rope_and_write(qkv, cos, sin, kv_cache, rows)
        out = self.backend.forward(q, layer_cache, group_meta, self.scale)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))

    def write_context_kv(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: PagedKVCache,
        rows: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Write the K/V of rows no query reads out (`x` as `forward` takes it; `rows` from
        `kv_write_rows`): the k/v columns of `qkv_proj` alone, `k_norm`, RoPE. A drafter's
        context rows and the rows of a target's last layer that nobody reads (`ReadOut`) need
        nothing more, and q, the attention and what follows it would be a forward's larger
        part."""
        q_size, kv_size, _ = self.split
        k, v = self.qkv_proj.forward_columns(x, q_size).split(kv_size, dim=-1)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        kv_cache.write_rows(self.layer_id, apply_rope(k, cos, sin), v, rows)

    def _rope_and_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: PagedKVCache,
        rows: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """q/k norms, RoPE and the K/V write in PyTorch ops (what `rope_write_kv` does on CPU);
        returns q."""
        q_size, kv_size, _ = self.split
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, :q_size].view(-1, self.num_heads, self.head_dim))
            k = self.k_norm(
                qkv[:, q_size : q_size + kv_size].view(-1, self.num_kv_heads, self.head_dim)
            )
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # q and k are adjacent columns: rotate them in one pass
            heads = self.num_heads + self.num_kv_heads
            qk = apply_rope(qkv[:, : q_size + kv_size].view(-1, heads, self.head_dim), cos, sin)
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        kv_cache.write_rows(self.layer_id, k, v, rows)
        return q


class MLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))` with gate and up fused."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, config.mlp_bias, device, dtype)
        self.down_proj = Linear(inter, config.hidden_size, config.mlp_bias, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = cpu_ops.silu_mul(gate_up)
        if fused is not None:
            return self.down_proj(fused)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))  # in place: one activation buffer less


@dataclass(frozen=True)
class ReadOut:
    """The rows of a step whose final hidden states are read (the rows sampled from), and
    attention metadata for those rows alone as queries over the same sequences.

    The last layer's output is read only there, so every other row needs from it just its K/V
    for later steps: a prompt chunk of 2,048 rows that samples one skips the last layer's q,
    attention, o_proj and MLP for 2,047 of them (~3% of a 30-layer prefill)."""

    rows: torch.Tensor  # [R] int64 indices into the step's rows, in the order read
    metadata: AttentionMetadata | None  # None when R == 0 (prompt chunks only)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; `attn_in_features` is `Attention`'s `in_features`."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        group: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        attn_in_features: int | None = None,
    ):
        super().__init__()
        self.group = group  # index of this layer's KV group
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.attn = Attention(
            config, layer_id, backend, dtype, device, in_features=attn_in_features
        )
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, device
        )
        self.mlp = MLP(config, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        x, mlp_out = self.residual_step(x, None, cos, sin, metadata, kv_cache)
        return x + mlp_out

    def residual_step(
        self,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
        read_out: ReadOut | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on input `x + pending` (`x` when None), its output left as a pair
        `(residual, mlp_out)` whose sum it is: the next layer's (or the final) norm adds them
        in its own kernel call instead of a separate pass over the rows. With `read_out` (a
        last layer): the K/V of every row, the rest for its rows only (one pair row each)."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(x, pending)
        if read_out is not None:
            rows = metadata.groups[self.group].kv_write_rows(kv_cache.block_size)
            self.attn.write_context_kv(h, cos, sin, kv_cache, rows)
            keep = read_out.rows
            x, h, cos, sin = x[keep], h[keep], cos[keep], sin[keep]
            if read_out.metadata is None:
                return x, torch.zeros_like(x)
            metadata = read_out.metadata
        x, h = self.post_attention_layernorm.add_and_norm(
            x, self.attn(h, cos, sin, self.group, metadata, kv_cache)
        )
        return x, self.mlp(h)


class DecoderModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head (absent when tied to embeddings)."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.config = config
        self.backend = backend
        group_of_layer = {i: g for g, grp in enumerate(config.kv_groups) for i in grp.layer_ids}
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, device=device, dtype=dtype
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, group_of_layer[i], backend, dtype, device)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head: Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, device, dtype)
        self.tied_head_packed: PackedWeight | None = None  # the embedding, packed as LM head
        self._screen = ScreenCache()
        # Not a buffer: the model may be built on the meta device and loaded with `assign=True`.
        self.inv_freq = rope_inv_freq(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """Final (normed) hidden states `[T, hidden]`; K/V of all T tokens land in `kv_cache`."""
        hidden, _ = self.forward_with_aux(input_ids, positions, attn_metadata, kv_cache, ())
        return hidden

    @torch.no_grad()
    def forward_with_aux(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
        aux_layers: Sequence[int],
        read_out: ReadOut | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Like `forward`, plus the hidden states of `aux_layers` (module docstring convention);
        with `read_out`, the final hidden states of its rows alone (`[R, hidden]`), and then
        the last layer may not be among `aux_layers`.

        Layer by layer; the model runner may instead run a CPU decode step in one kernel call
        (`worker.cpu.fused_decode`), with the same results."""
        x, cos, sin = self.embed_step(input_ids, positions, attn_metadata, aux_layers)
        last = len(self.layers) - 1
        if read_out is not None and last in aux_layers:
            raise ValueError(f"layer {last} is captured: every row of it is read")
        captured: dict[int, torch.Tensor] = {}
        pending: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            x, pending = layer.residual_step(
                x, pending, cos, sin, attn_metadata, kv_cache, read_out if i == last else None
            )
            if i in aux_layers:
                captured[i] = x + pending
        hidden = self.norm(x) if pending is None else self.norm.add_and_norm(x, pending)[1]
        return hidden, [captured[i] for i in aux_layers]

    @torch.no_grad()
    def embed_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        aux_layers: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step's checked inputs: the embeddings `[T, hidden]` and the RoPE tables."""
        bad = [i for i in aux_layers if not 0 <= i < self.config.num_layers]
        if bad:
            raise ValueError(f"aux layers {bad} out of range for {self.config.num_layers} layers")
        if input_ids.shape[0] != attn_metadata.num_tokens:
            raise ValueError(
                f"{input_ids.shape[0]} input tokens but metadata for {attn_metadata.num_tokens}"
            )
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.dtype)
        return self.embed_tokens(input_ids), cos, sin

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, hidden]` final hidden states -> `[N, vocab]` logits."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return linear(hidden, self.embed_tokens.weight, None, self.tied_head_packed)

    def _head_packed(self) -> PackedWeight | None:
        """The LM head's packing: its own matrix's, or the tied embedding's."""
        return self.lm_head.packed if self.lm_head is not None else self.tied_head_packed

    def greedy_screen(self) -> GreedyScreen | None:
        """The LM head's bfloat16 screen (`cpu.greedy_screen`), made for the head's current
        packing; None where the head is not a float32 one packed as panels."""
        return self._screen.get(self._head_packed())

    def row_tiles(self) -> Callable[[int], int] | None:
        """Row tiles per step size where the decode step's linears run as panels (the layers'
        `PackedWeight.row_tiles`, whose bytes are most of a step's; they are packed alike,
        narrow panels or not), else None."""
        packed = self.layers[0].mlp.gate_up_proj.packed if self.layers else None
        return packed.row_tiles if packed is not None and packed.panels else None

    @torch.no_grad()
    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`compute_logits(hidden).argmax(-1)` (first index on ties) without every logit in
        float32, where the head's screen can promise it; None elsewhere."""
        screen = self.greedy_screen()
        return None if screen is None else screen.argmax(hidden)

    def pack_weights(self) -> list[PackedWeight]:
        """Pack a tied LM head (`worker.linear.pack_weights` packs the `Linear`s themselves)."""
        if self.lm_head is not None:
            return []
        self.tied_head_packed = pack_weight(self.embed_tokens.weight)
        return [self.tied_head_packed] if self.tied_head_packed is not None else []

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        """Moving or casting the model packs a tied LM head's new embedding again."""
        module = super()._apply(fn, recurse)
        self.tied_head_packed = pack_again(self.tied_head_packed, self.embed_tokens.weight)
        return module
