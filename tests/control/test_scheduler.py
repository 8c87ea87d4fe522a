"""Scheduler behaviour, driven by a scripted worker test double (no model runs here)."""

from __future__ import annotations

import pytest

from specserve.control.kv_group_manager import SlidingWindowManager
from specserve.control.request import Request, RequestStatus
from specserve.control.scheduler import ScheduledStep, Scheduler
from specserve.shared.config import (
    CacheConfig,
    KVGroupSpec,
    SchedulerConfig,
    SpecConfig,
)
from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    RequestResult,
    SamplingParams,
    StepResult,
    TokenLogprobs,
)

GREEDY = SamplingParams(max_tokens=50, temperature=0.0)


def make_scheduler(
    spec: SpecConfig | None = None,
    block_size: int = 16,
    num_blocks: int = 100,
    groups: tuple[KVGroupSpec, ...] | None = None,
    **kwargs,
) -> Scheduler:
    config = SchedulerConfig(
        max_model_len=kwargs.pop("max_model_len", 1024), spec=spec or SpecConfig(), **kwargs
    )
    cache = CacheConfig(
        num_blocks=num_blocks, kv_groups=groups or (KVGroupSpec("full", block_size),)
    )
    return Scheduler(config, cache)


def add(s: Scheduler, rid: str, prompt: list[int], sampling=GREEDY, **kwargs) -> Request:
    req = Request(rid, prompt, sampling, **kwargs)
    s.add_request(req)
    return req


class ScriptedWorker:
    """Test double for a worker: returns the tokens and drafts it is told to, per request id."""

    def __init__(self, s: Scheduler, next_token: int = 7, drafts: list[int] | None = None):
        self.s = s
        self.next_token = next_token
        self.drafts = drafts
        self.accept: dict[str, int] = {}  # accepted drafts per request for the next step

    def result(self, step: ScheduledStep, tokens: dict[str, list[int]] | None = None) -> StepResult:
        results = []
        for rid in step.num_scheduled_tokens:
            req = self.s.requests[rid]
            if req.num_computed_tokens < req.num_tokens:  # a prefill chunk: no output
                results.append(RequestResult(req.handle, []))
                continue
            drafts = step.spec_token_ids.get(rid, [])
            accepted = drafts[: self.accept.get(rid, len(drafts))]
            out = tokens[rid] if tokens and rid in tokens else [*accepted, self.next_token]
            results.append(RequestResult(req.handle, out, self.drafts))
        return StepResult(PROTOCOL_VERSION, step.batch.step_id, results)

    def step(self, tokens: dict[str, list[int]] | None = None):
        step = self.s.schedule()
        return step, self.s.update_from_output(step, self.result(step, tokens))


def slots_cover(s: Scheduler, req: Request, first: int, last: int) -> bool:
    """Every position in [first, last] lies in a real (non-null) block of every group table."""
    for manager in s.kv.coordinator.managers:
        table = manager.req_blocks[req.request_id]
        bs = manager.block_size
        lo = first
        if isinstance(manager, SlidingWindowManager):
            lo = max(first, last - manager.sliding_window + 1)
        for pos in range(lo, last + 1):
            if pos // bs >= len(table) or table[pos // bs].is_null:
                return False
    return True


# --- lookahead: the seed bug ---------------------------------------------------------------


def test_dflash_first_prefill_reserves_k_plus_one_lookahead_slots():
    s = make_scheduler(SpecConfig("dflash", 3))
    req = add(s, "a", list(range(16)))
    step = s.schedule()
    assert step.batch.new_requests[0].block_ids == [[1, 2]]  # 16 + 3 + 1 slots: two blocks
    # The drafter's block [next token, MASK x 3] sits at positions 16..19 in the same step.
    assert slots_cover(s, req, 0, 19)


def test_removing_the_first_prefill_lookahead_is_caught(monkeypatch):
    s = make_scheduler(SpecConfig("dflash", 3))
    monkeypatch.setattr(s, "admission_lookahead", 0)
    req = add(s, "a", list(range(16)))
    s.schedule()
    assert s.kv.block_ids(req) == [[1]]
    assert not slots_cover(s, req, 0, 19)


