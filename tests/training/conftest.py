"""A tiny chat model for drafter-training tests: random Llama weights of a few layers, with
the bundled SmolLM2 tokenizer and chat template, saved as a Hugging Face checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve.shared.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def chat_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = load_tokenizer("smollm2-135m")
    assert tokenizer is not None and tokenizer.chat_template is not None
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=8,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_ids[0],
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("chat_target")
    model.save_pretrained(path)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": tokenizer.chat_template})
    )
    return path
