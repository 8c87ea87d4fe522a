"""The real scheduler and model runner, in process, against transformers' greedy generate.

Unlike the paged-driver tests, these go through block allocation, prefix caching, chunked
prefill, preemption and the msgspec step contract.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hf_reference import hf_greedy, prompts

from specserve.control.request import Request
from specserve.llm import LLM
from specserve.shared.protocol import SamplingParams

CHECKPOINTS = ["llama_ckpt", "qwen3_ckpt", "qwen3_hybrid_ckpt"]
GREEDY64 = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def _llm(ckpt, **kwargs) -> LLM:
    kwargs.setdefault("num_blocks", 256)
    kwargs.setdefault("block_size", 4)
    return LLM(str(ckpt.path), **kwargs)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_single_request_matches_transformers(request, name):
    ckpt = request.getfixturevalue(name)
    (prompt,) = prompts([21])
    (out,) = _llm(ckpt).generate(prompt, GREEDY64)
    assert out.token_ids == hf_greedy(ckpt.hf_model, prompt, 64)
    assert out.finish_reason == "length"


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_chunked_prefill_and_eight_ragged_requests_in_one_batch(request, name):
    ckpt = request.getfixturevalue(name)
    batch = prompts([3, 9, 17, 24, 30, 5, 12, 40], seed=1)
    # A budget of 16 tokens per step chunks every prompt longer than that across steps while
    # the others decode beside them.
    llm = _llm(ckpt, max_num_batched_tokens=16)
    outs = llm.generate(batch, GREEDY64)
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == hf_greedy(ckpt.hf_model, prompt, 64)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_requests_sharing_a_cached_prefix(request, name):
    ckpt = request.getfixturevalue(name)
    (prefix, tail_a, tail_b) = prompts([24, 5, 7], seed=2)
    llm = _llm(ckpt)
    (first,) = llm.generate(prefix + tail_a, GREEDY64)
    stats = llm.engine.scheduler.kv.stats
    hits_before = stats.hits
    (second,) = llm.generate(prefix + tail_b, GREEDY64)
    assert stats.hits - hits_before >= 16  # the second prompt reused cached prefix blocks
    assert first.token_ids == hf_greedy(ckpt.hf_model, prefix + tail_a, 64)
    assert second.token_ids == hf_greedy(ckpt.hf_model, prefix + tail_b, 64)


def test_preemption_in_a_tiny_pool_keeps_outputs_exact(qwen3_hybrid_ckpt):
    batch = prompts([10, 14, 18, 22], seed=3)
    # 4 requests growing to ~90 tokens need ~92 blocks of 4; 48 force preemption by recompute.
    llm = _llm(qwen3_hybrid_ckpt, num_blocks=48)
    outs = llm.generate(batch, GREEDY64)
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == hf_greedy(qwen3_hybrid_ckpt.hf_model, prompt, 64)
    assert llm.engine.scheduler.num_preemptions > 0


def test_a_prompt_longer_than_the_model_allows_is_a_clear_error(llama_ckpt):
    llm = _llm(llama_ckpt, max_model_len=32)
    with pytest.raises(ValueError, match="at most 31 prompt tokens"):
        llm.generate(list(range(40)), GREEDY64)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([1, 2, 100_000], GREEDY64)
    with pytest.raises(ValueError, match="top_p must be in"):
        llm.generate([1, 2], SamplingParams(top_p=0.0))


SEEDED = SamplingParams(max_tokens=40, temperature=1.0, seed=1234, ignore_eos=True)


def test_seeded_sampling_survives_preemption_and_resumption(llama_ckpt):
    """A seeded request draws per output position, so where it was cut never shows."""
    batch = prompts([10, 14, 18, 22], seed=5)
    params = [msgspec.structs.replace(SEEDED, seed=1234 + i) for i in range(4)]
    roomy = [o.token_ids for o in _llm(llama_ckpt).generate(batch, params)]
    assert len({tuple(t) for t in roomy}) == 4  # distinct seeds, distinct samples

    tight = _llm(llama_ckpt, num_blocks=28)  # ~62 tokens each need 16 blocks of 4: preempts
    assert [o.token_ids for o in tight.generate(batch, params)] == roomy
    assert tight.engine.scheduler.num_preemptions > 0

    # Resumption elsewhere: a fresh engine given the prompt plus the first 15 tokens so far.
    engine = _llm(llama_ckpt).engine
    request = Request("resumed", batch[0], params[0])
    request.all_token_ids.extend(roomy[0][:15])
    engine.add_request(request)
    continued: list[int] = []
    while engine.has_unfinished_requests():
        for update in engine.step():
            continued.extend(update.new_token_ids)
    assert continued == roomy[0][15:]


def _hf_prompt_logprobs(model, prompt: list[int], top: int):
    """transformers' log-softmax at each prompt position: the next prompt token's logprob and
    the top `top` (ids, logprobs)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
    values, ids = logprobs.topk(top, dim=-1)
    return chosen.tolist(), ids.tolist(), values.tolist()


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_prompt_logprobs_match_transformers_across_chunks_and_a_cached_prefix(request, name):
    """Every prompt token's logprob (from the second) and the top 3 at its position, for a prompt
    chunked over steps and for one whose prefix is cached: that prefix is computed again, and
    the prompt logprobs arrive once, with the first output token."""
    ckpt = request.getfixturevalue(name)
    (prefix, tail) = prompts([24, 13], seed=3)
    llm = _llm(ckpt, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    llm.generate(prefix + prompts([5], seed=4)[0], GREEDY64)  # caches the prefix's blocks
    hits_before = llm.engine.scheduler.kv.stats.hits
    (out,) = llm.generate(prefix + tail, params)
    assert llm.engine.scheduler.kv.stats.hits == hits_before  # computed, not taken from cache
    prompt = prefix + tail
    assert out.token_ids == hf_greedy(ckpt.hf_model, prompt, 4)
    got = out.prompt_logprobs
    assert got is not None and len(got.chosen) == len(prompt) - 1
    chosen, top_ids, top_lps = _hf_prompt_logprobs(ckpt.hf_model, prompt, 3)
    assert got.chosen == pytest.approx(chosen, abs=1e-4)
    assert got.top_ids == top_ids
    assert [v for row in got.top_logprobs for v in row] == pytest.approx(
        [v for row in top_lps for v in row], abs=1e-4
    )
    (plain,) = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_survive_preemption(llama_ckpt):
    """Requests preempted by recompute compute their prompts again; their prompt logprobs still
    arrive once, whole and equal to transformers'."""
    batch = prompts([10, 14, 18, 22], seed=5)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    llm = _llm(llama_ckpt, num_blocks=28, max_num_batched_tokens=16)
    outs = llm.generate(batch, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == hf_greedy(llama_ckpt.hf_model, prompt, 40)
        chosen, _, _ = _hf_prompt_logprobs(llama_ckpt.hf_model, prompt, 1)
        assert out.prompt_logprobs is not None
        assert out.prompt_logprobs.chosen == pytest.approx(chosen, abs=1e-4)
        assert out.prompt_logprobs.top_ids == [[] for _ in chosen]


def test_two_engines_stepped_in_turn_each_match_transformers(llama_ckpt):
    """`generate_stepwise`, as `bench/lockstep.py` drives it: one engine step per iteration
    (each request one token further without speculation), engines interleaved step by step."""
    batch = prompts([6, 11, 19], seed=3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engines = [_llm(llama_ckpt), _llm(llama_ckpt, max_num_batched_tokens=8)]
    steps = [e.generate_stepwise(batch, params) for e in engines]
    seen: list[list[list[int]]] = [[], []]
    last: list[list] = [[], []]
    live = [0, 1]
    while live:
        for i in list(live):
            outs = next(steps[i], None)
            if outs is None:
                live.remove(i)
            else:
                seen[i].append([len(o.token_ids) for o in outs])
                last[i] = outs
    expected = [hf_greedy(llama_ckpt.hf_model, p, 12) for p in batch]
    for lengths in seen:
        # every yield is one step: lengths grow by at most one token a step, to 12
        assert lengths[-1] == [12, 12, 12]
        for before, after in itertools.pairwise(lengths):
            assert all(0 <= b - a <= 1 for a, b in zip(before, after, strict=True))
    # the 8-token budget chunks the 36 prompt tokens over more steps than one budget of 2048
    assert len(seen[1]) > len(seen[0])
    for i, engine in enumerate(engines):
        assert [o.token_ids for o in last[i]] == expected
        assert [o.finish_reason for o in last[i]] == ["length"] * 3
        assert [o.token_ids for o in engine.generate(batch, params)] == expected


def test_prompt_steps_compute_the_last_layer_only_for_the_rows_they_sample(llama_ckpt, monkeypatch):
    """Every step with prompt rows reads out exactly the rows it samples from (none for a
    chunk that does not end its prompt); decode steps read every row; outputs stay
    transformers'."""
    from specserve.worker.model_runner import ModelRunner

    batch = prompts([3, 9, 17, 24, 30, 5, 12, 40], seed=1)
    llm = _llm(llama_ckpt, max_num_batched_tokens=16)
    seen: list[tuple[int, int | None]] = []  # (rows in the step, rows read out or None)
    read_out = ModelRunner._read_out

    def spy(self, scheduled, steps, sampled, num_rows, aux_layers):
        got = read_out(self, scheduled, steps, sampled, num_rows, aux_layers)
        seen.append((num_rows, None if got is None else len(got.rows)))
        if got is not None:
            assert got.rows.tolist() == sampled.rows
        return got

    monkeypatch.setattr(ModelRunner, "_read_out", spy)
    outs = llm.generate(batch, GREEDY64)
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == hf_greedy(llama_ckpt.hf_model, prompt, 64)
    read_steps = [(rows, read) for rows, read in seen if read is not None]
    assert len(read_steps) >= 5  # 140 prompt tokens at 16 a step
    assert all(2 * read <= rows for rows, read in read_steps)
    assert sum(read is None for _, read in seen) >= 60  # the decode steps
    seen.clear()
    (alone,) = prompts([40], seed=7)  # no prefix cached: chunks of 16, 16 and 8
    (out,) = llm.generate(alone, GREEDY64)
    assert out.token_ids == hf_greedy(llama_ckpt.hf_model, alone, 64)
    assert seen[:3] == [(16, 0), (16, 0), (8, 1)]
