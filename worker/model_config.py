"""Model configuration parsed from a Hugging Face `config.json` dict.

Only the fields the decoder needs are kept, already resolved: defaults filled in, the two RoPE
spellings (`rope_scaling` + `rope_theta`, and the newer `rope_parameters`) unified, and the
per-layer attention type decided the way the installed transformers decides it (see
`_layer_types`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specserve.shared.config import AttentionType, KVGroupSpec

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LAYER_TYPES = {"full_attention": AttentionType.FULL, "sliding_attention": AttentionType.SLIDING}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (the only scaled RoPE supported)."""

    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class KVLayerGroup:
    """Decoder layers that share one block table per request (one attention type)."""

    attention: AttentionType
    sliding_window: int | None
    layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    layer_types: tuple[AttentionType, ...]
    sliding_window: int | None  # set only when some layer uses sliding attention
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Parse a `config.json` dict; raise ValueError for anything the decoder cannot run."""
        arch = _architecture(hf)
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{arch}: only hidden_act='silu' is supported, got {act!r}")
        layer_types, window = _layer_types(arch, hf)
        rope_theta, rope_scaling = _rope(hf)
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            vocab_size=int(hf["vocab_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and never an o_proj bias; Llama and Qwen3 put
            # `attention_bias` on all four projections.
            attention_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
            o_proj_bias=False if arch == "Qwen2ForCausalLM" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)) if arch == "LlamaForCausalLM" else False,
            qk_norm=arch == "Qwen3ForCausalLM",
            layer_types=layer_types,
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf.get("eos_token_id")),
        )

    @functools.cached_property
    def kv_groups(self) -> tuple[KVLayerGroup, ...]:
        """Full-attention layers first, then sliding-window layers; empty groups are dropped.
        (Made once: every step asks for it, a few times.)

        The control plane must order its KV groups the same way (`kv_group_specs`).
        """
        groups = []
        for kind in (AttentionType.FULL, AttentionType.SLIDING):
            ids = tuple(i for i, t in enumerate(self.layer_types) if t == kind)
            if ids:
                window = self.sliding_window if kind == AttentionType.SLIDING else None
                groups.append(KVLayerGroup(kind, window, ids))
        return tuple(groups)

    def kv_group_specs(self, block_size: int) -> tuple[KVGroupSpec, ...]:
        """The control plane's view of `kv_groups`, in the same order."""
        return tuple(KVGroupSpec(g.attention, block_size, g.sliding_window) for g in self.kv_groups)


def _architecture(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(hf.get("model_type", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        name = arch or f"model_type={hf.get('model_type')!r}"
        raise ValueError(
            f"unsupported architecture {name}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _layer_types(arch: str, hf: Mapping[str, Any]) -> tuple[tuple[AttentionType, ...], int | None]:
    """Per-layer attention types, resolved like transformers 5 does.

    Llama has no sliding window. For Qwen2/Qwen3 the window exists only when
    `use_sliding_window` is true; without explicit `layer_types`, layers with index
    `>= max_window_layers` slide and the rest use full attention.
    """
    num_layers = int(hf["num_hidden_layers"])
    window = None
    if arch != "LlamaForCausalLM" and hf.get("use_sliding_window", False):
        window = hf.get("sliding_window")
    names = hf.get("layer_types")
    if names is None:
        first_sliding = int(hf.get("max_window_layers", num_layers))
        names = [
            "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
            for i in range(num_layers)
        ]
    if len(names) != num_layers:
        raise ValueError(f"layer_types has {len(names)} entries for {num_layers} layers")
    unknown = sorted({n for n in names if n not in _LAYER_TYPES})
    if unknown:
        raise ValueError(f"unsupported layer types {unknown}; supported: {sorted(_LAYER_TYPES)}")
    types = tuple(_LAYER_TYPES[n] for n in names)
    if AttentionType.SLIDING not in types:
        return types, None
    if window is None or int(window) <= 0:
        raise ValueError(
            "layer_types has sliding_attention layers but no sliding window is active "
            "(needs use_sliding_window=true and a positive sliding_window)"
        )
    return types, int(window)


def _rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either `rope_parameters` or `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {_SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    original = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(original),
    )
    return theta, scaling


def _eos_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
