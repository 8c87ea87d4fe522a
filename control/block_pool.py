"""The pool of KV blocks shared by all KV groups of one worker, with the prefix-cache map.

A block is in one of three states: in use (ref_cnt > 0, not queued), free and cached (ref_cnt 0,
queued, still findable by hash: an eviction candidate), free and uncached. Eviction is lazy: a
cached block loses its hash only when it is handed out again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from specserve.shared.hashing import BlockHash
from specserve.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

NULL_BLOCK_ID = 0


class KVBlock:
    """One block of KV slots. `prev`/`next` link it into the free queue while it is free."""

    __slots__ = ("block_hash", "block_id", "group", "next", "prev", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group = -1  # the KV group whose hash this block holds, while cached
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={cached})"


class FreeBlockQueue:
    """Doubly linked free list: O(1) pop from the head, push at either end, removal from the middle.

    Head first is eviction order: least recently freed first.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        self.append_n(blocks)

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is self._tail or block is None:
            raise ValueError("no free blocks available")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        if block.prev is None or block.next is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def append_n(self, blocks: Iterable[KVBlock]) -> None:
        last = self._tail.prev
        assert last is not None
        for block in blocks:
            block.prev, last.next = last, block
            last = block
            self.num_free += 1
        last.next = self._tail
        self._tail.prev = last

    def prepend_n(self, blocks: Sequence[KVBlock]) -> None:
        """Insert `blocks`, in order, ahead of the current head."""
        first = self._head.next
        assert first is not None
        prev = self._head
        for block in blocks:
            block.prev, prev.next = prev, block
            prev = block
            self.num_free += 1
        prev.next = first
        first.prev = prev

    def __iter__(self):
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    """Owns every block, the free queue and the (hash, group) -> block map of cached blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is the null block)")
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        # Identical content is not de-duplicated: a block id already given to a request is never
        # swapped for an older twin, so one key may map to several blocks (first inserted wins).
        self._cached: dict[tuple[BlockHash, int], dict[int, KVBlock]] = {}
        self._events: list[KVEvent] = []

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash, group: int) -> KVBlock | None:
        entry = self._cached.get((block_hash, group))
        return next(iter(entry.values())) if entry else None

    def get_cached_blocks(
        self, block_hash: BlockHash, groups: Sequence[int]
    ) -> list[KVBlock] | None:
        """One cached block per group, or None if any group misses: identical specs hit together."""
        out = []
        for group in groups:
            block = self.get_cached_block(block_hash, group)
            if block is None:
                return None
            out.append(block)
        return out

    def cached_entries(self) -> list[tuple[int, BlockHash]]:
        """Every cached block as (group, hash), one pair per block: the index's resync source."""
        return [(g, h) for (h, g), entry in self._cached.items() for _ in entry]

    def num_cached_blocks(self) -> int:
        return sum(len(entry) for entry in self._cached.values())

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Hand out `n` blocks from the head of the free queue, evicting their old hashes."""
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks with only {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving any that sit in the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference each; callers pass a request's blocks tail first.

        Blocks that can never hit (no hash) go to the head to be reused first; cached blocks join
        the tail, so within one request the shared head of a chain is evicted last.
        """
        uncached: list[KVBlock] = []
        cached: list[KVBlock] = []
        for block in ordered:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} freed more often than referenced")
            if block.ref_cnt == 0:
                (cached if block.block_hash is not None else uncached).append(block)
        self.free_queue.prepend_n(uncached)
        self.free_queue.append_n(cached)

    def cache_blocks(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[BlockHash],
        first: int,
        end: int,
        group: int,
        mask: Sequence[bool] | None = None,
    ) -> None:
        """Cache blocks[first:end] under block_hashes[first:end]; one stored event for the range.

        Null blocks and blocks that `mask` marks unreachable (indexed from `first`) are skipped.
        """
        if not self.enable_caching or first >= end:
            return
        stored_hashes: list[BlockHash] = []
        stored_ids: list[int] = []
        for i in range(first, end):
            block = blocks[i]
            if block.is_null or (mask is not None and not mask[i - first]):
                continue
            if block.block_hash is not None:
                raise AssertionError(f"block {block.block_id} is already cached")
            block_hash = block_hashes[i]
            block.block_hash = block_hash
            block.group = group
            self._cached.setdefault((block_hash, group), {})[block.block_id] = block
            stored_hashes.append(block_hash)
            stored_ids.append(block.block_id)
        if stored_hashes:
            parent = block_hashes[first - 1] if first > 0 else None
            self._events.append(BlockStored(stored_hashes, stored_ids, parent, group))

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Forget the hashes of blocks whose KV will not be computed after all."""
        for block in blocks:
            self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        key = (block.block_hash, block.group)
        entry = self._cached.get(key)
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                del self._cached[key]
        self._events.append(BlockRemoved([block.block_hash], block.group))
        block.block_hash = None
        block.group = -1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed while no block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.group = -1
        self._cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def release(self) -> None:
        """Unlink every block (the free queue links them both ways), so that a dropped pool is
        freed by reference counting alone: the control plane keeps long-lived objects out of
        the cyclic collector's sight (`gc.freeze`), which then never frees cycles."""
        for block in self.blocks:
            block.prev = block.next = None
        self.free_queue = FreeBlockQueue(())
        self.free_queue._head.next = self.free_queue._tail.prev = None
        self._cached.clear()

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
