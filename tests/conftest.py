"""Test-session setup shared by every test folder, and tiny random checkpoints saved in real
Hugging Face format by transformers (the oracle's weights)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch
from model_checkpoints import Checkpoint

from specserve.launch.local_redis import LocalRedis, RedisNotFound

transformers = pytest.importorskip("transformers")

# The test models are tiny: intra-op threads only add overhead (and contend on small hosts).
torch.set_num_threads(1)

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,  # peakier logits than the default keep greedy argmax gaps wide
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _save(
    tmp_path_factory: pytest.TempPathFactory, name: str, model: torch.nn.Module, **kw: object
) -> Checkpoint:
    path = tmp_path_factory.mktemp(name)
    model.eval()
    model.save_pretrained(path, **kw)
    return Checkpoint(path, model)


def _seeded(cls: type, config: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls(config)


def _reinit(
    model: torch.nn.Module, suffix: str, init: Callable[[torch.nn.Parameter], object]
) -> None:
    """Re-draw in place (from the global RNG, in parameter order) every parameter whose name
    ends with `suffix`."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(suffix):
                init(param)


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """Llama with Llama-3 RoPE scaling whose thresholds fall inside the head's frequency range."""
    config = transformers.LlamaConfig(
        **COMMON,
        num_hidden_layers=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    return _save(tmp_path_factory, "llama", _seeded(transformers.LlamaForCausalLM, config))


@pytest.fixture(scope="session")
def llama_sharded_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    config = transformers.LlamaConfig(**COMMON, num_hidden_layers=2)
    model = _seeded(transformers.LlamaForCausalLM, config)
    return _save(tmp_path_factory, "llama_sharded", model, max_shard_size="40KB")


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """Qwen2: q/k/v biases and tied embeddings."""
    config = transformers.Qwen2Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=True)
    model = _seeded(transformers.Qwen2ForCausalLM, config)
    # Biases start at zero; make them matter.
    _reinit(model, "proj.bias", lambda param: param.normal_(0, 0.5))
    return _save(tmp_path_factory, "qwen2", model)


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """Qwen3: explicit head_dim (not hidden / heads) and q/k norms."""
    config = transformers.Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=32)
    model = _seeded(transformers.Qwen3ForCausalLM, config)
    # Norm weights start at one; make them matter.
    _reinit(model, "norm.weight", lambda param: param.uniform_(0.5, 1.5))
    return _save(tmp_path_factory, "qwen3", model)


@pytest.fixture(scope="session")
def qwen3_hybrid_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """Qwen3 mixing sliding-window (window 8) and full-attention layers."""
    config = transformers.Qwen3Config(
        **COMMON,
        num_hidden_layers=3,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    return _save(tmp_path_factory, "qwen3_hybrid", _seeded(transformers.Qwen3ForCausalLM, config))


@pytest.fixture(scope="session", autouse=True)
def service_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`specserve up` (and `generate --url` after it) keep their CURVE keys in $SPECSERVE_KEYS:
    a session folder, never the user's own key directory."""
    keys = str(tmp_path_factory.mktemp("service-keys") / "keys")
    before = os.environ.get("SPECSERVE_KEYS")
    os.environ["SPECSERVE_KEYS"] = keys
    yield keys
    if before is None:
        os.environ.pop("SPECSERVE_KEYS", None)
    else:
        os.environ["SPECSERVE_KEYS"] = before


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real Redis for the whole session: REDIS_URL if set, else a private server. Tests keep to
    their own namespaces, so a shared REDIS_URL server is left as it was found."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    try:
        server = LocalRedis().start()
    except RedisNotFound as exc:
        pytest.skip(f"{exc}; REDIS_URL is not set either")
    try:
        yield server.url
    finally:
        server.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests where no CUDA device is present, with the reason shown."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
