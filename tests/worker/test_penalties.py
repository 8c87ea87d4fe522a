"""Presence, frequency and repetition penalties, against transformers on the same weights.

The repetition penalty is the one transformers implements (`repetition_penalty` in `generate`);
presence and frequency penalties (OpenAI's) are checked against a step-by-step reference that
penalizes transformers' own logits. With speculation on, a request with penalties is simply not
speculated, so its output is the same as without.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import prompts

from specserve.llm import LLM
from specserve.shared.protocol import SamplingParams
from specserve.worker.sampler import apply_penalties

MAX_TOKENS = 24


def hf_penalized_greedy(
    model: torch.nn.Module, prompt: list[int], n: int, presence: float, frequency: float
) -> list[int]:
    """Greedy decoding on transformers' logits with OpenAI's penalties applied by hand."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=len(logits))
            logits = logits - frequency * counts - presence * (counts > 0).float()
            token = int(torch.argmax(logits))
            out.append(token)
            ids.append(token)
    return out


@pytest.fixture(scope="module")
def llm(llama_ckpt):
    return LLM(str(llama_ckpt.path), block_size=4, num_blocks=256, max_model_len=256)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(llm, llama_ckpt, penalty):
    batch = prompts([5, 9, 14], seed=3)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, repetition_penalty=penalty
    )
    for prompt, out in zip(batch, llm.generate(batch, params), strict=True):
        ids = torch.tensor([prompt])
        expected = llama_ckpt.hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
            do_sample=False, repetition_penalty=penalty,
        )[0, len(prompt):].tolist()  # fmt: skip
        assert out.token_ids == expected


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 0.9), (0.6, 0.6)])
def test_presence_and_frequency_penalties_match_a_reference(llm, llama_ckpt, presence, frequency):
    batch = prompts([6, 11], seed=5)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
        presence_penalty=presence, frequency_penalty=frequency,
    )  # fmt: skip
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    penalized = llm.generate(batch, params)
    unpenalized = llm.generate(batch, plain)
    for prompt, out in zip(batch, penalized, strict=True):
        ref = hf_penalized_greedy(llama_ckpt.hf_model, prompt, MAX_TOKENS, presence, frequency)
        assert out.token_ids == ref
    assert any(o.token_ids != b.token_ids for o, b in zip(penalized, unpenalized, strict=True))


def test_penalties_mix_with_plain_requests_in_one_batch(llm, llama_ckpt):
    """Rows without penalties in the same step are untouched."""
    batch = prompts([7, 7, 9], seed=11)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, frequency_penalty=1.0
        ),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    ]
    outs = llm.generate(batch, params)
    model = llama_ckpt.hf_model
    assert outs[0].token_ids == hf_penalized_greedy(model, batch[0], MAX_TOKENS, 0.0, 0.0)
    assert outs[1].token_ids == hf_penalized_greedy(model, batch[1], MAX_TOKENS, 0.0, 1.0)
    assert outs[2].token_ids == hf_penalized_greedy(model, batch[2], MAX_TOKENS, 0.0, 0.0)


def test_a_request_with_penalties_is_not_speculated_and_loses_nothing(llama_ckpt):
    motif = prompts([6], seed=9)[0]
    prompt = motif * 5  # n-gram speculation drafts plenty here
    spec = LLM(str(llama_ckpt.path), spec_method="ngram", num_spec_tokens=4, block_size=4,
               num_blocks=128)  # fmt: skip
    plain = LLM(str(llama_ckpt.path), block_size=4, num_blocks=128)
    for params in (
        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, presence_penalty=0.8),
        SamplingParams(max_tokens=32, seed=4, ignore_eos=True, repetition_penalty=1.2),
    ):
        (with_spec,) = spec.generate(prompt, params)
        (without,) = plain.generate(prompt, params)
        assert with_spec.token_ids == without.token_ids
    assert spec.spec_stats.num_drafts == 0


def test_apply_penalties_formula():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)]
    out = apply_penalties(logits, params, [([0], [1, 1, 3])])
    # token 0 (prompt): 2/2; token 1 (output twice): -1*2 - 0.5*2 - 0.25; token 2: untouched;
    # token 3 (output once): 3/2 - 0.5 - 0.25
    assert out.tolist() == [[1.0, -3.25, 0.5, 0.75]]
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0]]  # the input is left as it was


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\]"),
        ("frequency_penalty", float("nan"), r"frequency_penalty must be in \[-2, 2\]"),
        ("repetition_penalty", 0.0, r"repetition_penalty must be in \(0, 2\]"),
        ("repetition_penalty", float("inf"), r"repetition_penalty must be in \(0, 2\]"),
    ],
)
def test_absurd_penalties_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value}).validate()
