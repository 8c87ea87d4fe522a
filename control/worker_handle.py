"""The control plane's view of one registered worker: its scheduler, its index writer, the step
it owes, and where the router recently sent prefixes."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from specserve.cache_index import IndexWriter, Namespace
from specserve.control.scheduler import ScheduledStep, Scheduler
from specserve.shared.hashing import BlockHash
from specserve.shared.protocol import RequestResult, StepResult, WorkerInfo

ROUTED_HINT_S = 2.0  # a routed prefix is scheduled (and in the index) well within this
ROUTED_HINT_MAX = 16_384  # block hashes remembered per worker


@dataclass
class WorkerHandle:
    info: WorkerInfo
    scheduler: Scheduler
    namespace: Namespace
    last_seen: float
    identity: bytes = b""  # its connection on the worker port
    key: str = ""  # its authenticated public key (Z85); "" without --keys
    token: str = ""  # what its heartbeats must carry (the Welcome's `session`)
    writer: IndexWriter | None = None
    epoch: int = -1
    outstanding: ScheduledStep | None = None
    failed: str | None = None  # why it is about to be removed (removal waits for a safe point)
    leaving: bool = False  # it asked to leave (`Leaving`): told `Released` once removed
    sent_at: float = 0.0  # when `outstanding` left
    result_at: float | None = None
    last_index_heartbeat: float = 0.0
    # Prefix blocks of requests just routed here, before the scheduler caches them (and the
    # index learns them): block hash -> expiry. Without it, a burst of requests sharing a cold
    # prefix would scatter over the workers before the first one is scheduled.
    routed: OrderedDict[BlockHash, float] = field(default_factory=OrderedDict)

    def checked_result(self, msg: StepResult) -> StepResult:
        """Token ids outside the vocabulary fail their request instead of reaching a client."""
        vocab = self.info.vocab_size
        bad = [
            i
            for i, res in enumerate(msg.results)
            if res.sampled_token_ids
            and (min(res.sampled_token_ids) < 0 or max(res.sampled_token_ids) >= vocab)
        ]
        if not bad:
            return msg
        results = list(msg.results)
        for i in bad:
            error = f"worker {self.worker_id} returned token ids outside the vocabulary"
            results[i] = RequestResult(results[i].handle, [], error=error)
        return StepResult(msg.version, msg.step_id, results)

    def block_hashes(self, token_ids: list[int], cache_salt: str | None) -> list[BlockHash]:
        """The prompt's block hashes exactly as this worker's scheduler will hash it."""
        return self.scheduler.kv.block_hashes(token_ids, cache_salt)

    def cached_blocks(self, hashes: list[BlockHash]) -> int:
        """Leading blocks of `hashes` in this worker's KV cache (its pool is ours: exact)."""
        return self.scheduler.kv.cached_blocks(hashes)

    def blocks_needed(self, num_tokens: int) -> int:
        """KV blocks a request of `num_tokens` tokens may hold here, drafter lookahead included."""
        return self.scheduler.kv.blocks_needed(num_tokens, self.scheduler.lookahead_tokens)

    def remember_routed(self, hashes: list[BlockHash], now: float) -> None:
        routed = self.routed
        for block_hash in hashes:
            routed[block_hash] = now + ROUTED_HINT_S
            routed.move_to_end(block_hash)
        while len(routed) > ROUTED_HINT_MAX:
            routed.popitem(last=False)

    def forget_routed(self, hashes: list[BlockHash]) -> None:
        """A request routed here moved on before it ran: its prefix will not be cached here."""
        for block_hash in hashes:
            self.routed.pop(block_hash, None)

    def routed_prefix(self, hashes: list[BlockHash], now: float) -> int:
        """Leading blocks of `hashes` routed here lately. A chain's blocks are remembered
        together, so block i routed means blocks 0..i were: found by bisection. (A hint only:
        where eviction broke a chain, it may count a block or two too many.)"""
        routed = self.routed
        lo, hi = 0, len(hashes)  # blocks [0, lo) routed; [hi, ...) not
        while lo < hi:
            mid = (lo + hi) // 2
            expiry = routed.get(hashes[mid])
            if expiry is not None and expiry >= now:
                lo = mid + 1
            else:
                hi = mid
        return lo

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def load(self) -> float:
        s = self.scheduler
        queued = (len(s.running) + len(s.waiting)) / s.config.max_num_seqs
        return max(queued, s.kv.usage())
