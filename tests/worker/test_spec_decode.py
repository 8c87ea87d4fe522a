"""Speculative decoding end to end, through the real scheduler, runner and drafters.

Greedy decoding with speculation must equal decoding without it (and transformers) token for
token; random drafters are almost never accepted, so a test double that proposes the target's
own continuation with a controlled error rate drives the accept/reject paths.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch
from drafter_checkpoints import write_random_dflash, write_random_eagle3
from hf_reference import hf_greedy, prompts

from specserve.llm import LLM
from specserve.shared.config import SpecMethod
from specserve.shared.protocol import SamplingParams, StepResult
from specserve.worker.spec_decode.speculators import (
    NGRAM_NUM_SPEC_TOKENS,
    Draft,
    DraftInput,
    DraftSlotError,
    Speculator,
    choose_drafts,
)

K = 3
MASK_TOKEN = 255
TARGETS = ["llama_ckpt", "qwen3_ckpt", "qwen3_hybrid_ckpt"]


def _target_config(ckpt) -> dict:
    return json.loads((ckpt.path / "config.json").read_text())


def _drafter(ckpt, method: str, tmp_path) -> str:
    config = _target_config(ckpt)
    layers = config["num_hidden_layers"]
    if method == "eagle3":
        aux = [1, max(1, layers // 2), layers]  # checkpoint convention: input of layer i
        return str(
            write_random_eagle3(tmp_path / "eagle3", config, "eagle3", seed=1, aux_layer_ids=aux)
        )
    return str(
        write_random_dflash(
            tmp_path / "dflash", config, 2, [0, layers - 1], MASK_TOKEN, K + 1, seed=1
        )
    )


def _shared_prefix_prompts(n: int, seed: int) -> list[list[int]]:
    """n prompts in 4 families; each family shares a 13-token prefix."""
    heads = prompts([13] * 4, seed=seed)
    tails = prompts([2 + (i % 5) * 3 for i in range(n)], seed=seed + 1)
    return [heads[i % 4] + tails[i] for i in range(n)]


@pytest.mark.parametrize("pool", ["roomy", "tight"])
@pytest.mark.parametrize("method", ["eagle3", "dflash"])
@pytest.mark.parametrize("target", TARGETS)
def test_greedy_is_lossless_with_random_drafters(request, tmp_path, target, method, pool):
    """16 concurrent requests in 4 prefix-sharing families, chunked prefill beside decodes.

    A roomy pool must serve prefix hits; a tight one must preempt (sliding-window blocks that
    left the window are evicted there before a sharer comes, so it need not hit).
    """
    ckpt = request.getfixturevalue(target)
    batch = _shared_prefix_prompts(16, seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(
        str(ckpt.path),
        spec_method=method,
        drafter=_drafter(ckpt, method, tmp_path),
        num_spec_tokens=K,
        block_size=4,
        num_blocks=400 if pool == "roomy" else 48,
        max_num_batched_tokens=40,
    )
    outs = llm.generate(batch, params)
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == hf_greedy(ckpt.hf_model, prompt, 24)
    scheduler = llm.engine.scheduler
    assert llm.spec_stats.num_drafts > 0
    if pool == "roomy":
        assert scheduler.kv.stats.hits > 0
    else:
        assert scheduler.num_preemptions > 0


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
@pytest.mark.parametrize("target", TARGETS)
def test_single_request_greedy_is_lossless(request, tmp_path, target, method):
    ckpt = request.getfixturevalue(target)
    (prompt,) = prompts([19], seed=13)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm = LLM(str(ckpt.path), spec_method=method, drafter=_drafter(ckpt, method, tmp_path),
              num_spec_tokens=K, block_size=4, num_blocks=64)  # fmt: skip
    (out,) = llm.generate(prompt, params)
    assert out.token_ids == hf_greedy(ckpt.hf_model, prompt, 32)
    assert out.spec_stats.num_drafts > 0


class OracleDrafter(Speculator):
    """Test double: proposes the target's own greedy continuation (from transformers),
    corrupting each draft token with probability `error_rate`."""

    def __init__(
        self, method: SpecMethod, continuations: dict[tuple[int, ...], list[int]], error_rate: float
    ) -> None:
        self.method = method
        self.num_spec_tokens = K
        self.continuations = continuations
        self.error_rate = error_rate
        self.rng = random.Random(0)

    def propose(
        self, inputs: Sequence[DraftInput], aux_hidden: torch.Tensor | None
    ) -> dict[int, Draft]:
        drafts = {}
        for inp in inputs:
            if not inp.num_drafts:
                continue
            for prompt, continuation in self.continuations.items():
                if tuple(inp.token_ids[: len(prompt)]) == prompt:
                    done = len(inp.token_ids) - len(prompt)
                    truth = continuation[done : done + inp.num_drafts]
                    drafts[inp.handle] = Draft(
                        [(t + 1) % 256 if self.rng.random() < self.error_rate else t for t in truth]
                    )
        return drafts


@pytest.mark.parametrize("method", [SpecMethod.EAGLE3, SpecMethod.DFLASH])
def test_oracle_drafter_hits_every_acceptance_length_and_stays_lossless(qwen3_hybrid_ckpt, method):
    batch = _shared_prefix_prompts(8, seed=7)
    truth = {tuple(p): hf_greedy(qwen3_hybrid_ckpt.hf_model, p, 48) for p in batch}
    llm = LLM(
        str(qwen3_hybrid_ckpt.path),
        spec_method="ngram",  # the scheduler side; the runner's drafter is replaced below
        num_spec_tokens=K,
        block_size=4,
        num_blocks=200,
        spec_policy="fixed",  # every acceptance length must occur: verify all K each step
    )
    llm.engine.runner.speculator = OracleDrafter(method, truth, error_rate=0.2)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    outs = llm.generate(batch, params)
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == truth[tuple(prompt)]
    stats = llm.spec_stats
    per_pos = [*stats.accepted_per_position, 0]
    histogram = [stats.num_drafts - per_pos[0]] + [
        per_pos[a - 1] - per_pos[a] for a in range(1, K + 1)
    ]
    assert all(count > 0 for count in histogram), histogram  # 0..K accepted all occur
    assert 1.0 < stats.mean_acceptance_length < K + 1
    request_stats = [o.spec_stats for o in outs]
    assert sum(s.num_accepted_tokens for s in request_stats) == stats.num_accepted_tokens


def _record_drafts(llm: LLM) -> dict[str, list[list[int]]]:
    """Wrap the runner so every proposed draft list is recorded per request id."""
    recorded: dict[str, list[list[int]]] = {}
    runner = llm.engine.runner
    execute = runner.execute

    def recording(batch):
        result: StepResult = execute(batch)
        for res in result.results:
            if res.draft_token_ids:
                rid = runner.requests[res.handle].request_id
                recorded.setdefault(rid, []).append(list(res.draft_token_ids))
        return result

    runner.execute = recording
    return recorded


def test_dflash_drafts_do_not_depend_on_prefix_sharing(qwen3_ckpt, tmp_path):
    """The seed bug: DFlash writes K+1 positions past the verified tokens in the same step as
    the first prefill; without lookahead blocks those writes corrupt shared prefix blocks."""
    drafter = _drafter(qwen3_ckpt, "dflash", tmp_path)
    (subject,) = prompts([22], seed=11)
    others = [subject[:16] + tail for tail in prompts([3, 5, 7, 9, 4], seed=12)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def run(batch: list[list[int]]) -> tuple[list[list[int]], int]:
        llm = LLM(
            str(qwen3_ckpt.path), spec_method="dflash", drafter=drafter, num_spec_tokens=K,
            block_size=4, num_blocks=256, dtype="float64", spec_policy="fixed",
        )  # fmt: skip
        recorded = _record_drafts(llm)
        if len(batch) > 1:
            llm.generate(batch[1:], params)  # cache their prefix first, then share it
        llm.generate(batch, params)  # all at once: the subject shares blocks concurrently
        subject_id = f"llm-{len(batch) - 1 if len(batch) > 1 else 0}"
        return recorded[subject_id], llm.engine.scheduler.kv.stats.hits

    alone, _ = run([subject])
    shared, hits = run([subject, *others])
    assert hits >= 16
    assert alone == shared


def test_removing_the_first_prefill_lookahead_makes_dflash_fail(qwen3_ckpt, tmp_path, monkeypatch):
    drafter = _drafter(qwen3_ckpt, "dflash", tmp_path)
    llm = LLM(
        str(qwen3_ckpt.path), spec_method="dflash", drafter=drafter, num_spec_tokens=K,
        block_size=4, num_blocks=64, spec_policy="fixed",
    )  # fmt: skip
    monkeypatch.setattr(llm.engine.scheduler, "admission_lookahead", 0)
    with pytest.raises(DraftSlotError, match="lookahead is too small"):
        llm.generate(prompts([16], seed=3)[0], SamplingParams(max_tokens=4, temperature=0.0))


@pytest.mark.parametrize(("method", "last_drafting_len"), [("dflash", 96), ("eagle3", 97)])
def test_drafter_window(qwen3_ckpt, tmp_path, method, last_drafting_len):
    """K=3, drafter max length 100: DFlash drafts at sequence length 96 and not 97 (it counts
    the bonus position); EAGLE-3 still drafts at 97. No stale draft is ever scheduled."""
    llm = LLM(
        str(qwen3_ckpt.path), spec_method=method, drafter=_drafter(qwen3_ckpt, method, tmp_path),
        num_spec_tokens=K, block_size=4, num_blocks=128, drafter_max_model_len=100,
        spec_policy="fixed",
    )  # fmt: skip
    runner = llm.engine.runner
    execute = runner.execute
    seen: list[tuple[int, bool, int]] = []  # (sequence length, drafted, drafts scheduled)

    def recording(batch):
        scheduled = sum(d.num_spec_tokens for d in batch.running)
        result = execute(batch)
        for res in result.results:
            seen.append((len(runner.requests[res.handle].token_ids), bool(res.draft_token_ids),
                         scheduled))  # fmt: skip
        return result

    runner.execute = recording
    (prompt,) = prompts([90], seed=4)
    llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    drafted = {length: flag for length, flag, _ in seen}
    assert drafted[last_drafting_len] is True
    assert drafted[last_drafting_len + 1] is False
    assert all(not flag for length, flag in drafted.items() if length > last_drafting_len)
    later = [s for length, _, s in seen if length > last_drafting_len + 1]
    assert later and all(s == 0 for s in later)  # nothing stale reaches verification


def test_ngram_speculation_is_lossless_and_accepts_on_repetitive_text(llama_ckpt):
    motif = prompts([6], seed=9)[0]
    prompt = motif * 5
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = LLM(str(llama_ckpt.path), spec_method="ngram", num_spec_tokens=4, block_size=4,
              num_blocks=128)  # fmt: skip
    (out,) = llm.generate(prompt, params)
    assert out.token_ids == hf_greedy(llama_ckpt.hf_model, prompt, 40)
    assert llm.spec_stats.num_drafts > 0


def test_spec_options_are_validated(llama_ckpt, tmp_path):
    with pytest.raises(ValueError, match="needs --drafter"):
        LLM(str(llama_ckpt.path), spec_method="dflash", num_spec_tokens=2, num_blocks=16)
    with pytest.raises(ValueError, match="needs num_spec_tokens >= 1"):
        LLM(str(llama_ckpt.path), spec_method="ngram", num_spec_tokens=-1, num_blocks=16)
    ngram = LLM(str(llama_ckpt.path), spec_method="ngram", num_blocks=16)  # K by default
    assert ngram.engine.worker.args.num_spec_tokens == NGRAM_NUM_SPEC_TOKENS == 4
    with pytest.raises(ValueError, match="'bogus' is not a valid SpecMethod"):
        LLM(str(llama_ckpt.path), spec_method="bogus", num_blocks=16)


def test_choose_drafts_samples_from_the_tempered_drafter_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 0.0, 0.0]])
    inputs = [
        DraftInput(0, [], [], 0, 0, 1, 1, temperature=0.5,
                   generator=torch.Generator().manual_seed(3)),
        DraftInput(1, [], [], 0, 0, 1, 1, temperature=0.0),
    ]  # fmt: skip
    tokens, probs = choose_drafts(logits, inputs, sample=True)
    torch.testing.assert_close(probs[0], torch.softmax(logits[0] / 0.5, dim=-1))
    assert probs[1].tolist() == [0.0, 1.0, 0.0, 0.0] and tokens[1] == 1  # greedy: one-hot argmax
    greedy_tokens, no_probs = choose_drafts(logits, inputs, sample=False)
    assert greedy_tokens.tolist() == [0, 1] and no_probs is None
    draws = [
        choose_drafts(logits[:1], [replace(inputs[0], generator=torch.Generator().manual_seed(s))],
                      sample=True)[0].item()
        for s in range(2000)
    ]  # fmt: skip
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    torch.testing.assert_close(freq, probs[0], atol=0.04, rtol=0)


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_sampled_drafts_are_verified_with_their_probabilities(qwen3_ckpt, tmp_path, method):
    drafter = _drafter(qwen3_ckpt, method, tmp_path)
    batch = prompts([9, 14, 6], seed=21)

    def run(params: SamplingParams) -> tuple[list[list[int]], LLM]:
        llm = LLM(str(qwen3_ckpt.path), spec_method=method, drafter=drafter, num_spec_tokens=K,
                  block_size=4, num_blocks=128, sample_drafts=True)  # fmt: skip
        return [o.token_ids for o in llm.generate(batch, params)], llm

    seeded = [SamplingParams(max_tokens=16, temperature=0.8, seed=s) for s in (1, 2, 3)]
    first, llm = run(seeded)
    again, _ = run(seeded)
    assert first == again  # seeded sampling with sampled drafts is reproducible
    assert llm.spec_stats.num_drafts > 0
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs, _ = run(greedy)
    assert outs == [hf_greedy(qwen3_ckpt.hf_model, p, 16) for p in batch]


def test_logprobs_of_verified_tokens_match_plain_decoding(llama_ckpt):
    """Each emitted token's logprob comes from the row that produced it, as without drafts."""
    motif = prompts([6], seed=9)[0]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)

    def run(**spec) -> tuple[list[int], list[float], list[list[int]], LLM]:
        llm = LLM(str(llama_ckpt.path), block_size=4, num_blocks=64, **spec)
        (out,) = llm.generate(motif * 4, params)
        chosen = [lp for step in out.logprobs for lp in step.chosen]
        top = [ids for step in out.logprobs for ids in step.top_ids]
        return out.token_ids, chosen, top, llm

    plain_ids, plain_lp, plain_top, _ = run()
    spec_ids, spec_lp, spec_top, llm = run(spec_method="ngram", num_spec_tokens=4)
    assert llm.spec_stats.num_accepted_tokens > 0  # some steps emitted several tokens
    assert spec_ids == plain_ids
    assert len(spec_lp) == len(plain_lp) == 24
    assert spec_top == plain_top and all(len(ids) == 3 for ids in spec_top)
    torch.testing.assert_close(torch.tensor(spec_lp), torch.tensor(plain_lp), atol=1e-4, rtol=0)