@pytest.mark.parametrize(
    ("method", "k", "lookahead"),
    [
        ("none", 0, 0),
        ("ngram", 3, 0),
        ("eagle3", 3, 3),
        ("eagle3", 4, 4),
        ("dflash", 3, 4),
        ("dflash", 4, 5),
    ],
)
def test_lookahead_per_method_at_first_prefill_and_in_decode(method, k, lookahead):
    s = make_scheduler(SpecConfig(method, k), block_size=1)
    req = add(s, "a", list(range(8)))
    worker = ScriptedWorker(s, drafts=[5] * k if k else None)
    worker.step()
    assert len(s.kv.block_ids(req)[0]) == 8 + lookahead
    worker.step()  # decode: 1 + k tokens verified, lookahead past them
    assert len(s.kv.block_ids(req)[0]) == 9 + k + lookahead


def test_async_kv_skips_lookahead_only_for_hidden_state_drafters():
    for method, k, lookahead in [("eagle3", 3, 3), ("dflash", 3, 4)]:
        spec = SpecConfig(method, k)
        assert spec.admission_lookahead_tokens(kv_arrives_async=True) == 0
        assert spec.admission_lookahead_tokens(kv_arrives_async=False) == lookahead
    assert SpecConfig("ngram", 3).admission_lookahead_tokens(kv_arrives_async=True) == 0

    s = make_scheduler(SpecConfig("eagle3", 3), block_size=4)
    local = add(s, "local", list(range(100, 112)))
    s.schedule()
    assert len(s.kv.block_ids(local)[0]) == 4  # 12 + 3 lookahead slots


# --- chunked prefill, drafts, rollback -----------------------------------------------------


def test_chunked_prefill_gets_no_output_and_no_drafts_until_the_prompt_is_done():
    s = make_scheduler(
        SpecConfig("eagle3", 2), max_num_batched_tokens=64, long_prefill_token_threshold=40
    )
    req = add(s, "a", list(range(100)))
    worker = ScriptedWorker(s, drafts=[1, 2])
    chunks = []
    for _ in range(3):
        step, _ = worker.step()
        chunks.append(step.num_scheduled_tokens["a"])
        assert "a" not in step.spec_token_ids
    assert chunks == [40, 40, 20]
    assert req.output_token_ids == [7] and req.spec_token_ids == [1, 2]
    step, _ = worker.step()
    assert step.num_scheduled_tokens["a"] == 3 and step.spec_token_ids["a"] == [1, 2]
    assert step.batch.running[0].num_spec_tokens == 2


def test_rejected_drafts_roll_back_num_computed_tokens():
    s = make_scheduler(SpecConfig("dflash", 4))
    req = add(s, "a", list(range(20)))
    worker = ScriptedWorker(s, drafts=[11, 12, 13, 14])
    worker.step()
    assert req.num_computed_tokens == 20
    worker.accept["a"] = 1
    step, updates = worker.step()
    assert step.num_scheduled_tokens["a"] == 5
    assert updates[0].new_token_ids == [11, 7]
    assert req.num_computed_tokens == 22  # 20 + 5 scheduled - 3 rejected
    assert req.num_tokens == 23  # the recovered token's KV is computed next step
    stats = s.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 1)
    worker.accept["a"] = 4
    worker.step()
    stats = s.spec_stats  # a snapshot: read it again after the step
    assert stats.accepted_per_position == [2, 1, 1, 1]
    assert stats.mean_acceptance_length == pytest.approx(1 + 5 / 2)
    assert stats.acceptance_rate_per_position == [1.0, 0.5, 0.5, 0.5]


def test_no_input_position_beyond_max_model_len():
    s = make_scheduler(SpecConfig("eagle3", 4), max_model_len=24, block_size=4)
    req = add(s, "a", list(range(20)), SamplingParams(max_tokens=100, temperature=0.0))
    worker = ScriptedWorker(s, drafts=[1, 2, 3, 4])
    worker.step()  # 21 tokens, 20 computed
    step = s.schedule()
    # Positions 20..22 at most (23 is the last position a sampled token may take): the newest
    # token plus 2 of the 4 drafts.
    assert step.num_scheduled_tokens["a"] == 3
    assert step.spec_token_ids["a"] == [1, 2]
    assert len(s.kv.block_ids(req)[0]) == 6  # lookahead slots capped at max_model_len: 24 / 4
    s.update_from_output(step, worker.result(step))
    assert req.num_tokens == 24 and req.status == RequestStatus.FINISHED_LENGTH


