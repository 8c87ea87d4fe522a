"""Keeps the Redis prefix index in step with the control plane's workers.

Registration under epochs, write-through of each step's block events, heartbeats, fencing of
removed workers and the background janitor. Any Redis failure marks the index down instead of
stopping the service: routing then falls back to the control plane's own block pools, and once
Redis answers again every worker is registered under a fresh epoch and its whole cache state is
rewritten.
"""

from __future__ import annotations

import time

import structlog
from redis import Redis
from redis.exceptions import RedisError

from specserve.cache_index import (
    CacheIndexError,
    IndexReader,
    IndexWriter,
    Namespace,
    cleanup_fenced,
    expire_stale_workers,
    heartbeat,
    list_workers,
    live_owner,
    mark_dead,
    register_worker,
)
from specserve.control.metrics import ServiceMetrics
from specserve.control.worker_handle import WorkerHandle
from specserve.shared.hashing import BlockHash

log = structlog.get_logger(__name__)

INDEX_HEARTBEAT_S = 1.0
INDEX_RETRY_S = 1.0
JANITOR_S = 2.0
OWNER_STALE_MS = 5_000  # a worker whose plane has not heartbeated it this long is not forwarded to
STALE_WORKER_MS = 15_000  # a live worker unheard of for this long (index heartbeats: 1 s) is dead


