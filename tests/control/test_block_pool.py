import gc

import pytest

from specserve.control.block_pool import BlockPool, FreeBlockQueue, KVBlock
from specserve.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


def test_free_queue_pops_head_removes_middle_and_pushes_at_both_ends():
    blocks = [KVBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    assert queue.block_ids() == [0, 1, 2, 3, 4, 5]
    assert queue.popleft().block_id == 0
    queue.remove(blocks[3])
    assert queue.block_ids() == [1, 2, 4, 5]
    assert queue.num_free == 4
    queue.prepend_n([blocks[3], blocks[0]])
    assert queue.block_ids() == [3, 0, 1, 2, 4, 5]
    queue.remove(blocks[5])
    queue.append_n([blocks[5]])
    assert queue.block_ids() == [3, 0, 1, 2, 4, 5]
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(KVBlock(99))
    for _ in range(6):
        queue.popleft()
    assert queue.num_free == 0
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()


def test_null_block_is_id_zero_and_never_handed_out():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_usable_blocks == 4
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.usage() == 1.0
    with pytest.raises(ValueError, match="asked for 1 blocks with only 0 free"):
        pool.get_new_blocks(1)


def _cache(pool: BlockPool, blocks, hashes, group=0):
    pool.cache_blocks(blocks, hashes, 0, len(blocks), group)


def test_freed_blocks_go_tail_first_with_uncached_ones_reused_first():
    pool = BlockPool(11)
    a = pool.get_new_blocks(4)  # ids 1..4: three full cached blocks and a partial tail
    _cache(pool, a[:3], [b"h1", b"h2", b"h3"])
    b = pool.get_new_blocks(3)  # ids 5..7, none cached
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    # Uncached blocks at the head (most recently freed first), cached chain tails before heads.
    assert pool.free_queue.block_ids() == [7, 6, 5, 4, 8, 9, 10, 3, 2, 1]


def test_touch_revives_a_cached_free_block_and_eviction_is_lazy():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    _cache(pool, blocks, [b"x", b"y"])
    pool.free_blocks(reversed(blocks))
    assert pool.get_cached_block(b"x", 0) is blocks[0]  # still findable while free
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 2
    pool.take_events()
    fresh = pool.get_new_blocks(2)  # reuses block 3 (uncached) then block 2 (evicts "y")
    assert [b.block_id for b in fresh] == [3, 2]
    assert pool.get_cached_block(b"y", 0) is None
    assert pool.take_events() == [BlockRemoved([b"y"], 0)]


def test_stored_event_covers_the_range_with_the_logical_parent():
    pool = BlockPool(8)
    blocks = [pool.null_block, *pool.get_new_blocks(3)]
    pool.cache_blocks(blocks, [b"a", b"b", b"c", b"d"], 1, 4, group=2, mask=[True, False, True])
    assert pool.take_events() == [BlockStored([b"b", b"d"], [1, 3], b"a", 2)]
    assert pool.get_cached_block(b"c", 2) is None
    assert pool.get_cached_block(b"b", 2) is blocks[1]
    assert pool.get_cached_block(b"b", 0) is None  # keys are per group


def test_identical_content_keeps_both_blocks_and_lookup_returns_the_first():
    pool = BlockPool(4)
    first, second = pool.get_new_blocks(2)
    _cache(pool, [first], [b"same"])
    _cache(pool, [second], [b"same"])
    assert pool.get_cached_block(b"same", 0) is first
    assert pool.num_cached_blocks() == 2
    pool.free_blocks([first])
    pool.get_new_blocks(2)  # reuses block 3, then block 1 (evicting one copy)
    assert pool.get_cached_block(b"same", 0) is second


def test_reset_prefix_cache_only_when_everything_is_free():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    _cache(pool, blocks, [b"a", b"b"])
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    pool.take_events()
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"a", 0) is None
    assert pool.take_events() == [AllBlocksCleared()]


def test_double_free_is_caught():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="freed more often"):
        pool.free_blocks([block])


def test_a_released_pool_is_freed_without_the_cyclic_collector():
    """The free queue links blocks both ways; a server freezes its long-lived objects out of the
    collector's sight, so a dropped pool must be released to be freed at all."""

    def blocks_alive() -> int:
        return sum(type(o) is KVBlock for o in gc.get_objects())

    gc.collect()
    before = blocks_alive()
    gc.disable()
    try:
        released = BlockPool(1000)
        dropped = BlockPool(1000)
        dropped.get_new_blocks(10)  # (handed out: unlinked, freed with the list they went to)
        del dropped  # never released: its 990 free blocks stay, linked to each other
        assert blocks_alive() - before >= 1990
        released.release()
        del released
        assert blocks_alive() - before < 1000  # the released pool's 1,002 went at once
    finally:
        gc.enable()
        gc.collect()
