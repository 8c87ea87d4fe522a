"""Puts accepted client requests on workers.

The prompt is hashed once per index namespace, exactly as the schedulers will hash it. Each
worker's cached prefix comes from the control plane's own block pools, which are exact for the
workers it owns; the Redis index is asked too when it can name more: other planes' workers (a
request may be forwarded to one) or a worker on its way here (a resumed request waits for the one
holding its KV). Either is raised to what the router just sent there; the router weighs it
against load. A burst of requests (all that one pass of the loop read) is looked up in one round
trip and then routed one by one, each seeing where the ones before it went. A request that could
outgrow the chosen worker's whole KV cache is refused, since it could only preempt itself again
and again.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

import msgspec
import structlog

from specserve.cache_index import Namespace
from specserve.control.frontend import ClientRequest
from specserve.control.index_sync import IndexSync
from specserve.control.metrics import ServiceMetrics
from specserve.control.request import Request
from specserve.control.router import Candidate, Router
from specserve.control.worker_handle import WorkerHandle
from specserve.shared.hashing import BlockHash

log = structlog.get_logger(__name__)

# Sends a request to another control plane when one of its workers holds enough more of the
# request's tokens (`away`, per worker) than the best worker here (`here`); True when sent.
Forward = Callable[[ClientRequest, dict[str, int], int], bool]
RESUME_HOLD_S = 1.0  # default `resume_hold_s`: how long a resumed request waits for its KV


class Placement:
    def __init__(
        self,
        workers: dict[str, WorkerHandle],
        router: Router,
        index: IndexSync,
        metrics: ServiceMetrics,
        forward: Forward | None = None,
        other_planes: Callable[[], bool] = lambda: False,
        resume_hold_s: float = RESUME_HOLD_S,
    ) -> None:
        self.workers = workers  # the control plane's own dict: its current workers
        self.router = router
        self.index = index
        self.metrics = metrics
        self.forward = forward
        self.other_planes = other_planes  # whether another plane's workers could take requests
        self.resume_hold_s = resume_hold_s
        self.pending: deque[ClientRequest] = deque()  # accepted while no worker could take them

    def place(self, req: ClientRequest) -> None:
        """Add `req` to the best worker's scheduler, or hold it until a worker registers.

        Raises ValueError when the chosen worker cannot serve it.
        """
        for _, error in self.place_many([req]):
            raise error

    def place_many(self, reqs: list[ClientRequest]) -> list[tuple[ClientRequest, Exception]]:
        """`place` for a burst, with one index round trip for all of it; returns the requests
        that failed, each with its error (ValueError: refused; anything else is a bug that
        fails that request alone)."""
        if not self.has_live_worker() and not self.other_planes():
            for req in reqs:
                self.hold(req)
            return []
        token_ids = [req.prompt_token_ids + req.output_token_ids for req in reqs]
        hashes = [
            self._block_hashes(t, req.cache_salt) for t, req in zip(token_ids, reqs, strict=True)
        ]
        # The index adds to this plane's own block pools (exact for its own workers) only
        # workers it does not own: another plane's (to forward to), or one on its way here
        # (for a resumed request to wait for).
        if self.other_planes() or any(req.resumed for req in reqs):
            indexed = self._indexed_blocks(hashes) or [None] * len(reqs)
        else:
            indexed = [None] * len(reqs)
        refused = []
        for req, tokens, req_hashes, held in zip(reqs, token_ids, hashes, indexed, strict=True):
            try:
                self._place(req, tokens, req_hashes, held)
            except Exception as exc:
                refused.append((req, exc))
        return refused

    def _place(
        self,
        req: ClientRequest,
        token_ids: list[int],
        hashes: dict[Namespace, list[BlockHash]],
        indexed: dict[str, int] | None,
    ) -> None:
        candidates = [Candidate(w.worker_id, w.load) for w in self.workers.values() if not w.failed]
        cached = self._cached_tokens(hashes, len(token_ids), indexed)
        away = _away_tokens(hashes, len(token_ids), indexed, self.workers)
        here = max(cached.values(), default=0)
        if self._awaits_holder(req, away, here):  # before forwarding: its KV is on its way here
            self.hold(req)
            return
        if self.forward is not None and self.forward(req, away, here):
            return
        if not candidates:
            self.hold(req)
            return
        decision = self.router.choose(candidates, len(token_ids), cached)
        worker = self.workers[decision.worker_id]
        _check_fits(worker, req)
        request = _scheduler_request(req)
        if worker.info.enable_prefix_caching:
            # Hashed for routing with this scheduler's own hasher: it need not hash them again.
            request.block_hashes = list(hashes[worker.namespace])
        worker.scheduler.add_request(request)
        req.worker_id = worker.worker_id
        worker.remember_routed(hashes[worker.namespace], time.monotonic())
        if req.num_cached_tokens is None:  # first placement, or moved before it started
            req.num_cached_tokens = decision.cached_tokens
        if req.num_resumptions == 0:
            self.metrics.prompt_tokens.inc(len(token_ids))
            self.metrics.prefix_query_tokens.inc(len(token_ids))
            self.metrics.prefix_hit_tokens.inc(decision.cached_tokens)
        # A request that goes on from output already delivered (moved or resumed) is logged:
        # its prefix hit is what a failover costs.
        (log.info if req.output_token_ids else log.debug)(
            "request.routed",
            request_id=req.request_id,
            worker=worker.worker_id,
            cached_tokens=decision.cached_tokens,
            resumption=req.num_resumptions,
        )

    def _awaits_holder(self, req: ClientRequest, away: dict[str, int], here: int) -> bool:
        """Whether a resumed request should wait (up to `resume_hold_s`) for the worker that holds
        more of its KV than any worker here (`away`: tokens per worker the index names that is
        not registered here; `here`: the most any worker here holds): it is moving here after
        its control plane died, or this plane restarted and it has not registered again yet.
        Placed elsewhere, the request would compute all its tokens again."""
        if not req.resumed or not away or self.resume_hold_s <= 0:
            return False
        now = time.monotonic()
        if req.hold_until is not None and now >= req.hold_until:
            return False
        if max(away.values()) <= here:
            return False
        if req.hold_until is None:
            req.hold_until = now + self.resume_hold_s
            log.info("request.awaits_holder", request_id=req.request_id, away=max(away.values()))
        return True

    def has_live_worker(self) -> bool:
        return any(not w.failed for w in self.workers.values())

    def hold(self, req: ClientRequest) -> None:
        """Keep `req` until a worker can take it (`take_pending`)."""
        self.pending.append(req)
        req.worker_id = None

    def expired_holds(self, now: float) -> list[ClientRequest]:
        """The held requests whose wait for their KV's worker is over, to place anywhere."""
        expired = [r for r in self.pending if r.hold_until and -math.inf < r.hold_until <= now]
        for req in expired:
            self.pending.remove(req)
            req.hold_until = -math.inf  # over: placing it again must not hold it again
        return expired

    def take_pending(self) -> list[ClientRequest]:
        """The requests held for want of a worker, to place again."""
        pending, self.pending = list(self.pending), deque()
        return pending

    def withdraw(self, req: ClientRequest) -> None:
        """Stop serving `req` wherever it is: abort it on its worker, or stop holding it."""
        worker = self.workers.get(req.worker_id or "")
        if worker is not None:
            worker.scheduler.abort_requests([req.request_id])
        if req in self.pending:
            self.pending.remove(req)

    def _block_hashes(
        self, token_ids: list[int], salt: str | None
    ) -> dict[Namespace, list[BlockHash]]:
        """The prompt's block hashes once per namespace, exactly as the schedulers hash it."""
        out: dict[Namespace, list[BlockHash]] = {}
        for worker in self.workers.values():
            if worker.namespace not in out:
                out[worker.namespace] = worker.block_hashes(token_ids, salt)
        return out

    def _indexed_blocks(
        self, hashes: list[dict[Namespace, list[BlockHash]]]
    ) -> list[dict[str, int]] | None:
        """Per request, per worker, leading blocks the index says it holds (None: Redis is
        away); one round trip per namespace for the whole burst."""
        out: list[dict[str, int]] = [{} for _ in hashes]
        namespaces = {ns for per_ns in hashes for ns in per_ns}
        for ns in namespaces:
            found = self.index.lookup(ns, [per_ns.get(ns, []) for per_ns in hashes])
            if found is None:
                return None
            for blocks, held in zip(out, found, strict=True):
                blocks.update(held)
        return out

    def _cached_tokens(
        self,
        hashes: dict[Namespace, list[BlockHash]],
        num_tokens: int,
        indexed: dict[str, int] | None,
    ) -> dict[str, int]:
        """Per worker, prompt tokens it caches: from the index (`indexed`; None while Redis is
        away, when our own pools say), or will cache once the requests just routed to it are
        scheduled."""
        blocks = dict(indexed or {})
        if indexed is None:
            for worker in self.workers.values():
                blocks[worker.worker_id] = worker.cached_blocks(hashes[worker.namespace])
        now = time.monotonic()
        for worker in self.workers.values():
            if worker.routed:
                pending = worker.routed_prefix(hashes[worker.namespace], now)
                if pending > blocks.get(worker.worker_id, 0):
                    blocks[worker.worker_id] = pending
        cap = num_tokens - 1  # the last token is always recomputed
        return {
            wid: min(n * self.workers[wid].namespace.block_size, cap)
            for wid, n in blocks.items()
            if wid in self.workers
        }