class IndexSync:
    def __init__(
        self,
        client: Redis | None,
        workers: dict[str, WorkerHandle],
        metrics: ServiceMetrics,
        session: str,
        control_url: str = "",
    ) -> None:
        self.client = client
        self.workers = workers  # the control plane's own dict: its current workers
        self.metrics = metrics
        self.session = session
        self.control_url = control_url  # where other planes reach this one's client port
        self.up = False
        self.retry_at = 0.0
        self.last_janitor = 0.0
        self.namespaces: set[Namespace] = set()
        # Removed while Redis was away: fence them once it is back (their epochs would stay live).
        self.pending_dead: list[tuple[Namespace, str, int]] = []
        if client is not None:
            self.up = True  # until proven otherwise: a failed ping flips it
            if self.call("ping", client.ping) is None:
                log.warning("index.unavailable", op="ping")

    def lookup(self, ns: Namespace, prompts: list[list[BlockHash]]) -> list[dict[str, int]] | None:
        """Per prompt, per live worker, leading blocks it holds, in one round trip for them all;
        None when Redis is away."""
        if not self.up or self.client is None:
            return None
        start = time.perf_counter()
        found = self.call("lookup", IndexReader(self.client, ns).longest_prefix_many, prompts)
        if found is not None:
            self.metrics.index_lookup.observe(time.perf_counter() - start)
        return found

    def remove(self, worker: WorkerHandle) -> None:
        """Fence a removed worker's epoch now, or once Redis is back."""
        if worker.epoch < 0 or self.client is None:
            return
        dead = (worker.namespace, worker.worker_id, worker.epoch)
        if self.up:
            self._fence(*dead)
        if not self.up:
            self.pending_dead.append(dead)

    def call(self, op: str, fn, *args, **kwargs):
        """Run one index operation; on failure mark the index down (serving goes on)."""
        try:
            return fn(*args, **kwargs)
        except (CacheIndexError, RedisError) as exc:  # e.g. OOM or read-only replica too
            self.metrics.index_errors.labels(op).inc()
            if self.up:
                log.warning("index.unavailable", op=op, reason=str(exc))
            self.up = False
            self.retry_at = time.monotonic() + INDEX_RETRY_S
            for worker in self.workers.values():
                worker.writer = None
            return None

    def register(self, worker: WorkerHandle) -> None:
        """Register the worker under a fresh epoch and write its whole cache (usually empty)."""
        client = self.client
        if client is None or not self.up:
            return  # the tick registers every worker once Redis is back
        info = {"device": worker.info.device, "num_blocks": worker.info.num_blocks,
                "pid": worker.info.pid, "session": self.session,
                "control_url": self.control_url}  # fmt: skip
        epoch = self.call(
            "register", register_worker, client, worker.namespace, worker.worker_id, info
        )
        if epoch is None:
            return
        pool = worker.scheduler.kv.pool
        writer = IndexWriter(client, worker.namespace, worker.worker_id, epoch,
                             snapshot=pool.cached_entries)  # fmt: skip
        if (
            pool.num_cached_blocks()
            and self.call("resync", writer.resync, pool.cached_entries()) is None
        ):
            return  # fmt: skip
        worker.writer, worker.epoch = writer, writer.epoch
        self.namespaces.add(worker.namespace)

    def _fence(self, ns: Namespace, worker_id: str, epoch: int) -> None:
        """Stop a removed worker's entries from counting (the janitor deletes them later)."""
        self.call("mark_dead", mark_dead, self.client, ns, worker_id, epoch=epoch)

    def _on_fenced(self, worker: WorkerHandle) -> None:
        """The worker's epoch was fenced by someone else: another control plane registered the
        worker (it moved there), so this one lets it go; otherwise (e.g. Redis lost its data)
        it is registered again. Never a tug of war: only the plane it moved to registers it."""
        owner = self.call("live_owner", live_owner, self.client, worker.namespace, worker.worker_id)
        if owner is not None and owner != self.session:
            log.warning("index.worker_taken_over", worker=worker.worker_id, owner=owner)
            worker.failed = "it registered with another control plane"
            return
        self.register(worker)

    def other_planes_workers(self) -> dict[str, str] | None:
        """Every live worker another control plane owns, with that plane's client URL (None
        while Redis is away). Workers whose plane has not heartbeated them in the index for
        OWNER_STALE_MS are left out: that plane is probably gone."""
        if self.client is None or not self.up:
            return None
        owners: dict[str, str] = {}
        for ns in self.namespaces:
            records = self.call("list_workers", list_workers, self.client, ns)
            if records is None:
                return None
            for r in records:
                url, session = r.info.get("control_url"), r.info.get("session")
                fresh = r.heartbeat_age_ms < OWNER_STALE_MS
                theirs = session != self.session and url != self.control_url
                if r.live and fresh and theirs and isinstance(url, str) and url:
                    owners[r.worker_id] = url
        return owners

    def write(self, worker: WorkerHandle) -> None:
        """One step's block events for the worker, in one round trip."""
        events = worker.scheduler.take_kv_events()
        if worker.writer is None or not events:
            return
        self.call("write", worker.writer.apply, events)
        if worker.writer is not None:  # a resync or clear may have moved it to a new epoch
            worker.epoch = worker.writer.epoch

    def tick(self, now: float) -> None:
        """Periodic upkeep: recovery after an outage, heartbeats, the janitor."""
        if self.client is None:
            return
        if not self.up:
            if now < self.retry_at:
                return
            self.retry_at = now + INDEX_RETRY_S
            self.up = True  # optimistic: any failure below flips it back
            for worker in list(self.workers.values()):
                self.register(worker)
                if not self.up:
                    return
            for dead in self.pending_dead:
                self._fence(*dead)
            if self.up:
                self.pending_dead.clear()
            if self.up:
                log.info("self.resynced", workers=len(self.workers))
            return
        for worker in list(self.workers.values()):
            if worker.writer is None:  # registered while Redis was away
                self.register(worker)
        for worker in list(self.workers.values()):
            if now - worker.last_index_heartbeat < INDEX_HEARTBEAT_S:
                continue
            worker.last_index_heartbeat = now
            alive = self.call(
                "heartbeat", heartbeat, self.client, worker.namespace, worker.worker_id,
                worker.epoch,
            )  # fmt: skip
            if alive is False:  # fenced behind our back
                self._on_fenced(worker)
        if now - self.last_janitor >= JANITOR_S:
            self.last_janitor = now
            for ns in list(self.namespaces):
                # Workers nobody heartbeats any more (their control plane died) stop counting.
                self.call("expire", expire_stale_workers, self.client, ns, STALE_WORKER_MS)
                self.call("cleanup", cleanup_fenced, self.client, ns, max_batches=4)