def _scripted_drafts(llm: LLM, num_drafts) -> dict[tuple[str, int], list[int]]:
    """Replace the policy's plan with `num_drafts(handle, step) -> k` (every k verified) and
    record each proposed draft by (request id, sequence length when proposed)."""
    from specserve.worker.spec_decode.policy import DraftPlan

    runner = llm.engine.runner
    policy = runner.spec_policy
    steps = iter(range(10**6))

    def plan(candidates, other_decodes=0, prefill_rows=0):
        step = next(steps)
        return DraftPlan({c.handle: num_drafts(c.handle, step) for c in candidates}, frozenset())

    policy.plan = plan
    recorded: dict[tuple[str, int], list[int]] = {}
    execute = runner.execute

    def recording(batch):
        result: StepResult = execute(batch)
        for res in result.results:
            if res.draft_token_ids:
                state = runner.requests[res.handle]
                recorded[(state.request_id, len(state.token_ids))] = list(res.draft_token_ids)
        return result

    runner.execute = recording
    return recorded


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_a_prefix_hit_is_whole_and_lossless_and_dflash_drafts_as_if_cold(
    qwen3_ckpt, tmp_path, method
):
    """Both drafters take a whole hit. DFlash's context K/V at a position reads the target's
    hidden state there alone, so its drafts after the hit are those it proposes from scratch;
    EAGLE-3's draft row at the hit's last position read the next token of the request that
    computed it (one stale row: its drafts may differ, never its output)."""
    drafter = _drafter(qwen3_ckpt, method, tmp_path)
    (shared,) = prompts([12], seed=8)  # three blocks of 4
    first, second = [*shared, 5, 6], [*shared, 9, 10, 11]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    runs = []
    for warm in (True, False):
        llm = LLM(str(qwen3_ckpt.path), spec_method=method, drafter=drafter, num_spec_tokens=K,
                  block_size=4, num_blocks=256, dtype="float64",
                  enable_prefix_caching=True)  # fmt: skip
        recorded = _scripted_drafts(llm, lambda handle, step: K)
        if warm:
            llm.generate([first], params)
            recorded.clear()
        stats = llm.engine.scheduler.kv.stats
        hits_before = stats.hits
        (out,) = llm.generate([second], params)
        drafts = {length: d for (_, length), d in recorded.items()}
        runs.append((stats.hits - hits_before, drafts, out.token_ids))
    (warm_hit, warm_drafts, warm_out), (cold_hit, cold_drafts, cold_out) = runs
    assert (warm_hit, cold_hit) == (12, 0)
    assert warm_out == cold_out == hf_greedy(qwen3_ckpt.hf_model, second, 10)
    assert len(warm_drafts) >= 3 and warm_drafts.keys() == cold_drafts.keys()
    if method == "dflash":
        assert warm_drafts == cold_drafts


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_fewer_drafts_are_a_prefix_of_k_drafts(qwen3_ckpt, tmp_path, method):
    """The policy asks each request for its own number of drafts; a drafter model gives each
    the prefix of what it would have drafted with K (EAGLE-3 stops a request's steps early)."""
    drafter = _drafter(qwen3_ckpt, method, tmp_path)
    batch = prompts([9, 14, 6, 11], seed=21)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = []
    one_deep = (lambda handle, step: 1,)  # the deepest request shallower than K
    for num_drafts in (lambda handle, step: K, lambda handle, step: handle % (K + 1), *one_deep):
        llm = LLM(str(qwen3_ckpt.path), spec_method=method, drafter=drafter, num_spec_tokens=K,
                  block_size=4, num_blocks=256, dtype="float64")  # fmt: skip
        recorded = _scripted_drafts(llm, num_drafts)
        outs = llm.generate(batch, params)
        runs.append((recorded, [o.token_ids for o in outs]))
    (full, full_out), (varied, varied_out), (shallow, shallow_out) = runs
    assert full_out == varied_out == shallow_out  # lossless either way
    assert {len(varied[key]) for key in varied} == {1, 2, 3}  # handle 0 proposes none
    assert {len(shallow[key]) for key in shallow} == {1}
    for drafts in (varied, shallow):
        common = set(full) & set(drafts)
        assert len(common) >= 8
        for key in common:
            assert drafts[key] == full[key][: len(drafts[key])], key


