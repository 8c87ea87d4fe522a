"""Write small random drafter checkpoints in the real on-disk formats (tests and dev runs).

Real drafters are gigabytes and tied to a specific target; these writers produce a
`config.json` + `model.safetensors` pair for any (small) target config, with the tensor names
and config fields of the released checkpoints, so loaders and the serving path can be
exercised end to end without downloads.

* `write_random_eagle3(style="eagle3")`: `LlamaForCausalLMEagle3` layout with `midlayer.*`
  (the EAGLE authors' releases); `style="speculators"`: speculators layout with `layers.0.*`
  and the layer fields in `transformer_layer_config`.
* `write_random_dflash`: z-lab `DFlashDraftModel` layout.

Drafter layers copy the target's width, heads, head_dim, RMSNorm eps and RoPE fields.
Weights are N(0, 0.1); norm weights are U(0.5, 1.5) so every norm matters in tests.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

_COPIED_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "vocab_size",
)


def write_random_eagle3(
    path: str | Path,
    target_config: Mapping[str, Any],
    style: Literal["eagle3", "speculators"] = "eagle3",
    draft_vocab_size: int | None = None,
    seed: int = 0,
    *,
    num_layers: int = 1,
    aux_layer_ids: Sequence[int] | None = None,
    norm_before_residual: bool = False,
    with_lm_head: bool = True,
    with_embed_tokens: bool = False,
) -> Path:
    """An EAGLE-3 drafter for `target_config` (an HF `config.json` dict); returns `path`.

    `draft_vocab_size` below the target vocab writes `d2t`/`t2d` for a random sorted subset of
    target ids. `aux_layer_ids` are in checkpoint convention (input of layer i); None omits
    them so loaders fall back to the default. `with_lm_head=False` (full vocab only) and
    `with_embed_tokens` exercise sharing with the target.
    """
    if style not in ("eagle3", "speculators"):
        raise ValueError(f"unknown EAGLE-3 style {style!r}")
    gen = torch.Generator().manual_seed(seed)
    layer = _layer_fields(target_config, num_layers)
    # Llama layers, or Qwen3 ones (q/k norms) in the speculators format, which has both.
    qwen3 = style == "speculators" and target_config.get("model_type") == "qwen3"
    layer["model_type"] = "qwen3" if qwen3 else "llama"
    vocab, hidden = int(layer["vocab_size"]), int(layer["hidden_size"])
    draft_vocab = vocab if draft_vocab_size is None else draft_vocab_size
    if not 0 < draft_vocab <= vocab:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab}, got {draft_vocab}")
    if not with_lm_head and draft_vocab != vocab:
        raise ValueError("a reduced draft vocabulary needs its own lm_head")

    prefix0 = "midlayer." if style == "eagle3" else "layers.0."
    n_aux = 3 if aux_layer_ids is None else len(aux_layer_ids)
    tensors: dict[str, torch.Tensor] = {
        "fc.weight": _normal(gen, hidden, n_aux * hidden),
        "norm.weight": _norm(gen, hidden),
        prefix0 + "hidden_norm.weight": _norm(gen, hidden),
    }
    for i in range(num_layers):
        prefix = prefix0 if i == 0 else f"layers.{i}."
        qkv_in = 2 * hidden if i == 0 else hidden
        tensors.update(_decoder_layer(gen, layer, prefix, qkv_in, qk_norm=qwen3))
    if with_lm_head:
        tensors["lm_head.weight"] = _normal(gen, draft_vocab, hidden)
    if with_embed_tokens:
        tensors["embed_tokens.weight"] = _normal(gen, vocab, hidden)
    if draft_vocab != vocab:
        kept = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
        tensors["d2t"] = kept - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[kept] = True
        tensors["t2d"] = t2d

    extra: dict[str, Any] = {
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": norm_before_residual,
    }
    ids = None if aux_layer_ids is None else [int(i) for i in aux_layer_ids]
    if style == "eagle3":
        config: dict[str, Any] = {
            **layer,
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "target_hidden_size": hidden,
            **extra,
        }
        if ids is not None:
            config["eagle_config"] = {
                "eagle_aux_hidden_state_layer_ids": ids,
                "use_aux_hidden_state": True,
            }
    else:
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.2.0",
            "transformer_layer_config": {**layer, "hidden_act": "silu"},
            "target_hidden_size": None,
            **extra,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {
                    "name_or_path": None,
                    "architectures": list(target_config.get("architectures") or []),
                },
            },
        }
        if ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = ids
    return _save(path, config, tensors)


def write_random_dflash(
    path: str | Path,
    target_config: Mapping[str, Any],
    num_layers: int,
    target_layer_ids: Sequence[int],
    mask_token_id: int,
    block_size: int,
    seed: int = 0,
    layer_types: Sequence[str] | None = None,
    *,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
) -> Path:
    """A z-lab-format DFlash drafter for `target_config`; returns `path`.

    `target_layer_ids` mean "output of target layer i". `layer_types` (with `sliding_window`
    for their window) and `is_causal` set per-layer causality as released drafters do.
    """
    gen = torch.Generator().manual_seed(seed)
    layer = _layer_fields(target_config, num_layers)
    hidden = int(layer["hidden_size"])
    tensors: dict[str, torch.Tensor] = {
        "fc.weight": _normal(gen, hidden, len(target_layer_ids) * hidden),
        "hidden_norm.weight": _norm(gen, hidden),
        "norm.weight": _norm(gen, hidden),
    }
    for i in range(num_layers):
        tensors.update(_decoder_layer(gen, layer, f"layers.{i}.", hidden, qk_norm=True))
    config: dict[str, Any] = {
        **layer,
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": block_size,
        "num_target_layers": int(target_config["num_hidden_layers"]),
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "target_layer_ids": [int(i) for i in target_layer_ids],
        },
    }
    if layer_types is not None:
        config["layer_types"] = list(layer_types)
    if sliding_window is not None:
        config["sliding_window"] = sliding_window
        config["use_sliding_window"] = True
    if is_causal is not None:
        config["is_causal"] = is_causal
    return _save(path, config, tensors)


def _layer_fields(target_config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    fields = {k: target_config[k] for k in _COPIED_FIELDS if target_config.get(k) is not None}
    heads = int(fields["num_attention_heads"])
    fields.setdefault("head_dim", int(fields["hidden_size"]) // heads)
    fields.setdefault("num_key_value_heads", heads)
    fields["num_hidden_layers"] = num_layers
    return fields


def _decoder_layer(
    gen: torch.Generator, layer: Mapping[str, Any], prefix: str, qkv_in: int, qk_norm: bool
) -> dict[str, torch.Tensor]:
    hidden, inter = int(layer["hidden_size"]), int(layer["intermediate_size"])
    head_dim = int(layer["head_dim"])
    q_out = int(layer["num_attention_heads"]) * head_dim
    kv_out = int(layer["num_key_value_heads"]) * head_dim
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    out = {
        prefix + "input_layernorm.weight": _norm(gen, hidden),
        prefix + "post_attention_layernorm.weight": _norm(gen, hidden),
        attn + "q_proj.weight": _normal(gen, q_out, qkv_in),
        attn + "k_proj.weight": _normal(gen, kv_out, qkv_in),
        attn + "v_proj.weight": _normal(gen, kv_out, qkv_in),
        attn + "o_proj.weight": _normal(gen, hidden, q_out),
        mlp + "gate_proj.weight": _normal(gen, inter, hidden),
        mlp + "up_proj.weight": _normal(gen, inter, hidden),
        mlp + "down_proj.weight": _normal(gen, hidden, inter),
    }
    if qk_norm:
        out[attn + "q_norm.weight"] = _norm(gen, head_dim)
        out[attn + "k_norm.weight"] = _norm(gen, head_dim)
    return out


def _normal(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * 0.1


def _norm(gen: torch.Generator, dim: int) -> torch.Tensor:
    return torch.rand(dim, generator=gen) + 0.5


def _save(path: str | Path, config: Mapping[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    return path
