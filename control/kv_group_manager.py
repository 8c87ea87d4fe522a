"""Per-KV-group block tables, with the hit and caching rules of each attention type.

Full attention hits left to right (every prefix of a hit is a hit). Sliding-window attention needs
only the last `window - 1` tokens before the first recomputed one, so a hit is a contiguous run of
blocks found right to left, and blocks that leave the window are freed (the table keeps the null
block in their place).

Hits are whole for every drafter. An EAGLE-3 drafter's K/V at a hit's last position read the next
token of the request that computed it, which the block's hash does not cover; vLLM drops the hit's
last block for it. Here the new request drafts with that one stale row (verification keeps the
output exact): measured on held-out ShareGPT prompts sharing a one-block system prompt, the
acceptance length was the same to three decimals, and the block's prefill is saved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specserve.control.block_pool import BlockPool, KVBlock
from specserve.shared.config import AttentionType, KVGroupSpec
from specserve.shared.hashing import BlockHash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_needed_for_hit(sliding_window: int, block_size: int) -> int:
    """Contiguous cached blocks a sliding-window hit must end with.

    The first recomputed token attends to itself plus `window - 1` earlier tokens (at least one
    block, so that a hit always ends on a cached block). Both the cache mask and the lookup call
    this, so what is cached is what a lookup uses.
    """
    return max(1, cdiv(sliding_window - 1, block_size))


def sliding_window_reachable_mask(
    first: int,
    end: int,
    block_size: int,
    sliding_window: int,
    alignment: int,
) -> list[bool] | None:
    """Which of blocks [first, end) can ever serve a hybrid hit; None means all of them.

    Hybrid hits end on multiples of `alignment`. In each aligned segment only the last `need`
    blocks before a boundary can be part of a hit.
    """
    per_segment = alignment // block_size
    need = blocks_needed_for_hit(sliding_window, block_size)
    if need >= per_segment:
        return None
    # Block i serves the hit at boundary k*per_segment iff k*per_segment - need <= i <
    # k*per_segment for some k >= 1.
    return [i % per_segment >= per_segment - need for i in range(first, end)]


class KVGroupManager:
    """Block tables of one KV group (full attention). Subclasses change the window rules."""

    def __init__(self, spec: KVGroupSpec, group: int, pool: BlockPool, alignment: int) -> None:
        self.spec = spec
        self.group = group
        self.block_size = spec.block_size
        self.pool = pool
        self.alignment = alignment
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached: dict[str, int] = {}  # leading blocks of the table already hashed

    # --- rules that differ per attention type -------------------------------------------------

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens the next query can no longer see (never for full attention)."""
        return 0

    def reachable_mask(self, first: int, end: int) -> list[bool] | None:
        return None

    def max_blocks(self, num_slots: int) -> int:
        """Blocks a request's table holds at most while it has `num_slots` slots."""
        return cdiv(num_slots, self.block_size)

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        groups: Sequence[int],
    ) -> list[list[KVBlock]]:
        """Longest aligned prefix hit for every group in `groups` (groups of an identical spec).

        Chained hashes make the first miss end the prefix. Returns one block list per group.
        """
        bs = self.block_size
        hits: list[list[KVBlock]] = []
        for block_hash in block_hashes[: max_length // bs]:
            found = self.pool.get_cached_blocks(block_hash, groups)
            if found is None:
                break
            hits.append(found)
        length = len(hits) * bs
        length -= length % self.alignment
        hits = hits[: length // bs]
        return [[per_group[j] for per_group in hits] for j in range(len(groups))]

    # --- allocation -------------------------------------------------------------------------

    def num_blocks_to_allocate(
        self, req_id: str, num_tokens: int, hit_blocks: Sequence[KVBlock], num_computed: int
    ) -> int:
        """Blocks this allocation takes from the free queue, counting revived evictable hits."""
        required = cdiv(num_tokens, self.block_size)
        table = self.req_blocks.get(req_id)
        if table is not None and req_id in self.num_cached:
            return max(required - len(table), 0)
        held = len(table) if table else 0
        skipped = self.num_skipped_tokens(num_computed) // self.block_size
        new = max(required - max(skipped, len(hit_blocks) + held), 0)
        evictable = sum(
            1 for b in hit_blocks[max(0, skipped - held) :] if b.ref_cnt == 0 and not b.is_null
        )
        return new + evictable

    def add_hit_blocks(self, req_id: str, hit_blocks: Sequence[KVBlock], num_computed: int) -> None:
        """Adopt prefix-hit blocks for a request that holds nothing yet; skipped ones stay null."""
        if req_id in self.num_cached:
            raise AssertionError(f"request {req_id} already holds blocks in group {self.group}")
        skipped = min(self.num_skipped_tokens(num_computed) // self.block_size, len(hit_blocks))
        kept = list(hit_blocks[skipped:])
        self.pool.touch(kept)
        table = [self.pool.null_block] * skipped + kept
        self.req_blocks[req_id] = table
        self.num_cached[req_id] = len(table)

    def allocate_new_blocks(self, req_id: str, num_tokens: int) -> list[KVBlock]:
        table = self.req_blocks.setdefault(req_id, [])
        self.num_cached.setdefault(req_id, 0)
        n = cdiv(num_tokens, self.block_size) - len(table)
        if n <= 0:
            return []
        new = self.pool.get_new_blocks(n)
        table.extend(new)
        return new

    def cache_blocks(
        self, req_id: str, block_hashes: Callable[[], Sequence[BlockHash]], num_tokens: int
    ) -> None:
        """Hash the table's full blocks up to `num_tokens`; `block_hashes()` runs only if needed."""
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached[req_id]
        if num_cached >= num_full:
            return
        self.pool.cache_blocks(
            self.req_blocks[req_id],
            block_hashes(),
            num_cached,
            num_full,
            self.group,
            self.reachable_mask(num_cached, num_full),
        )
        self.num_cached[req_id] = num_full

    def uncache_from(self, req_id: str, num_computed: int) -> None:
        """Un-hash the blocks this request cached beyond its first `num_computed` tokens."""
        table = self.req_blocks.get(req_id)
        if table is None:
            return
        first = num_computed // self.block_size
        self.pool.uncache(b for b in table[first : self.num_cached[req_id]] if not b.is_null)
        self.num_cached[req_id] = min(self.num_cached[req_id], first)

    def remove_skipped_blocks(self, req_id: str, num_computed: int) -> None:
        """Free blocks that left the window, newest first; their table slots become null."""
        num_skipped = self.num_skipped_tokens(num_computed)
        table = self.req_blocks.get(req_id)
        if not num_skipped or not table:
            return
        removed: list[KVBlock] = []
        for i in range(min(num_skipped // self.block_size, len(table)) - 1, -1, -1):
            if table[i].is_null:
                break
            removed.append(table[i])
            table[i] = self.pool.null_block
        self.pool.free_blocks(removed)

    def free(self, req_id: str) -> None:
        """Release a request's blocks tail first, so its shared head is evicted last."""
        table = self.req_blocks.pop(req_id, [])
        self.num_cached.pop(req_id, None)
        self.pool.free_blocks(reversed(table))

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, ())]


class SlidingWindowManager(KVGroupManager):
    def __init__(self, spec: KVGroupSpec, *args, **kwargs) -> None:
        super().__init__(spec, *args, **kwargs)
        assert spec.sliding_window is not None
        self.sliding_window = spec.sliding_window

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def max_blocks(self, num_slots: int) -> int:
        """Only the window, plus the block it straddles, stays allocated: older blocks are freed."""
        return min(super().max_blocks(num_slots), cdiv(self.sliding_window, self.block_size) + 1)

    def reachable_mask(self, first: int, end: int) -> list[bool] | None:
        return sliding_window_reachable_mask(
            first, end, self.block_size, self.sliding_window, self.alignment
        )

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        groups: Sequence[int],
    ) -> list[list[KVBlock]]:
        """Scan right to left for the last run of `need` cached blocks that ends on an aligned
        boundary; blocks before the run are null. A run starting at block 0 may be shorter."""
        bs, null = self.block_size, self.pool.null_block
        need = blocks_needed_for_hit(self.sliding_window, bs)
        n = max_length // bs
        hits: list[list[KVBlock] | None] = [None] * n
        run = 0
        found = False
        for i in range(n - 1, -1, -1):
            blocks = self.pool.get_cached_blocks(block_hashes[i], groups)
            if blocks is None:
                run = 0
                continue
            if run == 0 and bs != self.alignment and ((i + 1) * bs) % self.alignment:
                continue  # a run's right edge must land on an alignment boundary
            hits[i] = blocks
            run += 1
            if run >= need:
                del hits[i + run :]
                found = True
                break
        if not found:
            del hits[run:]  # a run that starts at block 0 needs no earlier blocks
        while len(hits) * bs % self.alignment:
            hits.pop()
        return [[h[j] if h is not None else null for h in hits] for j in range(len(groups))]


def make_group_manager(
    spec: KVGroupSpec, group: int, pool: BlockPool, alignment: int
) -> KVGroupManager:
    cls = SlidingWindowManager if spec.attention == AttentionType.SLIDING else KVGroupManager
    return cls(spec, group, pool, alignment)