# --- stopping ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sampling", "eos", "stream", "expected", "status"),
    [
        (SamplingParams(max_tokens=10), 2, [5, 2, 9], [5, 2], RequestStatus.FINISHED_STOPPED),
        (
            SamplingParams(max_tokens=4, ignore_eos=True),
            2,
            [5, 2, 9, 9, 9],
            [5, 2, 9, 9],
            RequestStatus.FINISHED_LENGTH,
        ),
        (
            SamplingParams(max_tokens=10, stop_token_ids=(9,)),
            2,
            [5, 9, 1],
            [5, 9],
            RequestStatus.FINISHED_STOPPED,
        ),
        (
            SamplingParams(max_tokens=10, min_tokens=3),
            2,
            [2, 2, 2, 2],
            [2, 2, 2],
            RequestStatus.FINISHED_STOPPED,
        ),
        (SamplingParams(max_tokens=3), 2, [5, 6, 7, 8], [5, 6, 7], RequestStatus.FINISHED_LENGTH),
    ],
)
def test_stop_conditions(sampling, eos, stream, expected, status):
    s = make_scheduler()
    req = add(s, "a", [1, 1, 1], sampling, eos_token_id=eos)
    worker = ScriptedWorker(s)
    produced = []
    for token in stream:
        if req.status.finished:
            break
        _, updates = worker.step({"a": [token]})
        produced += updates[0].new_token_ids
    assert produced == expected and req.status == status
    assert "a" not in s.requests and not s.kv.coordinator.holds("a")


def test_a_stop_inside_accepted_drafts_truncates_the_rest():
    s = make_scheduler(SpecConfig("eagle3", 3))
    req = add(s, "a", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_id=0)
    worker = ScriptedWorker(s, drafts=[4, 0, 6])
    worker.step()
    _, updates = worker.step()
    assert updates[0].new_token_ids == [4, 0] and updates[0].finished
    assert req.output_token_ids == [7, 4, 0]
    assert s.schedule().batch.finished == [req.handle]  # the worker is told to drop it


# --- preemption ----------------------------------------------------------------------------


def test_fcfs_preempts_the_last_admitted_and_resumes_it_from_its_cached_prefix():
    s = make_scheduler(block_size=4, num_blocks=9)  # 8 usable blocks
    a = add(s, "a", list(range(12)), SamplingParams(max_tokens=20, ignore_eos=True))
    b = add(s, "b", list(range(100, 112)), SamplingParams(max_tokens=20, ignore_eos=True))
    worker = ScriptedWorker(s)
    worker.step()  # both prefilled into 3 blocks each, 13 tokens each
    step, _ = worker.step()  # position 12 needs a 4th block each: the pool is full
    assert step.preempted_ids == [] and s.kv.pool.num_free_blocks == 0
    for _ in range(3):  # positions 13..15 fit
        step, _ = worker.step()
        assert step.preempted_ids == []
    step, _ = worker.step()  # position 16 needs a 5th block for "a": "b" (last admitted) yields
    assert step.preempted_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    step = s.schedule()
    assert step.batch.preempted == [] and "b" not in step.num_scheduled_tokens
    s.update_from_output(step, worker.result(step))
    while b.status != RequestStatus.RUNNING:
        s.abort_requests(["a"])
        step = s.schedule()
    (resumed,) = step.batch.new_requests
    assert resumed.request_id == "b" and resumed.token_ids == b.all_token_ids
    assert resumed.num_computed_tokens == 12  # its freed blocks stayed cached: only the tail
    assert s.kv.stats.requests == 2  # the resumed lookup is not counted again
    assert a.status == RequestStatus.FINISHED_ABORTED


def test_priority_policy_preempts_the_lowest_priority_request():
    s = make_scheduler(block_size=4, num_blocks=9, policy="priority")
    hi = add(s, "hi", list(range(12)), SamplingParams(max_tokens=20, ignore_eos=True), priority=0)
    lo = add(
        s, "lo", list(range(100, 112)), SamplingParams(max_tokens=20, ignore_eos=True), priority=5
    )
    worker = ScriptedWorker(s)
    preempted = []
    for _ in range(6):
        step, _ = worker.step()
        preempted += step.preempted_ids
    assert preempted and set(preempted) == {"lo"}
    assert hi.status == RequestStatus.RUNNING and lo.status == RequestStatus.PREEMPTED


