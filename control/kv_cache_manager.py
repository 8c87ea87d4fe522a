"""The scheduler's single entry point to KV blocks: prefix lookup, allocation, caching, freeing.

Token layout of one allocation: | computed | new hits | new tokens | lookahead |. Slots are
allocated from the hits onward; only full blocks up to computed + new tokens (never past the
request's verified tokens, so never drafts or lookahead) are hashed and cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.control.block_pool import KVBlock
from specserve.control.kv_coordinator import KVCoordinator
from specserve.control.kv_group_manager import KVGroupManager
from specserve.control.request import Request
from specserve.shared.config import AttentionType, CacheConfig
from specserve.shared.hashing import BlockHash, BlockHasher, extend_block_hashes
from specserve.shared.kv_events import KVEvent
from specserve.shared.protocol import KeptRequest


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from the cache
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class CacheHit:
    """The result of a side-effect-free prefix lookup."""

    blocks: list[list[KVBlock]]  # per KV group
    num_tokens: int

    @staticmethod
    def empty(num_groups: int) -> CacheHit:
        return CacheHit([[] for _ in range(num_groups)], 0)


class KVCacheManager:
    def __init__(self, cache_config: CacheConfig, max_model_len: int) -> None:
        self.config = cache_config
        self.max_model_len = max_model_len
        self.coordinator = KVCoordinator(cache_config)
        self.pool = self.coordinator.pool
        self.hasher = BlockHasher(cache_config.hash_algo, cache_config.hash_seed)
        self.hash_block_size = cache_config.hash_block_size
        self.enable_caching = cache_config.enable_prefix_caching
        self.stats = PrefixCacheStats()
        # One full-attention group (the common case): a running request's table only grows at
        # its end, so growing it needs none of the coordinator's fan-out.
        managers = self.coordinator.managers
        self._single_full = (
            managers[0]
            if len(managers) == 1 and managers[0].spec.attention == AttentionType.FULL
            else None
        )

    @property
    def num_groups(self) -> int:
        return self.coordinator.num_groups

    def usage(self) -> float:
        return self.pool.usage()

    def hash_request(self, request: Request) -> None:
        """Extend the request's block hashes over its verified tokens (drafts are never hashed)."""
        if self.enable_caching and len(request.all_token_ids) // self.hash_block_size > len(
            request.block_hashes
        ):
            extend_block_hashes(
                self.hasher,
                request.block_hashes,
                request.all_token_ids,
                self.hash_block_size,
                request.cache_salt,
            )

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        """The hashes `hash_request` gives a request with these tokens and salt (routing looks
        them up before the request exists)."""
        hashes: list[BlockHash] = []
        extend_block_hashes(self.hasher, hashes, token_ids, self.hash_block_size, cache_salt)
        return hashes

    def cached_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `block_hashes` the first KV group caches (a routing estimate
        that needs no index: this control plane owns the pool)."""
        n = 0
        for block_hash in block_hashes:
            if self.pool.get_cached_block(block_hash, 0) is None:
                break
            n += 1
        return n

    def blocks_needed(self, num_tokens: int, num_lookahead_tokens: int = 0) -> int:
        """KV blocks one request may hold at once when it has `num_tokens` tokens, its lookahead
        slots included; a sliding-window group holds only its window. Counted without
        `allocate_slots`' cap at max_model_len, so it errs on the safe side."""
        num_slots = num_tokens + num_lookahead_tokens
        return sum(m.max_blocks(num_slots) for m in self.coordinator.managers)

    def get_computed_blocks(self, request: Request) -> CacheHit:
        """Longest usable prefix hit; touches nothing, so an unscheduled lookup leaves no trace.

        The last token is always recomputed: the step needs its logits. A request that still
        needs prompt logprobs gets no hit: every prompt row must be computed.
        """
        if not self.enable_caching or request.needs_prompt_logprobs:
            return CacheHit.empty(self.num_groups)
        self.hash_request(request)
        blocks, num_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        return CacheHit(blocks, num_tokens)

    def record_prefix_stats(self, request: Request, hit: CacheHit) -> None:
        """Count a request's lookup once, at its first admission (not on retries or resumption)."""
        if request.prefix_stats_recorded:
            return
        request.prefix_stats_recorded = True
        self.stats.requests += 1
        self.stats.queries += request.num_tokens
        self.stats.hits += hit.num_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit: CacheHit | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[list[int]] | None:
        """Allocate slots for new tokens, adopted hits and lookahead; None if they do not fit.

        A None result changes nothing except freeing blocks that left a sliding window. Hit blocks
        that sit in the free queue count against capacity, since adopting them removes them.
        Returns the new block ids per group.
        """
        if num_new_tokens <= 0:
            raise ValueError("allocate_slots needs at least one new token")
        req_id = request.request_id
        single = self._single_full
        if single is not None and hit is None:
            table = single.req_blocks.get(req_id)
            if table is not None:  # a running request of the common single-group case
                return self._grow_table(
                    single, table, request, num_new_tokens, num_lookahead_tokens
                )
        hit_blocks: Sequence[Sequence[KVBlock]] = (
            hit.blocks if hit is not None else [[] for _ in range(self.num_groups)]
        )
        num_hit_tokens = hit.num_tokens if hit is not None else 0
        num_computed = min(request.num_computed_tokens + num_hit_tokens, self.max_model_len)
        num_main = num_computed + num_new_tokens
        num_slots = min(num_main + num_lookahead_tokens, self.max_model_len)

        coordinator = self.coordinator
        coordinator.remove_skipped_blocks(req_id, num_computed)
        needed = coordinator.num_blocks_to_allocate(req_id, num_slots, hit_blocks, num_computed)
        if needed > self.pool.num_free_blocks:
            return None
        if not coordinator.holds(req_id):
            coordinator.add_hit_blocks(req_id, hit_blocks, num_computed)
        new_blocks = coordinator.allocate_new_blocks(req_id, num_slots)
        if self.enable_caching:
            self.hash_request(request)  # usually a no-op: hashes follow the tokens as they arrive
            coordinator.cache_blocks(
                req_id, lambda: request.block_hashes, min(num_main, request.num_tokens)
            )
        return [[b.block_id for b in group] for group in new_blocks]

    def _grow_table(
        self,
        manager: KVGroupManager,
        table: list[KVBlock],
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int,
    ) -> list[list[int]] | None:
        """`allocate_slots` for a running request of a single full-attention group: the same
        accounting without the coordinator's fan-out (no hits, no window to free)."""
        req_id = request.request_id
        max_len = self.max_model_len
        num_main = min(request.num_computed_tokens, max_len) + num_new_tokens
        num_slots = min(num_main + num_lookahead_tokens, max_len)
        num_cacheable = min(num_main, len(request.all_token_ids))
        missing = -(-num_slots // manager.block_size) - len(table)
        new: list[KVBlock] = []
        if missing > 0:
            if missing > self.pool.num_free_blocks:
                return None
            new = self.pool.get_new_blocks(missing)
            table.extend(new)
        if self.enable_caching and num_cacheable // manager.block_size > manager.num_cached[req_id]:
            self.hash_request(request)
            manager.cache_blocks(req_id, lambda: request.block_hashes, num_cacheable)
        return [[b.block_id for b in new]]

    def uncache_uncomputed(self, request: Request, num_computed: int) -> None:
        """Undo this step's caching for a request that will not run after all.

        Blocks are hashed when they are scheduled, before their KV exists. A request preempted
        after it was scheduled in the same step never gets that KV, so blocks that became full
        only through this step's tokens must not stay findable.
        """
        for manager in self.coordinator.managers:
            manager.uncache_from(request.request_id, num_computed)

    def adopt(self, kept: Sequence[KeptRequest]) -> int:
        """Take over the KV a registering worker kept from its last control plane: the full
        blocks of each request's computed tokens become cached prefixes here, so a resumed
        request hits them instead of computing its prompt again. `kept` must have passed
        `ServiceLimits.check_kept`. Returns how many blocks were cached; emits no index events
        (registering the worker writes its whole pool to the index)."""
        if not self.enable_caching:
            return 0
        before = self.pool.num_cached_blocks()
        for req in kept:
            hashes = self.block_hashes(req.token_ids, req.cache_salt)
            self.coordinator.adopt(req.block_ids, hashes, len(req.token_ids))
        self.pool.take_events()
        return self.pool.num_cached_blocks() - before

    def free(self, request: Request) -> None:
        self.coordinator.free(request.request_id)

    def block_ids(self, request: Request) -> list[list[int]]:
        return self.coordinator.block_ids(request.request_id)

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
