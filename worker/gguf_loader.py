"""Load the bundled default model (a llama.cpp GGUF file) as Hugging Face-format weights.

The worker's model code speaks Hugging Face tensor names and layouts, so a GGUF checkpoint is
dequantized and renamed up front instead of teaching the model a second naming scheme.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import structlog
import torch

from specserve.shared.gguf_metadata import GgufMetadata, GgufTensorInfo, read_metadata

log = structlog.get_logger(__name__)

# Architectures whose tensors follow the Llama layout (and llama.cpp's Q/K row permutation).
_LLAMA_LIKE = {"llama": "LlamaForCausalLM"}

# GGUF leaf name inside a block -> Hugging Face module path inside `model.layers.N`.
_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def hf_config_from_metadata(meta: GgufMetadata) -> dict[str, Any]:
    """A `config.json`-style dict for the checkpoint, with transformers' field names."""
    arch = meta.architecture
    if arch not in _LLAMA_LIKE:
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (only llama).")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise KeyError(f"GGUF metadata lacks `{arch}.{name}`")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else None)
    if vocab is None:
        raise KeyError("GGUF metadata states no vocabulary size and holds no tokens")
    config: dict[str, Any] = {
        "architectures": [_LLAMA_LIKE[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(key("rope.dimension_count", hidden // heads)),
        "vocab_size": int(vocab),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": "output.weight" not in meta.tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in meta.tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in meta.tensor_names,
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(key("rope.scaling.factor")),
        }
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            config["rope_scaling"]["original_max_position_embeddings"] = int(original)
    for gguf_key, hf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("padding_token_id", "pad_token_id"),
    ):
        value = meta.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[hf_key] = int(value)
    return config


def hf_tensor_name(gguf_name: str) -> str | None:
    """Hugging Face name of a GGUF tensor, or None for tensors transformers has no slot for."""
    if match := _BLOCK_RE.match(gguf_name):
        layer, leaf, suffix = match.groups()
        module = _BLOCK_NAMES.get(leaf)
        return None if module is None else f"model.layers.{layer}.{module}.{suffix}"
    if match := _TOP_RE.match(gguf_name):
        leaf, suffix = match.groups()
        module = _TOP_NAMES.get(leaf)
        return None if module is None else f"{module}.{suffix}"
    return None


def unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order so rotary embedding sees halves, not interleaved pairs.

    The converter stores each head's rows as (dim/2, 2) pairs; transformers' rotary code wants
    the two halves of a head contiguous, i.e. (2, dim/2).
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def dequantize_tensor(meta: GgufMetadata, info: GgufTensorInfo) -> np.ndarray:
    """Float32 array in (out_features, in_features) order."""
    values = gguf.quants.dequantize(meta.raw(info), info.ggml_type)
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(info.shape)
    # Unquantized tensors come back as read-only views of the memory map; torch wants its own.
    return values if values.flags.writeable else values.copy()


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, Hugging Face state dict) for a Llama-architecture GGUF checkpoint.

    Quantized tensors are dequantized to float32 first and then cast to `dtype`, the same order
    transformers uses, so the two loaders agree bit for bit.
    """
    start = time.perf_counter()
    meta = read_metadata(path)
    config = hf_config_from_metadata(meta)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    total = len(meta.tensors)
    log.info("gguf.load.start", path=str(path), tensors=total, arch=meta.architecture)

    state: dict[str, torch.Tensor] = {}
    for index, tensor in enumerate(meta.tensors):
        name = hf_tensor_name(tensor.name)
        if name is None:
            log.warning("gguf.load.skip_tensor", tensor=tensor.name)
            continue
        weight = torch.from_numpy(dequantize_tensor(meta, tensor))
        if ".attn_q." in tensor.name:
            weight = unpermute_rope_rows(weight, heads)
        elif ".attn_k." in tensor.name:
            weight = unpermute_rope_rows(weight, kv_heads)
        state[name] = weight.to(dtype).contiguous()
        if (index + 1) % 50 == 0 or index + 1 == total:
            log.info("gguf.load.progress", done=index + 1, total=total)

    missing = {"model.embed_tokens.weight", "model.norm.weight"} - state.keys()
    if missing:
        raise ValueError(f"GGUF file {path} lacks required tensors: {sorted(missing)}")
    log.info(
        "gguf.load.done",
        tensors=len(state),
        params=sum(t.numel() for t in state.values()),
        seconds=round(time.perf_counter() - start, 2),
    )
    return config, state
