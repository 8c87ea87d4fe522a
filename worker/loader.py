"""Load a Hugging Face checkpoint (config.json + safetensors) into a `DecoderModel`.

`build_model` takes an HF config dict and HF-named tensors, so any source that can produce
those (safetensors here, GGUF elsewhere) shares the name mapping and the error checks.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file
from torch import nn

from specserve.worker.attention.base import AttentionBackend
from specserve.worker.attention.torch_backend import TorchAttentionBackend
from specserve.worker.cpu.linear import pack_weights
from specserve.worker.model_config import ModelConfig
from specserve.worker.models import DecoderModel

logger = logging.getLogger(__name__)
_M = TypeVar("_M", bound=nn.Module)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
}
# Checkpoint tensors that carry no weights (recomputed from the config), safe to drop.
_HARMLESS = re.compile(r"(^|\.)rotary_emb\.(inv_freq|original_inv_freq)$")
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of {sorted(set(_DTYPES))}")
        return dtype
    key = dtype.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def load_model(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    backend: AttentionBackend | None = None,
) -> DecoderModel:
    """Load `path/config.json` and its single or sharded safetensors weights."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"no config.json in {path}")
    config_dict = json.loads(config_path.read_text())
    return build_model(config_dict, read_safetensors(path), dtype, device, backend)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, following the shard index when there is one."""
    index = path / _INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (path / _SINGLE_FILE).is_file():
        files = [_SINGLE_FILE]
    else:
        raise ValueError(f"no {_SINGLE_FILE} or {_INDEX_FILE} in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(path / name, device="cpu"))
    return tensors


def build_model(
    config_dict: Mapping[str, Any],
    state_dict: Mapping[str, torch.Tensor],
    dtype: torch.dtype | str,
    device: torch.device | str,
    backend: AttentionBackend | None = None,
) -> DecoderModel:
    """Build a model from an HF config dict and HF-named tensors (e.g. `model.norm.weight`)."""
    dtype = resolve_dtype(dtype)
    config = ModelConfig.from_hf(config_dict)
    ours = map_hf_state_dict(config, state_dict)
    model = DecoderModel(config, backend or TorchAttentionBackend(), dtype, device="meta")
    return assign_weights(model, ours, dtype, device)


def assign_weights(
    model: _M,
    weights: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str,
) -> _M:
    """Fill a model built on the meta device with our-named `weights` (cast to `dtype`, moved
    to `device`, assigned without copies), move its `inv_freq` along, pack its linear weights
    for the CPU (`worker.linear`), and return it frozen in eval mode. Shared by the target and
    the drafters, which all keep `inv_freq` unbuffered."""
    converted = {name: t.to(device=device, dtype=dtype) for name, t in weights.items()}
    model.load_state_dict(converted, strict=True, assign=True)
    model.inv_freq = model.inv_freq.to(device)
    model.requires_grad_(False)
    pack_weights(model)
    return model.eval()


def map_hf_state_dict(
    config: ModelConfig, hf: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Rename HF tensors to ours, fusing q/k/v and gate/up; reject missing, misshapen or
    unknown tensors, naming them as the checkpoint does."""
    used: set[str] = set()

    def take(name: str, *shape: int) -> torch.Tensor:
        if name not in hf:
            raise ValueError(f"checkpoint is missing weight {name!r} ({config.architecture})")
        tensor = hf[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, config expects {shape}"
            )
        used.add(name)
        return tensor

    vocab, hidden = config.vocab_size, config.hidden_size
    ours = {
        "embed_tokens.weight": take("model.embed_tokens.weight", vocab, hidden),
        "norm.weight": take("model.norm.weight", hidden),
    }
    if not config.tie_word_embeddings:
        ours["lm_head.weight"] = take("lm_head.weight", vocab, hidden)
    elif "lm_head.weight" in hf:
        used.add("lm_head.weight")  # a saved copy of the tied embedding
    for i in range(config.num_layers):
        ours.update(map_decoder_layer(config, take, f"model.layers.{i}.", f"layers.{i}."))

    extra = sorted(set(hf) - used)
    harmless = [n for n in extra if _HARMLESS.search(n)]
    unknown = [n for n in extra if not _HARMLESS.search(n)]
    if harmless:
        logger.debug("ignoring %d recomputed checkpoint tensors: %s", len(harmless), harmless[:4])
    if unknown:
        shown = ", ".join(unknown[:8]) + (", ..." if len(unknown) > 8 else "")
        raise ValueError(f"checkpoint has {len(unknown)} unexpected tensors: {shown}")
    return ours


def map_decoder_layer(
    config: ModelConfig,
    take: Callable[..., torch.Tensor],
    src: str,
    dst: str,
    in_features: int | None = None,
) -> dict[str, torch.Tensor]:
    """HF-named tensors of one decoder layer (`{src}self_attn.q_proj.weight`, ...) -> ours
    (`{dst}attn.qkv_proj.weight`, ...), fusing q/k/v and gate/up.

    `take(name, *shape)` returns a checked checkpoint tensor (the caller's error messages and
    bookkeeping). `in_features` is the q/k/v input width (default `hidden_size`; 2H for
    EAGLE-3's first layer, see `Attention`). The target loader passes `model.layers.{i}.`;
    drafters pass their own prefixes and take any extra tensors (e.g. EAGLE-3's
    `hidden_norm`) themselves.
    """
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    in_features = hidden if in_features is None else in_features
    q_out, kv_out = config.num_heads * head_dim, config.num_kv_heads * head_dim
    qkv_out = {"q": q_out, "k": kv_out, "v": kv_out}
    attn, mlp = src + "self_attn.", src + "mlp."
    out = {
        dst + "input_layernorm.weight": take(src + "input_layernorm.weight", hidden),
        dst + "post_attention_layernorm.weight": take(
            src + "post_attention_layernorm.weight", hidden
        ),
        dst + "attn.qkv_proj.weight": torch.cat(
            [take(f"{attn}{p}_proj.weight", n, in_features) for p, n in qkv_out.items()]
        ),
        dst + "attn.o_proj.weight": take(attn + "o_proj.weight", hidden, q_out),
        dst + "mlp.gate_up_proj.weight": torch.cat(
            [
                take(mlp + "gate_proj.weight", inter, hidden),
                take(mlp + "up_proj.weight", inter, hidden),
            ]
        ),
        dst + "mlp.down_proj.weight": take(mlp + "down_proj.weight", hidden, inter),
    }
    if config.attention_bias:
        out[dst + "attn.qkv_proj.bias"] = torch.cat(
            [take(f"{attn}{p}_proj.bias", n) for p, n in qkv_out.items()]
        )
    if config.o_proj_bias:
        out[dst + "attn.o_proj.bias"] = take(attn + "o_proj.bias", hidden)
    if config.mlp_bias:
        out[dst + "mlp.gate_up_proj.bias"] = torch.cat(
            [take(mlp + "gate_proj.bias", inter), take(mlp + "up_proj.bias", inter)]
        )
        out[dst + "mlp.down_proj.bias"] = take(mlp + "down_proj.bias", hidden)
    if config.qk_norm:
        out[dst + "attn.q_norm.weight"] = take(attn + "q_norm.weight", head_dim)
        out[dst + "attn.k_norm.weight"] = take(attn + "k_norm.weight", head_dim)
    return out
