"""ModelConfig parsing and checkpoint loading (sharded, errors)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from model_checkpoints import Checkpoint
from paged_driver import PagedDriver
from safetensors.torch import load_file, save_file

from specserve.shared.config import AttentionType, KVGroupSpec
from specserve.worker.loader import build_model, load_model, read_safetensors
from specserve.worker.model_config import ModelConfig
from specserve.worker.models import rope_inv_freq

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def _llama_dict(**overrides: object) -> dict:
    base = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    return base.to_dict() | {"architectures": ["LlamaForCausalLM"]} | overrides


def test_rope_scaling_spellings_agree_with_transformers() -> None:
    old = _llama_dict(rope_theta=5e5, rope_scaling=dict(LLAMA3_ROPE), rope_parameters=None)
    new = _llama_dict(rope_parameters=dict(LLAMA3_ROPE, rope_theta=5e5))
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(new)
    cfg = ModelConfig.from_hf(new)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling is not None
    hf_config = transformers.LlamaConfig(**{k: v for k, v in new.items() if k != "architectures"})
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)
    torch.testing.assert_close(rope_inv_freq(cfg), rotary.inv_freq, atol=0, rtol=0)


def test_unsupported_rope_type() -> None:
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf(_llama_dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}))


@pytest.mark.parametrize("use_sliding_window", [True, False])
def test_qwen2_layer_types_match_transformers(use_sliding_window: bool) -> None:
    hf = transformers.Qwen2Config(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=5,
        use_sliding_window=use_sliding_window,
        sliding_window=16,
        max_window_layers=3,
    )
    raw = hf.to_dict() | {"architectures": ["Qwen2ForCausalLM"], "layer_types": None}
    cfg = ModelConfig.from_hf(raw)
    assert [t.value for t in cfg.layer_types] == [
        {"full_attention": "full", "sliding_attention": "sliding"}[t] for t in hf.layer_types
    ]
    assert cfg.sliding_window == hf.sliding_window
    assert cfg.attention_bias and not cfg.o_proj_bias and not cfg.qk_norm
    if use_sliding_window:
        assert cfg.kv_groups[0].layer_ids == (0, 1, 2)
        assert cfg.kv_groups[1].layer_ids == (3, 4) and cfg.kv_groups[1].sliding_window == 16
        assert cfg.kv_group_specs(16)[1] == KVGroupSpec(AttentionType.SLIDING, 16, 16)
    else:
        assert len(cfg.kv_groups) == 1


def test_qwen3_fields(qwen3_hybrid_ckpt: Checkpoint) -> None:
    raw = json.loads((qwen3_hybrid_ckpt.path / "config.json").read_text())
    cfg = ModelConfig.from_hf(raw | {"eos_token_id": [3, 4]})
    assert cfg.head_dim == 16 and cfg.qk_norm and not cfg.attention_bias
    assert cfg.layer_types == (AttentionType.SLIDING, AttentionType.FULL, AttentionType.SLIDING)
    assert [g.layer_ids for g in cfg.kv_groups] == [(1,), (0, 2)]
    assert cfg.sliding_window == 8 and cfg.eos_token_ids == (3, 4)


def test_sliding_layers_without_active_window_raise() -> None:
    raw = transformers.Qwen3Config(num_hidden_layers=2).to_dict() | {
        "architectures": ["Qwen3ForCausalLM"],
        "layer_types": ["sliding_attention", "full_attention"],
        "use_sliding_window": False,
    }
    with pytest.raises(ValueError, match="no sliding window is active"):
        ModelConfig.from_hf(raw)


def test_unknown_architecture_names_it_and_the_supported_ones(llama_ckpt: Checkpoint) -> None:
    raw = _llama_dict(architectures=["MistralForCausalLM"])
    with pytest.raises(ValueError, match=r"MistralForCausalLM.*LlamaForCausalLM"):
        ModelConfig.from_hf(raw)
    bad = Path(str(llama_ckpt.path) + "_bad_arch")
    shutil.copytree(llama_ckpt.path, bad)
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(raw | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel"):
        load_model(bad)


def test_sharded_checkpoint_loads_like_single(llama_sharded_ckpt: Checkpoint) -> None:
    path = llama_sharded_ckpt.path
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1
    model = load_model(path, "float32")
    ids = torch.tensor([[5, 17, 99, 3]])
    expected = llama_sharded_ckpt.hf_model(ids).logits[0].detach()
    driver = PagedDriver(model)
    seq = driver.new_seq(ids[0].tolist())
    torch.testing.assert_close(driver.step([(seq, 4)], all_rows=True), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", torch.float64])
def test_dtypes(qwen2_ckpt: Checkpoint, dtype: str | torch.dtype) -> None:
    model = load_model(qwen2_ckpt.path, dtype)
    assert {p.dtype for p in model.parameters()} == {model.dtype}
    assert model.lm_head is None  # tied embeddings


def test_unsupported_dtype(qwen2_ckpt: Checkpoint) -> None:
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(qwen2_ckpt.path, "int8")


def _config_and_weights(ckpt: Checkpoint) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((ckpt.path / "config.json").read_text()), read_safetensors(ckpt.path)


def test_missing_weight_is_named(qwen3_ckpt: Checkpoint) -> None:
    config, weights = _config_and_weights(qwen3_ckpt)
    del weights["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ValueError, match=r"missing weight 'model\.layers\.1\.self_attn\.k_norm"):
        build_model(config, weights, torch.float32, "cpu")


def test_missing_weight_in_checkpoint_dir(llama_ckpt: Checkpoint, tmp_path: Path) -> None:
    shutil.copy(llama_ckpt.path / "config.json", tmp_path / "config.json")
    weights = load_file(llama_ckpt.path / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weight 'lm_head\.weight'"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        load_model(tmp_path)


def test_wrong_shape_is_named(llama_ckpt: Checkpoint) -> None:
    config, weights = _config_and_weights(llama_ckpt)
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape"):
        build_model(config, weights, torch.float32, "cpu")


def test_extra_tensors(llama_ckpt: Checkpoint) -> None:
    config, weights = _config_and_weights(llama_ckpt)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    build_model(config, weights, torch.float32, "cpu")  # recomputed buffer: ignored
    weights["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.mlp\.extra_proj"):
        build_model(config, weights, torch.float32, "cpu")


@pytest.mark.parametrize(
    ("declared", "device", "want"),
    [
        ({"torch_dtype": "bfloat16"}, "cpu", torch.bfloat16),
        ({"torch_dtype": "float32"}, "cpu", torch.float32),
        ({"dtype": "bfloat16"}, "cpu", torch.bfloat16),  # newer configs name it `dtype`
        ({"torch_dtype": "float16"}, "cpu", torch.bfloat16),  # float16 math is slow on CPU
        ({"torch_dtype": "float16"}, "cuda", torch.float16),
        ({}, "cpu", torch.float32),
    ],
)
def test_auto_dtype_is_the_checkpoints_own(tmp_path, declared, device, want) -> None:
    from specserve.worker.model_registry import model_dtype

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **declared}))
    assert model_dtype(str(tmp_path), "auto", device) == want
    assert model_dtype(str(tmp_path), "float16", device) == torch.float16  # given: as given
    assert model_dtype("smollm2-135m", "auto", device) == torch.float32  # dequantized GGUF
