"""Continuous-batching scheduler for one worker's block pool.

There are no prefill and decode phases: every request has `num_computed_tokens`, and each step
closes part of the gap to its known tokens plus drafts under one token budget. Running requests go
first (preempting by recompute when blocks run out); waiting requests are admitted only in steps
that preempted nothing. Draft tokens are scheduled for verification optimistically and
`num_computed_tokens` is rolled back by the number the worker rejects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.control.kv_cache_manager import KVCacheManager
from specserve.control.request import Request, RequestStatus, SpecDecodingStats
from specserve.control.request_queue import make_queue
from specserve.shared.config import CacheConfig, SchedulerConfig, SchedulingPolicy, SpecConfig
from specserve.shared.kv_events import KVEvent
from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    NewRequest,
    RequestResult,
    RunningDelta,
    StepBatch,
    StepResult,
    TokenLogprobs,
    WorkerInfo,
)


@dataclass
class ScheduledStep:
    """One step's decisions: the wire batch plus what `update_from_output` needs to apply it."""

    batch: StepBatch
    num_scheduled_tokens: dict[str, int]
    spec_token_ids: dict[str, list[int]]
    preempted_ids: list[str]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(slots=True)
class RequestUpdate:
    """What one step produced for one request, for the frontend."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    status: RequestStatus = RequestStatus.RUNNING
    logprobs: TokenLogprobs | None = None
    error: str | None = None
    spec_stats: SpecDecodingStats | None = None  # the request's own, once it finished
    prompt_logprobs: TokenLogprobs | None = None  # with the first output tokens, when asked


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, cache_config: CacheConfig, first_step_id: int = 0
    ) -> None:
        self.config = config
        self.spec = config.spec
        self.kv = KVCacheManager(cache_config, config.max_model_len)
        self.lookahead_tokens = self.spec.lookahead_tokens
        # KV is always computed here, so a first prefill gets the full lookahead too.
        self.admission_lookahead = self.spec.admission_lookahead_tokens(kv_arrives_async=False)
        self.draft_slots = self.spec.drafter_input_slots
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self._finished_spec_stats = SpecDecodingStats()  # folded in as requests finish
        self.num_preemptions = 0
        self._hash_block_size = cache_config.hash_block_size
        self._running_has_finished = False  # set by _finish; update_from_output compacts
        self._by_handle: dict[int, Request] = {}
        self._next_handle = 0
        self._step_id = first_step_id
        self._early_updates: list[RequestUpdate] = []
        self._worker_known: set[str] = set()  # requests whose state the worker holds
        self._finished_handles: list[int] = []  # to tell the worker in the next step

    @classmethod
    def for_worker(
        cls,
        info: WorkerInfo,
        policy: SchedulingPolicy = SchedulingPolicy.FCFS,
        hash_algo: str = "sha256",
        first_step_id: int = 0,
    ) -> Scheduler:
        """The scheduler that drives the worker `info` describes (its blocks, limits, drafter)."""
        spec = SpecConfig(info.spec_method, info.num_spec_tokens, info.drafter_max_model_len)
        config = SchedulerConfig(
            max_model_len=info.max_model_len,
            max_num_batched_tokens=info.max_num_batched_tokens,
            max_num_seqs=info.max_num_seqs,
            policy=policy,
            spec=spec,
        )
        cache = CacheConfig(
            num_blocks=info.num_blocks,
            kv_groups=tuple(info.kv_groups),
            enable_prefix_caching=info.enable_prefix_caching,
            hash_algo=hash_algo,
        )
        return cls(config, cache, first_step_id)

    # --- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request whose sampling and token ids its entry point validated (the frontend,
        or the in-process engine); refuse one that breaks this scheduler's own limits."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens; this model allows at most "
                f"{self.config.max_model_len - 1} prompt tokens (max_model_len "
                f"{self.config.max_model_len}, one position kept for output)"
            )
        cfg = self.config
        if (
            not cfg.enable_chunked_prefill
            and request.num_prompt_tokens > cfg.max_num_batched_tokens
        ):
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens, more than one step's budget "
                f"({cfg.max_num_batched_tokens}) and chunked prefill is off; enable chunked "
                "prefill or raise max_num_batched_tokens"
            )
        # Handles are never reused, so a late result can never be applied to a newer request.
        request.handle = self._next_handle
        self._next_handle += 1
        self._by_handle[request.handle] = request
        self.requests[request.request_id] = request
        self.kv.hash_request(request)
        self.waiting.push(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def unstarted_waiting(self) -> list[str]:
        """Ids of the waiting requests that never ran here (no KV, never preempted), in queue
        order: another worker can take them over for nothing."""
        return [
            r.request_id
            for r in self.waiting
            if r.num_computed_tokens == 0 and r.num_preemptions == 0
        ]

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.running or len(self.waiting))

    # --- scheduling -------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        cfg = self.config
        token_budget = cfg.max_num_batched_tokens
        input_budget = cfg.max_num_batched_tokens  # also pays for the drafter's query slots
        draft_slots = self.draft_slots
        threshold = cfg.long_prefill_token_threshold
        last_position = cfg.max_model_len - 1  # no input position may exceed it
        allocate = self.kv.allocate_slots
        running = self.running
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        deltas: dict[str, RunningDelta] = {}
        preempted: list[Request] = []

        i = 0
        while i < len(running) and token_budget > 0 and input_budget > draft_slots:
            request = running[i]
            computed = request.num_computed_tokens
            num_tokens = len(request.all_token_ids)
            drafts = request.spec_token_ids
            n = num_tokens + len(drafts) - computed
            if 0 < threshold < n:
                n = threshold
            n = min(n, token_budget, input_budget - draft_slots, last_position - computed)
            if n <= 0:
                i += 1
                continue
            new_ids = allocate(request, n, None, self.lookahead_tokens)
            while new_ids is None:
                victim = self._pick_victim()
                victim_index = running.index(victim)
                running.pop(victim_index)
                if victim_index < i:
                    i -= 1
                if victim.request_id in deltas:  # give back what it was granted this step
                    given = num_scheduled.pop(victim.request_id)
                    token_budget += given
                    input_budget += given + draft_slots
                    victim_computed = deltas.pop(victim.request_id).num_computed_tokens
                    self.kv.uncache_uncomputed(victim, victim_computed)
                    spec_tokens.pop(victim.request_id, None)
                if victim is request and not running:
                    # Out of blocks with nothing else left to preempt: it can never fit, and
                    # preempting it would only recompute it into the same wall.
                    self._fail_unfittable(request)
                    break
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                new_ids = allocate(request, n, None, self.lookahead_tokens)
            if new_ids is None:
                break
            rid = request.request_id
            num_spec = 0
            if drafts:
                num_spec = max(n + computed - num_tokens, 0)
                if num_spec:
                    spec_tokens[rid] = drafts[:num_spec]
                request.spec_token_ids = []  # fresh drafts arrive with the step's result
            has_new_blocks = any(new_ids)
            deltas[rid] = RunningDelta(
                request.handle, computed, n, new_ids if has_new_blocks else None, num_spec
            )
            num_scheduled[rid] = n
            request.num_computed_tokens = computed + n  # optimistic: drafts included
            token_budget -= n
            input_budget -= n + draft_slots
            i += 1

        new_requests: list[NewRequest] = []
        if not preempted:
            self._admit_waiting(token_budget, input_budget, num_scheduled, new_requests)
        batch = self._build_batch(new_requests, list(deltas.values()), preempted)
        return ScheduledStep(batch, num_scheduled, spec_tokens, [r.request_id for r in preempted])

    def _admit_waiting(
        self,
        token_budget: int,
        input_budget: int,
        num_scheduled: dict[str, int],
        new_requests: list[NewRequest],
    ) -> None:
        cfg = self.config
        while (
            len(self.waiting)
            and token_budget > 0
            and input_budget > self.draft_slots
            and len(self.running) < cfg.max_num_seqs
        ):
            request = self.waiting.peek()
            hit = self.kv.get_computed_blocks(request)
            num_computed = hit.num_tokens  # waiting requests hold no KV (new, or preempted)
            n = request.num_tokens - num_computed
            if 0 < cfg.long_prefill_token_threshold < n:
                n = cfg.long_prefill_token_threshold
            if not cfg.enable_chunked_prefill and n > token_budget:
                break
            n = min(n, token_budget, input_budget - self.draft_slots)
            if n <= 0:
                break
            new_ids = self.kv.allocate_slots(request, n, hit, self.admission_lookahead)
            if new_ids is None:
                break  # waiting requests never preempt running ones
            self.waiting.pop()
            self.kv.record_prefix_stats(request, hit)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new_requests.append(
                NewRequest(
                    handle=request.handle,
                    request_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling=request.sampling,
                    block_ids=self.kv.block_ids(request),
                    num_computed_tokens=num_computed,
                    num_scheduled_tokens=n,
                    cache_salt=request.cache_salt,
                )
            )
            request.num_computed_tokens = num_computed + n
            num_scheduled[request.request_id] = n
            token_budget -= n
            input_budget -= n + self.draft_slots

    def _pick_victim(self) -> Request:
        if self.config.policy == SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _fail_unfittable(self, request: Request) -> None:
        error = (
            f"request {request.request_id} needs more KV blocks than the whole cache holds "
            f"({self.kv.pool.num_usable_blocks}) at {request.num_tokens} tokens; lower "
            "max_tokens or give the worker a larger KV cache"
        )
        self._finish(request, RequestStatus.FINISHED_ERROR)
        self._early_updates.append(
            RequestUpdate(request.request_id, [], True, RequestStatus.FINISHED_ERROR, error=error)
        )

    def take_early_updates(self) -> list[RequestUpdate]:
        """Requests that `schedule()` finished itself (they will get no step result)."""
        updates, self._early_updates = self._early_updates, []
        return updates

    def _preempt(self, request: Request) -> None:
        """Recompute later: free the blocks (they stay cached) and requeue at the front."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)

    def _build_batch(
        self, new_requests: list[NewRequest], deltas: list[RunningDelta], preempted: list[Request]
    ) -> StepBatch:
        preempted_handles = []
        for r in preempted:
            if r.request_id in self._worker_known:
                self._worker_known.discard(r.request_id)
                preempted_handles.append(r.handle)
        self._worker_known.update(r.request_id for r in new_requests)
        finished, self._finished_handles = self._finished_handles, []
        self._step_id += 1
        return StepBatch(
            version=PROTOCOL_VERSION,
            step_id=self._step_id,
            new_requests=new_requests,
            running=deltas,
            preempted=preempted_handles,
            finished=finished,
        )

    # --- results ----------------------------------------------------------------------------

    def update_from_output(self, step: ScheduledStep, result: StepResult) -> list[RequestUpdate]:
        if result.step_id != step.batch.step_id:
            raise ValueError(
                f"result for step {result.step_id} applied to step {step.batch.step_id}"
            )
        updates: list[RequestUpdate] = []
        answered: set[int] = set()
        scheduled = step.num_scheduled_tokens
        for res in result.results:
            request = self._by_handle.get(res.handle)
            if (
                request is None
                or request.status != RequestStatus.RUNNING
                or request.request_id not in scheduled
                or res.handle in answered  # a duplicate must not apply twice
            ):
                continue  # aborted or preempted since it was scheduled: stale output
            answered.add(res.handle)
            update = self._apply_result(request, step, res)
            if update is not None:
                updates.append(update)
        if len(answered) < len(scheduled):
            updates.extend(self._fail_unanswered(scheduled, answered))
        if self._running_has_finished:
            self.running = [r for r in self.running if not r.status.finished]
            self._running_has_finished = False
        return updates

    def _fail_unanswered(
        self, scheduled: dict[str, int], answered: set[int]
    ) -> list[RequestUpdate]:
        """A scheduled request the worker returned nothing for: its KV state is unknown (its
        computed tokens were advanced optimistically), so it fails rather than hang."""
        updates = []
        error = "the worker returned no result for it"
        for request_id in scheduled:
            request = self.requests.get(request_id)
            if (
                request is not None
                and request.status == RequestStatus.RUNNING
                and request.handle not in answered
            ):
                self._finish(request, RequestStatus.FINISHED_ERROR)
                updates.append(
                    RequestUpdate(request_id, [], True, RequestStatus.FINISHED_ERROR, error=error)
                )
        return updates

    def _apply_result(
        self, request: Request, step: ScheduledStep, res: RequestResult
    ) -> RequestUpdate | None:
        if res.error is not None:
            self._finish(request, RequestStatus.FINISHED_ERROR)
            return RequestUpdate(
                request.request_id, [], True, RequestStatus.FINISHED_ERROR, error=res.error
            )
        if (
            res.prompt_logprobs is not None
            and request.sampling.prompt_logprobs is not None
            and not _add_prompt_logprobs(request, res.prompt_logprobs_from, res.prompt_logprobs)
        ):
            self._finish(request, RequestStatus.FINISHED_ERROR)
            error = f"worker returned prompt logprobs from token {res.prompt_logprobs_from}"
            return RequestUpdate(
                request.request_id, [], True, RequestStatus.FINISHED_ERROR, error=error
            )
        generated = res.sampled_token_ids
        drafts = step.spec_token_ids.get(request.request_id)
        all_token_ids = request.all_token_ids
        num_tokens = len(all_token_ids)
        # Judged before this step's tokens land: a chunk that did not reach the end of the known
        # tokens produces no output and must not receive drafts.
        was_prefill_chunk = request.num_computed_tokens < num_tokens
        max_generated = 0 if was_prefill_chunk else 1 + (len(drafts) if drafts else 0)
        if len(generated) > max_generated:
            self._finish(request, RequestStatus.FINISHED_ERROR)
            error = (
                f"worker returned {len(generated)} tokens for a step that allows at most "
                f"{max_generated}"
            )
            return RequestUpdate(
                request.request_id, [], True, RequestStatus.FINISHED_ERROR, error=error
            )
        if drafts:
            num_accepted = max(len(generated) - 1, 0)
            request.num_computed_tokens -= len(drafts) - num_accepted
            request.spec_stats.observe(len(drafts), num_accepted)
        finished = False
        if self._no_stop_possible(request, num_tokens, generated):
            new_tokens = list(generated)
            all_token_ids.extend(new_tokens)
        else:
            new_tokens = []
            for token in generated:
                all_token_ids.append(token)
                new_tokens.append(token)
                status = self._check_stop(request, token)
                if status is not None:
                    self._finish(request, status)
                    finished = True
                    break
        if not finished:
            if len(all_token_ids) // self._hash_block_size > len(request.block_hashes):
                self.kv.hash_request(request)
            if res.draft_token_ids and not was_prefill_chunk:
                request.spec_token_ids = list(res.draft_token_ids)
            if not new_tokens:
                return None
        logprobs = res.logprobs
        if logprobs is not None and len(new_tokens) < len(generated):  # a stop cut the step short
            n = len(new_tokens)
            logprobs = TokenLogprobs(
                logprobs.chosen[:n], logprobs.top_ids[:n], logprobs.top_logprobs[:n]
            )
        prompt_logprobs = None
        first_output = request.num_output_tokens == len(new_tokens)
        if request.sampling.prompt_logprobs is not None and first_output:
            prompt_logprobs = request.prompt_logprobs or TokenLogprobs([], [], [])
        return RequestUpdate(
            request.request_id,
            new_tokens,
            finished,
            request.status,
            logprobs,
            spec_stats=request.spec_stats if finished else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _no_stop_possible(
        self, request: Request, num_tokens: int, generated: Sequence[int]
    ) -> bool:
        """True when no stop rule can fire on any of `generated` (then they land in one go)."""
        sampling = request.sampling
        n = len(generated)
        return (
            num_tokens + n < self.config.max_model_len
            and num_tokens - request.num_prompt_tokens + n < sampling.max_tokens
            and (sampling.ignore_eos or request.eos_token_id not in generated)
            and not (sampling.stop_token_ids and set(generated) & set(sampling.stop_token_ids))
        )

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        sampling = request.sampling
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if request.num_output_tokens < sampling.min_tokens:
            return None
        if not sampling.ignore_eos and token == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if token in sampling.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= sampling.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    @property
    def spec_stats(self) -> SpecDecodingStats:
        """Acceptance statistics over every request this scheduler has served (a snapshot)."""
        total = SpecDecodingStats()
        total.merge(self._finished_spec_stats)
        for request in self.requests.values():
            total.merge(request.spec_stats)
        return total

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self._finished_spec_stats.merge(request.spec_stats)
        if request.status == RequestStatus.RUNNING:
            self._running_has_finished = True
        request.status = status
        request.spec_token_ids = []
        self.kv.free(request)
        del self.requests[request.request_id]
        del self._by_handle[request.handle]
        if request.request_id in self._worker_known:
            self._worker_known.discard(request.request_id)
            self._finished_handles.append(request.handle)

    def take_kv_events(self) -> list[KVEvent]:
        return self.kv.take_events()


def _add_prompt_logprobs(request: Request, first: int, got: TokenLogprobs) -> bool:
    """Append the worker's prompt logprobs for prompt tokens `first ..`, skipping those already
    in (a preempted request computes its prompt again); False for a gap or a ragged result."""
    have = request.prompt_logprobs or TokenLogprobs([], [], [])
    skip = len(have.chosen) + 1 - first
    n = len(got.chosen)
    if first < 1 or skip < 0 or not n == len(got.top_ids) == len(got.top_logprobs):
        return False
    if len(have.chosen) + max(n - skip, 0) > request.num_prompt_tokens - 1:
        return False
    request.prompt_logprobs = TokenLogprobs(
        have.chosen + got.chosen[skip:],
        have.top_ids + got.top_ids[skip:],
        have.top_logprobs + got.top_logprobs[skip:],
    )
    return True
