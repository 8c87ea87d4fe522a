"""Resolves a model name or checkpoint directory to a loaded target model and its tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from specserve.shared.gguf_metadata import find_bundled_gguf
from specserve.shared.tokenizer import BUNDLED_MODELS, Tokenizer, load_tokenizer
from specserve.worker.attention.base import AttentionBackend
from specserve.worker.gguf_loader import load_gguf
from specserve.worker.loader import build_model, load_model, resolve_dtype
from specserve.worker.models import DecoderModel

log = structlog.get_logger(__name__)


@dataclass
class LoadedModel:
    name: str
    model: DecoderModel
    tokenizer: Tokenizer | None  # None for a checkpoint shipped without tokenizer.json


def model_dtype(name: str, dtype: torch.dtype | str, device: torch.device | str) -> torch.dtype:
    """`dtype`, or for "auto" the checkpoint's own: its config's `torch_dtype` (float16 becomes
    bfloat16 on CPU, where float16 math is slow), float32 without one and for the bundled
    quantized GGUF, whose weights are dequantized."""
    if dtype != "auto":
        return resolve_dtype(dtype)
    if name in BUNDLED_MODELS:
        return torch.float32
    config_path = Path(name) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return torch.float32
    declared = config.get("torch_dtype") or config.get("dtype") or "float32"
    chosen = resolve_dtype(str(declared))
    if chosen == torch.float16 and torch.device(device).type == "cpu":
        chosen = torch.bfloat16
    return chosen


def load_target(
    name: str,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    backend: AttentionBackend | None = None,
) -> LoadedModel:
    """Load `smollm2-135m` (the bundled GGUF) or a Hugging Face checkpoint directory."""
    dtype = resolve_dtype(dtype)
    tokenizer = load_tokenizer(name)  # also rejects a name that is neither bundled nor a dir
    if name in BUNDLED_MODELS:
        config, state = load_gguf(find_bundled_gguf(), dtype)
        model = build_model(config, state, dtype, device, backend)
        return LoadedModel(name, model, tokenizer)
    path = Path(name)
    log.info("model.load.start", path=str(path), dtype=str(dtype), device=str(device))
    model = load_model(path, dtype, device, backend)
    log.info("model.load.done", path=str(path), layers=model.config.num_layers)
    return LoadedModel(str(path), model, tokenizer)
