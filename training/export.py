"""Write trained drafters in the checkpoint formats vLLM, SGLang and specserve load.

EAGLE-3: `LlamaForCausalLMEagle3` (the EAGLE authors' release format: `midlayer.*`, `fc`,
`norm`, `lm_head`, `d2t`, `t2d`; aux layers in `eagle_config` in the "input of layer i"
convention). DFlash: z-lab's `DFlashDraftModel` (Qwen3-style `layers.*`, `fc`, `hidden_norm`,
`norm`; `dflash_config.mask_token_id` and `target_layer_ids` in the "output of layer i"
convention). Both have no embeddings and (DFlash) no LM head of their own: the target's are
shared. A `specserve_training` entry records how the drafter was made.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specserve.worker.model_config import ModelConfig


def layer_fields(config: ModelConfig, num_layers: int) -> dict[str, Any]:
    """Hugging Face config fields of drafter layers shaped like the target's."""
    fields: dict[str, Any] = {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": num_layers,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
    }
    scaling = config.rope_scaling
    if scaling is not None:
        fields["rope_scaling"] = {
            "rope_type": scaling.rope_type,
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    return fields


def eagle3_config(
    target: ModelConfig,
    aux_layer_ids: Sequence[int],
    draft_vocab_size: int,
    dtype: torch.dtype,
    provenance: Mapping[str, Any],
) -> dict[str, Any]:
    """`aux_layer_ids` in specserve's "output of layer i" convention (checkpoint ids are +1)."""
    return {
        **layer_fields(target, 1),
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": target.hidden_size,
        "norm_before_residual": False,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in aux_layer_ids],
            "use_aux_hidden_state": True,
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
        "specserve_training": dict(provenance),
    }


def dflash_config(
    target: ModelConfig,
    num_layers: int,
    target_layer_ids: Sequence[int],
    mask_token_id: int,
    block_size: int,
    dtype: torch.dtype,
    provenance: Mapping[str, Any],
) -> dict[str, Any]:
    return {
        **layer_fields(target, num_layers),
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "num_target_layers": target.num_layers,
        "dflash_config": {
            "mask_token_id": int(mask_token_id),
            "target_layer_ids": [int(i) for i in target_layer_ids],
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
        "specserve_training": dict(provenance),
    }


def save_checkpoint(
    out: Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> None:
    """`config.json` + `model.safetensors`; floating tensors cast to `dtype`. Each file is
    written under a temporary name and renamed, so a reader never sees half a checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    cast = {
        name: (
            t.detach().to("cpu", dtype) if t.is_floating_point() else t.detach().cpu()
        ).contiguous()
        for name, t in tensors.items()
    }
    weights_tmp = out / "model.safetensors.tmp"
    save_file(cast, str(weights_tmp), metadata={"format": "pt"})
    config_tmp = out / "config.json.tmp"
    config_tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights_tmp.replace(out / "model.safetensors")
    config_tmp.replace(out / "config.json")