def test_priority_admits_the_most_urgent_waiting_request_first():
    s = make_scheduler(policy="priority", max_num_seqs=1)
    add(s, "late-urgent", [1, 2], priority=0, arrival_time=2.0)
    add(s, "early-lazy", [3, 4], priority=1, arrival_time=1.0)
    add(s, "early-urgent", [5, 6], priority=0, arrival_time=1.5)
    step = s.schedule()
    assert [r.request_id for r in step.batch.new_requests] == ["early-urgent"]


# --- aborts, limits, bad input -------------------------------------------------------------


def test_abort_waiting_and_running_requests_frees_everything():
    s = make_scheduler(max_num_seqs=1)
    running = add(s, "run", list(range(40)))
    waiting = add(s, "wait", list(range(40)))
    worker = ScriptedWorker(s)
    worker.step()
    assert len(s.waiting) == 1
    s.abort_requests(["run", "wait", "unknown"])
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_usable_blocks
    assert not s.has_unfinished_requests
    assert s.schedule().batch.finished == [running.handle]  # "wait" never reached the worker


def test_token_budget_and_max_num_seqs_bound_a_step():
    s = make_scheduler(max_num_batched_tokens=50, max_num_seqs=3)
    for i in range(5):
        add(s, f"r{i}", list(range(i * 100, i * 100 + 20)))
    step = s.schedule()
    assert step.num_scheduled_tokens == {"r0": 20, "r1": 20, "r2": 10}
    assert len(s.running) == 3


def test_stale_result_for_an_aborted_request_is_ignored():
    s = make_scheduler()
    add(s, "a", [1, 2, 3])
    step = s.schedule()
    result = ScriptedWorker(s).result(step, {"a": [5]})
    s.abort_requests(["a"])
    assert s.update_from_output(step, result) == []


def test_worker_returning_too_many_tokens_fails_only_that_request():
    s = make_scheduler()
    add(s, "a", [1, 2, 3])
    other = add(s, "b", [4, 5, 6])
    step = s.schedule()
    updates = s.update_from_output(step, ScriptedWorker(s).result(step, {"a": [1, 2], "b": [9]}))
    assert updates[0].status == RequestStatus.FINISHED_ERROR and "at most 1" in updates[0].error
    assert updates[1].new_token_ids == [9] and other.status == RequestStatus.RUNNING


def _prompt_lps(first: float, count: int) -> TokenLogprobs:
    return TokenLogprobs([first - i for i in range(count)], [[]] * count, [[]] * count)


def test_prompt_logprobs_are_joined_deduplicated_and_sent_once():
    """Chunks' prompt logprobs are joined in order; a recomputed chunk's repeats are dropped; a
    gap fails the request; the whole arrives once, with the first output token."""
    s = make_scheduler(max_num_batched_tokens=4)
    sampling = SamplingParams(max_tokens=5, temperature=0.0, prompt_logprobs=0)
    req = add(s, "a", list(range(10, 17)), sampling)  # prompt tokens 1..6 have logprobs
    step = s.schedule()  # positions 0-3: tokens 1-4
    lps = RequestResult(req.handle, [], prompt_logprobs=_prompt_lps(-1, 4), prompt_logprobs_from=1)
    assert s.update_from_output(step, StepResult(PROTOCOL_VERSION, step.batch.step_id, [lps])) == []
    step = s.schedule()  # positions 4-6: tokens 5-6, then the first output token
    again = _prompt_lps(-4, 3)  # tokens 4-6, token 4 already in
    result = RequestResult(req.handle, [9], prompt_logprobs=again, prompt_logprobs_from=4)
    (update,) = s.update_from_output(
        step, StepResult(PROTOCOL_VERSION, step.batch.step_id, [result])
    )
    assert update.new_token_ids == [9]
    assert update.prompt_logprobs is not None
    assert update.prompt_logprobs.chosen == [-1, -2, -3, -4, -5, -6]
    step = s.schedule()
    (update,) = s.update_from_output(step, ScriptedWorker(s).result(step))
    assert update.prompt_logprobs is None  # sent once
    b = add(s, "b", list(range(10, 17)), sampling)
    step = s.schedule()
    gap = RequestResult(b.handle, [], prompt_logprobs=_prompt_lps(-1, 2), prompt_logprobs_from=3)
    results = ScriptedWorker(s).result(step).results  # "a" decodes beside it
    results = [gap if r.handle == b.handle else r for r in results]
    updates = s.update_from_output(step, StepResult(PROTOCOL_VERSION, step.batch.step_id, results))
    (failed,) = [u for u in updates if u.request_id == "b"]
    assert failed.status == RequestStatus.FINISHED_ERROR
    assert "prompt logprobs from token 3" in failed.error