def _away_tokens(
    hashes: dict[Namespace, list[BlockHash]],
    num_tokens: int,
    indexed: dict[str, int] | None,
    workers: dict[str, WorkerHandle],
) -> dict[str, int]:
    """Per worker the index names that is not registered here (another plane's, or one on
    its way here), the request's tokens it caches (the last token is always recomputed)."""
    if not indexed or not hashes:
        return {}
    block_size = next(iter(hashes)).block_size
    return {
        wid: min(n * block_size, num_tokens - 1)
        for wid, n in indexed.items()
        if wid not in workers and n
    }


def _check_fits(worker: WorkerHandle, req: ClientRequest) -> None:
    """ValueError unless the request, at the longest it can grow, fits in the worker's cache."""
    info = worker.info
    longest = min(len(req.prompt_token_ids) + req.sampling.max_tokens, info.max_model_len)
    needed = worker.blocks_needed(longest)
    if needed > info.num_blocks - 1:
        raise ValueError(
            f"the request can grow to {longest} tokens, which needs {needed} KV blocks; a "
            f"worker has {info.num_blocks - 1}: lower max_tokens or add KV cache memory"
        )


def _scheduler_request(req: ClientRequest) -> Request:
    """The scheduler's view of `req`, with the tokens generated so far when it resumes (its
    prompt logprobs, if it asked, went with the first of them)."""
    sampling = req.sampling
    if req.output_token_ids and sampling.prompt_logprobs is not None:
        sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
    request = Request(
        req.request_id,
        req.prompt_token_ids,
        sampling,
        eos_token_id=req.eos_token_id,
        priority=req.priority,
        cache_salt=req.cache_salt,
    )
    request.all_token_ids.extend(req.output_token_ids)
    return request
