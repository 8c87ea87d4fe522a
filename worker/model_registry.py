"""Resolves a model name or checkpoint directory to a loaded target model and its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from specserve.worker.attention.base import AttentionBackend
from specserve.worker.gguf_loader import find_bundled_gguf, load_gguf
from specserve.worker.loader import build_model, load_model, resolve_dtype
from specserve.worker.models import DecoderModel
from specserve.worker.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

BUNDLED_MODELS = ("smollm2-135m",)


@dataclass
class LoadedModel:
    name: str
    model: DecoderModel
    tokenizer: Tokenizer | None  # None for a checkpoint shipped without tokenizer.json


def load_target(
    name: str,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    backend: AttentionBackend | None = None,
) -> LoadedModel:
    """Load `smollm2-135m` (the bundled GGUF) or a Hugging Face checkpoint directory."""
    dtype = resolve_dtype(dtype)
    if name in BUNDLED_MODELS:
        path = find_bundled_gguf()
        config, state = load_gguf(path, dtype)
        model = build_model(config, state, dtype, device, backend)
        return LoadedModel(name, model, Tokenizer.from_gguf(path))
    path = Path(name)
    if not path.is_dir():
        raise ValueError(
            f"model {name!r} is neither a bundled model ({', '.join(BUNDLED_MODELS)}) "
            "nor a checkpoint directory"
        )
    log.info("model.load.start", path=str(path), dtype=str(dtype), device=str(device))
    model = load_model(path, dtype, device, backend)
    tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").is_file() else None
    log.info("model.load.done", path=str(path), layers=model.config.num_layers)
    return LoadedModel(str(path), model, tokenizer)
