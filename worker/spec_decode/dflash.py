"""DFlash drafter: one forward drafts a whole block, conditioned on injected target features.

Per step the runner (1) captures the target's hidden states at `aux_layer_ids()`, (2) fuses
the newly verified rows with `combine_hidden_states` (`fc`), (3) stores them as K/V in every
drafter layer with `write_context_kv` at those rows' positions and slots (`hidden_norm` ->
k/v projections -> `k_norm` -> RoPE on K; no `input_layernorm`), then (4) runs `forward` on
the query block `[next_token, MASK x K]` at the next K+1 positions. Block queries attend to
all context K/V plus the whole block (bidirectionally in non-causal layers); the block's own
K/V lands at its slots and is overwritten by context K/V once those positions are verified.
Rows 1..K predict the tokens at their own positions (`compute_logits` uses the target's LM
head).

Aux layer ids. DFlash's `target_layer_ids` already mean "output of decoder layer i" (the
reference reads HF `hidden_states[i + 1]`), which is specserve's convention, so
`aux_layer_ids()` returns them unchanged. (vLLM adds 1 because its targets capture layer
inputs.)

Per-layer attention (`resolve_layer_attention`): a top-level `is_causal` wins, then
`dflash_config.causal`; otherwise a layer is causal iff its `layer_types[i]` is
`sliding_attention`, and with no `layer_types` every layer is non-causal. Sliding layers use
`sliding_window`; `dflash_config.use_swa` puts every layer on `swa_window_size` (or
`sliding_window`).

Checkpoint: `architectures: ["DFlashDraftModel"]`, Qwen3 layer fields, `block_size`,
`num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids}`; tensors
`layers.{i}.*` (Qwen3 names, with q/k norms), `fc.weight`, `hidden_norm.weight`,
`norm.weight`. No embeddings or LM head: the target's are used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specserve.worker.attention.base import AttentionBackend, SequenceStep
from specserve.worker.cpu.linear import Linear
from specserve.worker.kv_cache import PagedKVCache, kv_write_rows
from specserve.worker.loader import assign_weights, map_decoder_layer
from specserve.worker.model_config import ModelConfig
from specserve.worker.models import (
    DecoderLayer,
    DecoderModel,
    RMSNorm,
    rope_cos_sin,
    rope_inv_freq,
)
from specserve.worker.spec_decode.drafter import (
    DraftAttentionMetadata,
    HiddenStateDrafter,
    LayerAttention,
    TargetParts,
    TensorSource,
    build_draft_metadata,
    int_tuple,
    layer_config,
    placement,
    read_config,
    read_tensors,
)

_ARCHITECTURE = "DFlashDraftModel"
_LAYER_TYPES = ("full_attention", "sliding_attention")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default: `[L//2]` for one draft layer, else evenly spread over 1..L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    step = (last - first) / (num_draft_layers - 1)
    return [round(first + i * step) for i in range(num_draft_layers)]


def resolve_layer_attention(hf: Mapping[str, Any], num_layers: int) -> tuple[LayerAttention, ...]:
    """Causality and sliding window of each drafter layer (module docstring rules)."""
    dflash = dict(hf.get("dflash_config") or {})
    names = hf.get("layer_types")
    if names is not None:
        if len(names) != num_layers:
            raise ValueError(f"DFlash layer_types has {len(names)} entries for {num_layers} layers")
        unknown = sorted({n for n in names if n not in _LAYER_TYPES})
        if unknown:
            raise ValueError(f"DFlash: unsupported layer types {unknown}")
    sliding = [n == "sliding_attention" for n in names] if names else [False] * num_layers

    if hf.get("is_causal") is not None:
        causal = [bool(hf["is_causal"])] * num_layers
    elif dflash.get("causal") is not None:
        causal = [bool(dflash["causal"])] * num_layers
    else:
        causal = sliding

    if dflash.get("use_swa"):
        window = _window(dflash.get("swa_window_size") or hf.get("sliding_window"), "use_swa")
        windows = [window] * num_layers
    elif any(sliding) and hf.get("sliding_window") is not None:
        window = _window(hf["sliding_window"], "sliding_window")
        windows = [window if s else None for s in sliding]
    else:
        windows = [None] * num_layers
    return tuple(LayerAttention(c, w) for c, w in zip(causal, windows, strict=True))


def _window(value: Any, field: str) -> int:
    if value is None or int(value) <= 0:
        raise ValueError(f"DFlash {field} needs a positive sliding window, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class DFlashConfig:
    layer: ModelConfig  # Qwen3-style drafter layers
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # output of target layer i (our convention)
    layer_attention: tuple[LayerAttention, ...]
    block_size: int | None  # trained block length B; K = B - 1 drafts per step
    num_target_layers: int | None
    target_hidden_size: int | None

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], num_target_layers: int | None = None) -> DFlashConfig:
        """Parse a DFlash `config.json`; `num_target_layers` fills a missing field of that name
        (needed only to default `target_layer_ids`)."""
        archs = list(hf.get("architectures") or [])
        if _ARCHITECTURE not in archs:
            raise ValueError(f"not a DFlash config: architectures={archs}, need {_ARCHITECTURE}")
        dflash = dict(hf.get("dflash_config") or {})
        for field in ("attention_sink_bias", "mask_embedding"):
            if dflash.get(field):
                raise ValueError(f"DFlash dflash_config.{field} is not supported")
        if hf.get("is_neox_style", True) is False:
            raise ValueError("DFlash is_neox_style=false (interleaved RoPE) is not supported")
        layer = layer_config(hf, "Qwen3ForCausalLM", "DFlash")
        draft_vocab = dflash.get("draft_vocab_size", hf.get("draft_vocab_size"))
        if draft_vocab is not None and int(draft_vocab) != layer.vocab_size:
            raise ValueError("DFlash with a reduced draft vocabulary (d2t) is not supported")

        mask = dflash.get("mask_token_id", hf.get("mask_token_id"))
        if mask is None:
            raise ValueError("DFlash config has no dflash_config.mask_token_id")
        num_target = hf.get("num_target_layers", num_target_layers)
        ids = dflash.get("target_layer_ids", hf.get("target_layer_ids"))
        if ids is None:
            if num_target is None:
                raise ValueError(
                    "DFlash config has neither dflash_config.target_layer_ids nor "
                    "num_target_layers to derive them from"
                )
            ids = default_target_layer_ids(int(num_target), layer.num_layers)
        target_hidden = dflash.get("target_hidden_size", hf.get("target_hidden_size"))
        block_size = hf.get("block_size")
        return cls(
            layer=layer,
            mask_token_id=int(mask),
            target_layer_ids=int_tuple(ids, "dflash_config.target_layer_ids"),
            layer_attention=resolve_layer_attention(hf, layer.num_layers),
            block_size=None if block_size is None else int(block_size),
            num_target_layers=None if num_target is None else int(num_target),
            target_hidden_size=None if target_hidden is None else int(target_hidden),
        )


class DFlashDrafter(HiddenStateDrafter[DFlashConfig]):
    """Built by `load_dflash`; holds only the drafter's own weights (see `TargetParts`)."""

    def __init__(
        self,
        config: DFlashConfig,
        target: TargetParts,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__(config, target, backend)
        layer = config.layer
        hidden = layer.hidden_size
        fc_in = len(config.target_layer_ids) * target.hidden_size
        self.fc = Linear(fc_in, hidden, False, device, dtype)
        self.hidden_norm = RMSNorm(hidden, layer.rms_norm_eps, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(layer, i, 0, backend, dtype, device) for i in range(layer.num_layers)
        )
        self.norm = RMSNorm(hidden, layer.rms_norm_eps, dtype, device)
        # Not a buffer: built on the meta device and loaded with `assign=True` (as the target).
        self.inv_freq = rope_inv_freq(layer)

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def aux_layer_ids(self) -> list[int]:
        """Target layers to capture: `target_layer_ids` as is (both mean output of layer i)."""
        return list(self.config.target_layer_ids)

    def build_attn_metadata(
        self, steps: Sequence[SequenceStep], block_size: int, device: torch.device | str
    ) -> DraftAttentionMetadata:
        """Per-layer metadata for the query blocks; each step carries the target's
        full-attention table and `seq_len` = last query position + 1."""
        return build_draft_metadata(
            self.backend, steps, self.config.layer_attention, block_size, device
        )

    @torch.no_grad()
    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """`[T, n*H_t]` concatenated aux hidden states (in `aux_layer_ids` order) -> `[T, H]`."""
        if aux.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"DFlash fc expects {self.fc.in_features} features "
                f"({len(self.config.target_layer_ids)} target layers x target hidden), got "
                f"{aux.shape[-1]}"
            )
        return self.fc(aux.to(self.dtype))

    @torch.no_grad()
    def write_context_kv(
        self,
        context: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: PagedKVCache,
    ) -> None:
        """Store fused target features `context [N, H]` as K/V of every drafter layer.

        Same K path as a layer's own tokens minus `input_layernorm` (the rows are normalised
        once by `hidden_norm`): k/v projection, `k_norm`, RoPE at `positions`. Negative slots
        are skipped (padding rows).
        """
        if not context.shape[0] == positions.shape[0] == slot_mapping.shape[0]:
            raise ValueError(
                f"DFlash context: {context.shape[0]} rows, {positions.shape[0]} positions, "
                f"{slot_mapping.shape[0]} slots"
            )
        x = self.hidden_norm(context.to(self.dtype))
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.dtype)
        rows = kv_write_rows(slot_mapping, kv_cache.block_size)  # the same for every layer
        for layer in self.layers:
            layer.attn.write_context_kv(x, cos, sin, kv_cache, rows)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: DraftAttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """Final normed hidden states `[T, H]` of the query blocks; writes their K/V."""
        if not input_ids.shape[0] == positions.shape[0] == attn_metadata.num_tokens:
            raise ValueError(
                f"DFlash forward: {input_ids.shape[0]} ids, {positions.shape[0]} positions, "
                f"metadata for {attn_metadata.num_tokens} tokens"
            )
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.dtype)
        x = self.target.embed_tokens(input_ids).to(self.dtype)
        for layer, meta in zip(self.layers, attn_metadata.per_layer, strict=True):
            x = layer(x, cos, sin, meta, kv_cache)
        return self.norm(x)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, H]` -> `[N, target_vocab]` through the target's LM head."""
        return self.target.compute_logits(hidden)


def load_dflash(
    path: str | Path,
    target: DecoderModel,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    backend: AttentionBackend | None = None,
) -> DFlashDrafter:
    """Load a DFlash checkpoint for `target`; dtype, device and backend default to the target's."""
    path = Path(path)
    hf = read_config(path)
    config = DFlashConfig.from_hf(hf, num_target_layers=target.config.num_layers)
    return build_dflash(
        config, TensorSource(read_tensors(path), "DFlash"), target, dtype, device, backend
    )


def build_dflash(
    config: DFlashConfig,
    tensors: TensorSource,
    target: DecoderModel,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    backend: AttentionBackend | None = None,
) -> DFlashDrafter:
    """Check the checkpoint against the config and the target, then build the drafter."""
    dtype, device = placement(target, dtype, device)
    parts = TargetParts.of(target)
    _check_target(config, parts)
    layer = config.layer
    hidden = layer.hidden_size
    take = tensors.take
    fc_in = len(config.target_layer_ids) * parts.hidden_size
    weights = {
        "fc.weight": take("fc.weight", hidden, fc_in),
        "hidden_norm.weight": take("hidden_norm.weight", hidden),
        "norm.weight": take("norm.weight", hidden),
    }
    for i in range(layer.num_layers):
        weights.update(map_decoder_layer(layer, take, f"layers.{i}.", f"layers.{i}."))
    tensors.check_all_used()

    model = DFlashDrafter(config, parts, backend or target.backend, dtype, device="meta")
    return assign_weights(model, weights, dtype, device)


def _check_target(config: DFlashConfig, target: TargetParts) -> None:
    L = target.num_layers
    bad = [i for i in config.target_layer_ids if not 0 <= i < L]
    if bad:
        raise ValueError(
            f"DFlash target_layer_ids {bad} (output of layer i) are out of range 0..{L - 1} for "
            f"a {L}-layer target"
        )
    if config.num_target_layers not in (None, L):
        raise ValueError(
            f"DFlash was trained for a {config.num_target_layers}-layer target; this one has {L}"
        )
    if config.target_hidden_size not in (None, target.hidden_size):
        raise ValueError(
            f"DFlash target_hidden_size {config.target_hidden_size} != target hidden size "
            f"{target.hidden_size}"
        )
    if config.layer.hidden_size != target.hidden_size:
        raise ValueError(
            f"DFlash hidden size {config.layer.hidden_size} != target's {target.hidden_size} "
            "(it embeds block tokens with the target's embeddings)"
        )
    if not 0 <= config.mask_token_id < target.vocab_size:
        raise ValueError(
            f"DFlash mask_token_id {config.mask_token_id} is outside the target vocab "
            f"0..{target.vocab_size - 1}"
        )
    if config.layer.vocab_size not in (0, target.vocab_size):
        raise ValueError(
            f"DFlash vocab_size {config.layer.vocab_size} != target vocab {target.vocab_size}"
        )
