"""Reference outputs from transformers (the oracle) for the worker and service tests."""

from __future__ import annotations

import torch

VOCAB = 256


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    generated = out[0, len(prompt) :].tolist()
    assert len(generated) == max_new_tokens
    return generated
