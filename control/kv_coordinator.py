"""Coordinates the KV groups of one model (e.g. full + sliding-window layers) over one block pool.

A prefix hit is only usable if every group can serve it, so the hit length is the fixed point of
the groups' individual lookups, aligned to the lcm of their block sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specserve.control.block_pool import BlockPool, KVBlock
from specserve.control.kv_group_manager import KVGroupManager, cdiv, make_group_manager
from specserve.shared.config import AttentionType, CacheConfig
from specserve.shared.hashing import BlockHash, coarsen_block_hashes


class KVCoordinator:
    def __init__(self, cache_config: CacheConfig) -> None:
        self.config = cache_config
        self.enable_caching = cache_config.enable_prefix_caching
        self.pool = BlockPool(cache_config.num_blocks, self.enable_caching)
        self.alignment = cache_config.scheduler_block_size
        self.hash_block_size = cache_config.hash_block_size
        self.managers = [
            make_group_manager(spec, gid, self.pool, self.alignment)
            for gid, spec in enumerate(cache_config.kv_groups)
        ]
        # Groups with identical specs hit together; full attention first, since its left-to-right
        # scan gives the tightest first bound.
        buckets: dict[object, list[int]] = {}
        for gid, spec in enumerate(cache_config.kv_groups):
            buckets.setdefault(spec, []).append(gid)
        self.spec_groups: list[tuple[KVGroupManager, list[int]]] = sorted(
            ((self.managers[gids[0]], gids) for gids in buckets.values()),
            key=lambda item: item[0].spec.attention != AttentionType.FULL,
        )

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    def _hashes_for(
        self, manager: KVGroupManager, block_hashes: Sequence[BlockHash]
    ) -> Sequence[BlockHash]:
        return coarsen_block_hashes(block_hashes, self.hash_block_size, manager.block_size)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[list[list[KVBlock]], int]:
        """Per-group hit blocks and the hit length in tokens; touches nothing."""
        empty: list[list[KVBlock]] = [[] for _ in self.managers]
        if not self.enable_caching or max_length <= 0:
            return empty, 0
        if len(self.spec_groups) == 1:
            manager, gids = self.spec_groups[0]
            per_group = manager.find_longest_cache_hit(
                self._hashes_for(manager, block_hashes), max_length, gids
            )
            for gid, blocks in zip(gids, per_group, strict=True):
                empty[gid] = blocks
            return empty, len(per_group[0]) * manager.block_size
        return self._find_hybrid_hit(block_hashes, max_length)

    def _find_hybrid_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[list[list[KVBlock]], int]:
        blocks_by_group: list[list[KVBlock] | None] = [None] * self.num_groups
        simple = (
            len(self.spec_groups) == 2
            and self.spec_groups[0][0].spec.attention == AttentionType.FULL
        )
        hit = max_length
        while True:
            candidate = hit
            for manager, gids in self.spec_groups:
                is_full = manager.spec.attention == AttentionType.FULL
                if is_full and blocks_by_group[gids[0]] is not None:
                    # Full attention is downward closed: look up once, then only trim.
                    found = blocks_by_group[gids[0]]
                    assert found is not None
                    candidate = min(candidate, len(found) * manager.block_size)
                    continue
                per_group = manager.find_longest_cache_hit(
                    self._hashes_for(manager, block_hashes), candidate, gids
                )
                candidate = len(per_group[0]) * manager.block_size
                for gid, blocks in zip(gids, per_group, strict=True):
                    blocks_by_group[gid] = blocks
            if candidate >= hit:
                break
            hit = candidate
            if simple:
                break
        result: list[list[KVBlock]] = []
        for manager in self.managers:
            blocks = blocks_by_group[manager.group] or []
            result.append(blocks[: cdiv(hit, manager.block_size)] if hit else [])
        return result, hit

    # --- fan-out to every group ---------------------------------------------------------------

    def num_blocks_to_allocate(
        self,
        req_id: str,
        num_tokens: int,
        hit_blocks: Sequence[Sequence[KVBlock]],
        num_computed: int,
    ) -> int:
        return sum(
            m.num_blocks_to_allocate(req_id, num_tokens, hit_blocks[m.group], num_computed)
            for m in self.managers
        )

    def add_hit_blocks(
        self, req_id: str, hit_blocks: Sequence[Sequence[KVBlock]], num_computed: int
    ) -> None:
        # Every group touches its hits before any group allocates, so one group's allocation can
        # never evict another group's not-yet-touched hit blocks.
        for m in self.managers:
            m.add_hit_blocks(req_id, hit_blocks[m.group], num_computed)

    def allocate_new_blocks(self, req_id: str, num_tokens: int) -> list[list[KVBlock]]:
        return [m.allocate_new_blocks(req_id, num_tokens) for m in self.managers]

    def remove_skipped_blocks(self, req_id: str, num_computed: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(req_id, num_computed)

    def cache_blocks(
        self, req_id: str, block_hashes: Callable[[], Sequence[BlockHash]], num_tokens: int
    ) -> None:
        """Cache full blocks up to `num_tokens`; hybrid models only up to aligned boundaries."""
        if not self.enable_caching:
            return
        if len(self.managers) == 1:
            m = self.managers[0]
            m.cache_blocks(req_id, lambda: self._hashes_for(m, block_hashes()), num_tokens)
            return
        aligned = num_tokens // self.alignment * self.alignment
        for m in self.managers:
            m.cache_blocks(req_id, lambda m=m: self._hashes_for(m, block_hashes()), aligned)

    def adopt(
        self, block_ids: Sequence[Sequence[int]], block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> None:
        """Cache the full blocks of `num_tokens` tokens whose KV a worker computed under another
        scheduler (`block_ids`: one table per group) as evictable prefixes, the way a request
        that ran here would have left them. A block this pool already caches under another hash
        or at another position ends the adopted prefix there: one block never holds two keys."""
        tables = [[self.pool.blocks[i] for i in ids] for ids in block_ids]
        for m, table in zip(self.managers, tables, strict=True):
            hashes = self._hashes_for(m, block_hashes)
            num_blocks = min(len(table), num_tokens // m.block_size)
            usable = _consistent_blocks(table, hashes, num_blocks, m.group)
            num_tokens = min(num_tokens, usable * m.block_size)
        req_id = "#adopted"  # held only within this call
        for m, table in zip(self.managers, tables, strict=True):
            kept = table[: num_tokens // m.block_size]
            self.pool.touch(kept)
            m.req_blocks[req_id] = kept
            m.num_cached[req_id] = sum(1 for b in kept if b.block_hash is not None)
        self.cache_blocks(req_id, lambda: block_hashes, num_tokens)
        self.free(req_id)

    def free(self, req_id: str) -> None:
        for m in self.managers:
            m.free(req_id)

    def block_ids(self, req_id: str) -> list[list[int]]:
        return [m.block_ids(req_id) for m in self.managers]

    def holds(self, req_id: str) -> bool:
        return req_id in self.managers[0].req_blocks


def _consistent_blocks(
    table: Sequence[KVBlock], hashes: Sequence[BlockHash], num_blocks: int, group: int
) -> int:
    """How many leading blocks of `table` can be adopted with `hashes`: the ones already cached
    must be exactly those under their own hash (a prefix shared with an adopted request), and
    the rest not cached at all. Returned in blocks of the table."""
    n = 0
    while n < num_blocks and table[n].block_hash is not None:
        if table[n].block_hash != hashes[n] or table[n].group != group:
            return n
        n += 1
    while n < num_blocks and table[n].block_hash is None:
        n += 1
    return n