def test_prefix_cache_statistics():
    s = make_scheduler()
    worker = ScriptedWorker(s)
    add(s, "a", list(range(40)))
    worker.step()
    add(s, "b", list(range(40)))
    worker.step()
    assert (s.kv.stats.queries, s.kv.stats.hits) == (80, 32)
    assert s.kv.stats.hit_rate == pytest.approx(0.4)


@pytest.mark.parametrize("method", [None, "eagle3", "dflash"])
def test_prefix_hits_are_whole_with_every_drafter(method):
    """No block of a hit is dropped for a drafter: DFlash's context K/V at a position reads only
    the target's hidden state there; an EAGLE-3 draft row at a hit's last position read the
    next token of the request that computed it, one stale row that drafts live with."""
    s = make_scheduler(SpecConfig(method, 3) if method else None)
    worker = ScriptedWorker(s)
    add(s, "a", list(range(40)))
    worker.step()
    add(s, "b", list(range(40)))
    step, _ = worker.step()
    assert step.num_scheduled_tokens["b"] == 40 - 32
    assert step.batch.new_requests[0].num_computed_tokens == 32


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        ([], GREEDY, "the prompt is empty"),
        (list(range(1024)), GREEDY, "at most 1023 prompt tokens"),
    ],
)
def test_bad_requests_are_rejected_with_a_clear_error(prompt, sampling, message):
    s = make_scheduler()
    with pytest.raises(ValueError, match=message):
        add(s, "x", prompt, sampling)
    assert not s.has_unfinished_requests


def test_duplicate_request_ids_are_rejected():
    s = make_scheduler()
    add(s, "x", [1])
    with pytest.raises(ValueError, match="already in use"):
        add(s, "x", [2])


def test_a_prompt_that_can_never_fit_one_step_is_refused_without_chunked_prefill():
    s = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="chunked prefill is off"):
        add(s, "long", list(range(9)))
    assert not s.has_unfinished_requests
    add(s, "fits", list(range(8)))
    assert s.schedule().num_scheduled_tokens == {"fits": 8}


def test_a_request_that_outgrows_the_whole_pool_fails_instead_of_livelocking():
    s = make_scheduler(block_size=4, num_blocks=5)  # 4 usable blocks: 16 slots
    worker = ScriptedWorker(s)
    req = add(s, "big", list(range(10)), SamplingParams(max_tokens=30, temperature=0.0))
    failed = []
    for _ in range(40):
        step = s.schedule()
        failed += s.take_early_updates()
        if step.num_scheduled_tokens:
            s.update_from_output(step, worker.result(step))
        if not s.has_unfinished_requests:
            break
    assert [(u.request_id, u.status) for u in failed] == [("big", RequestStatus.FINISHED_ERROR)]
    assert "needs more KV blocks than the whole cache holds (4) at 17 tokens" in failed[0].error
    assert req.num_preemptions == 0
    assert s.kv.pool.num_free_blocks == 4


def test_a_scheduled_request_missing_from_the_result_fails_instead_of_hanging():
    s = make_scheduler()
    add(s, "a", [1, 2, 3])
    add(s, "b", [4, 5, 6])
    step = s.schedule()
    full = ScriptedWorker(s).result(step)
    only_b = StepResult(PROTOCOL_VERSION, step.batch.step_id, [full.results[1]] * 2)  # b twice
    updates = s.update_from_output(step, only_b)
    by_id = {u.request_id: u for u in updates}
    assert by_id["a"].status == RequestStatus.FINISHED_ERROR
    assert by_id["a"].error == "the worker returned no result for it"
    assert by_id["b"].new_token_ids == [7]  # applied once, not twice
    assert s.requests["b"].all_token_ids == [4, 5, 6, 7]
    assert "a" not in s.requests