class _CountingClock:
    """`time` for the runner and the speculators: each reading one second after the last, so
    an interval says how many readings it spans."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.parametrize(
    ("method", "rows_ride"), [("eagle3", False), ("eagle3", True), ("dflash", False)]
)
def test_rows_put_aside_give_the_drafter_the_same_context(
    qwen3_ckpt, tmp_path, method, rows_ride, monkeypatch
):
    """A request verifying no drafts has its rows put aside and given to the drafter with a later
    step's: the drafts it then proposes are those of a drafter that took every step's rows. The
    context K/V pass reports every row it wrote, and a drafting call is timed less that pass,
    whether or not it caught rows up. Where the rows ride in the drafting pass (EAGLE-3, up to
    `CONTEXT_ROWS_IN_PASS` of them) there is no context pass, and a call that caught rows up
    is not timed."""
    from specserve.worker import model_runner
    from specserve.worker.spec_decode import speculators

    if not rows_ride:
        monkeypatch.setattr(speculators, "CONTEXT_ROWS_IN_PASS", 0)
    drafter = _drafter(qwen3_ckpt, method, tmp_path)
    batch = prompts([10, 7, 13], seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    clock = _CountingClock()
    monkeypatch.setattr(model_runner, "time", clock)
    monkeypatch.setattr(speculators, "time", clock)
    runs = []
    for max_deferred in (64, 0):  # 0: nothing is put aside
        monkeypatch.setattr(speculators, "MAX_DEFERRED_ROWS", max_deferred)
        llm = LLM(str(qwen3_ckpt.path), spec_method=method, drafter=drafter, num_spec_tokens=K,
                  block_size=4, num_blocks=256, dtype="float64")  # fmt: skip
        speculator = llm.engine.runner.speculator
        deferred_seen, taken_seen, written, costed, rode, calls = [], [], [], [], [], []
        recorded = _scripted_drafts(llm, lambda handle, step: K if step % 5 == 4 else 0)
        propose = speculator.propose

        def watching(
            inputs,
            aux,
            propose=propose,
            seen=deferred_seen,
            spec=speculator,
            took=taken_seen,
            wrote=written,
            rode=rode,
            calls=calls,
        ):
            held = {h: d.num_rows for h, d in spec.deferred.items()}
            drafts = propose(inputs, aux)
            seen.append(sum(d.num_rows for d in spec.deferred.values()))
            # the backlog it reports taking: the rows held before by requests no longer holding
            taken = sum(n for h, n in held.items() if h not in spec.deferred)
            assert spec.backlog_rows_taken == taken
            took.append(taken)
            # the context it reports writing: those rows and this step's of every request whose
            # rows were not put aside (an EAGLE-3 call whose only rows are the proposing ones
            # runs them through the drafting pass: no context pass)
            rows = taken + sum(i.num_valid for i in inputs if i.handle not in spec.deferred)
            proposing = sum(1 for i in inputs if i.num_drafts)
            if spec.context_write is None:
                if rows_ride:
                    assert rows - proposing <= speculators.CONTEXT_ROWS_IN_PASS
                    rode.append(rows - proposing)
                else:
                    assert rows == (proposing if method == "eagle3" else 0)
            else:
                assert not rows_ride or rows - proposing > speculators.CONTEXT_ROWS_IN_PASS
                assert spec.context_write == speculators.ContextWrite(rows, 1.0)
                wrote.append(rows)
            drafted = any(d.tokens for d in drafts.values())
            calls.append((taken, spec.context_write is not None, drafted))
            return drafts

        speculator.propose = watching
        policy = llm.engine.runner.spec_policy
        observe = policy.observe_drafting

        def costing(num_tokens, seconds, depth, observe=observe, spec=speculator, seen=costed):
            seen.append((num_tokens, seconds, spec.backlog_rows_taken))
            observe(num_tokens, seconds, depth)

        policy.observe_drafting = costing
        told: list[int] = []
        policy.observe_context_write = lambda rows, seconds, told=told: told.append(rows)
        outs = llm.generate(batch, params)
        runs.append((recorded, [o.token_ids for o in outs], max(deferred_seen), taken_seen))
        # every drafting call is timed, those that caught rows up in a context pass too, each
        # over the readings around the call less the context pass's: two
        assert costed and all(n > 0 and seconds == 2.0 for n, seconds, *_ in costed)
        # the calls that caught rows up are timed exactly where their rows had a pass of
        # their own (riding in the drafting pass, they are not timed)
        timed_catch_ups = [taken for *_, taken in costed if taken]
        assert timed_catch_ups == [t for t, context, drafted in calls if t and context and drafted]
        assert bool(timed_catch_ups) == (max_deferred > 0)
        assert told == written and written  # the policy learns every context pass
        assert any(rode) == rows_ride  # rows beyond the proposing ones rode in the pass
    (aside, aside_out, most_aside, aside_taken), (every, every_out, none_aside, none_taken) = runs
    assert most_aside >= 3 * 4 and none_aside == 0  # 3 requests x 4 steps put aside
    assert sum(aside_taken) >= 3 * 4 and not any(none_taken)
    assert aside_out == every_out
    assert aside.keys() == every.keys() and len(aside) >= 6
    assert aside == every


@pytest.mark.parametrize("method", ["ngram", "eagle3", "dflash"])
def test_a_step_that_plans_nothing_new_rests_and_changes_nothing(
    qwen3_ckpt, tmp_path, method, monkeypatch
):
    """While the policy chooses no drafts, a decode step of the same requests skips the plan
    and `propose` (`ModelRunner._rests`): the drafter keeps its rows as `propose` would. Against
    an engine that never rests, on a clock that makes every timing the same in both: the same
    outputs, the same decisions, the same shadow drafts at the probes (drawn from the context
    the rows put aside became) and, for a drafter model, the same drafter K/V bit for bit."""
    from specserve.worker import model_runner
    from specserve.worker.spec_decode import speculators

    monkeypatch.setattr(speculators, "MAX_DEFERRED_ROWS", 6)  # backlogs fill and are taken
    for module in (model_runner, speculators):
        monkeypatch.setattr(module, "time", _CountingClock())
    spec = {"spec_method": method, "num_spec_tokens": K}
    if method != "ngram":
        spec["drafter"] = _drafter(qwen3_ckpt, method, tmp_path)
    batch = prompts([10, 7, 13], seed=8)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    runs = []
    for may_rest in (True, False):
        llm = LLM(str(qwen3_ckpt.path), block_size=4, num_blocks=256, dtype="float32", **spec)
        runner = llm.engine.runner
        policy = runner.spec_policy
        policy._choose = lambda *args: {}  # drafts never pay: only probes propose
        shadows: list[tuple[int, int, list[int]]] = []
        add_shadow = policy.add_shadow

        def shadowing(handle, position, drafts, add=add_shadow, seen=shadows):
            seen.append((handle, position, list(drafts)))
            add(handle, position, drafts)

        policy.add_shadow = shadowing
        rested = []
        rests = runner._rests

        def resting(*args, rests=rests, may=may_rest, seen=rested):
            seen.append(may and rests(*args))
            return seen[-1]

        runner._rests = resting
        outs = [o.token_ids for o in llm.generate(batch, params)]
        kv = runner.speculator.kv_cache if method != "ngram" else None
        runs.append((outs, policy.stats, shadows, sum(rested), kv))
    (outs, stats, shadows, rested, kv), (outs_full, stats_full, shadows_full, _, kv_full) = runs
    assert outs == outs_full == [hf_greedy(qwen3_ckpt.hf_model, p, 40) for p in batch]
    assert stats == stats_full  # and only the cold start, before costs are known, verified
    assert sum(stats.speculating_steps.values()) == 1 and sum(stats.steps.values()) == 40
    assert len(shadows) >= 3 and shadows == shadows_full
    assert rested >= 10  # of 40 decode steps: all but replans, probes and full backlogs
    if kv is not None:
        assert kv.layers.keys() == kv_full.layers.keys()
        assert all(torch.equal(kv.layers[i], kv_full.layers[i]) for i in kv.layers)
        assert all(kv.layers[i].count_nonzero() > 0 for i in kv.layers)
