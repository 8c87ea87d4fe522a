from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.control.block_pool import BlockPool
from specserve.control.kv_group_manager import (
    KVGroupManager,
    SlidingWindowManager,
    blocks_needed_for_hit,
    sliding_window_reachable_mask,
)
from specserve.shared.config import KVGroupSpec


def _hashes(n: int) -> list[bytes]:
    return [f"h{i}".encode() for i in range(n)]


def _cache_all(pool: BlockPool, hashes: list[bytes], group: int, keep: list[bool] | None = None):
    blocks = pool.get_new_blocks(len(hashes))
    pool.cache_blocks(blocks, hashes, 0, len(hashes), group, keep)
    return blocks


def test_full_attention_hit_is_left_to_right_and_stops_at_first_miss():
    pool = BlockPool(10)
    mgr = KVGroupManager(KVGroupSpec("full", 4), 0, pool, alignment=4)
    hashes = _hashes(5)
    blocks = _cache_all(pool, hashes, 0, keep=[True, True, False, True, True])
    (hit,) = mgr.find_longest_cache_hit(hashes, 20, [0])
    assert hit == blocks[:2]
    (hit,) = mgr.find_longest_cache_hit(hashes, 7, [0])
    assert hit == blocks[:1]  # max_length 7 allows one full block only


def test_sliding_window_hit_is_the_last_contiguous_run_found_right_to_left():
    pool = BlockPool(12)
    # window 5, block size 2: a hit needs cdiv(4, 2) = 2 contiguous blocks
    mgr = SlidingWindowManager(KVGroupSpec("sliding", 2, sliding_window=5), 0, pool, alignment=2)
    hashes = _hashes(8)
    blocks = _cache_all(pool, hashes, 0, keep=[True, False, True, True, False, True, True, False])
    (hit,) = mgr.find_longest_cache_hit(hashes, 16, [0])
    null = pool.null_block
    assert hit == [null, null, null, null, null, blocks[5], blocks[6]]
    (hit,) = mgr.find_longest_cache_hit(hashes, 11, [0])
    assert hit == [null, null, blocks[2], blocks[3]]


def test_sliding_window_frees_blocks_that_leave_the_window_newest_first():
    pool = BlockPool(10)
    mgr = SlidingWindowManager(KVGroupSpec("sliding", 2, sliding_window=4), 0, pool, alignment=2)
    mgr.allocate_new_blocks("r", 12)
    table = list(mgr.req_blocks["r"])
    mgr.remove_skipped_blocks("r", 5)  # skips 2 tokens: block 0 leaves the window
    assert mgr.block_ids("r") == [0, *[b.block_id for b in table[1:]]]
    mgr.remove_skipped_blocks("r", 6)  # skips 3 tokens: still only block 0
    assert mgr.req_blocks["r"][1] is table[1]
    mgr.remove_skipped_blocks("r", 7)
    assert mgr.req_blocks["r"][1].is_null
    pool.take_events()
    before = pool.free_queue.block_ids()
    mgr.remove_skipped_blocks("r", 11)  # skips 8 tokens: blocks 3 then 2
    freed = pool.free_queue.block_ids()[: len(pool.free_queue.block_ids()) - len(before)]
    assert freed == [table[3].block_id, table[2].block_id]  # window order: block 3, then 2


def test_reachable_mask_examples():
    # block size 8, window 8, alignment 32: 4 blocks per segment
    assert blocks_needed_for_hit(8, 8) == 1
    mask = sliding_window_reachable_mask(0, 13, 8, 8, 32)
    assert [i for i, keep in enumerate(mask) if keep] == [3, 7, 11]
    mask = sliding_window_reachable_mask(5, 9, 8, 8, 32)
    assert mask == [False, False, True, False]
    assert sliding_window_reachable_mask(0, 8, 8, 64, 32) is None  # need >= 4
    assert sliding_window_reachable_mask(0, 8, 8, 8, 8) is None  # pure SWA


@settings(max_examples=300, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    window=st.integers(1, 70),
    segments=st.integers(1, 8),
    num_blocks=st.integers(1, 40),
)
def test_mask_and_lookup_never_disagree(block_size, window, segments, num_blocks):
    """Cache exactly what the mask keeps; every aligned boundary must then hit at that length
    (the promise), and every kept block must serve some boundary's hit (nothing wasted)."""
    alignment = block_size * segments
    pool = BlockPool(num_blocks + 1)
    spec = KVGroupSpec("sliding", block_size, sliding_window=window)
    mgr = SlidingWindowManager(spec, 0, pool, alignment)
    hashes = _hashes(num_blocks)
    mask = mgr.reachable_mask(0, num_blocks)
    keep = [True] * num_blocks if mask is None else mask
    blocks = _cache_all(pool, hashes, 0, keep)
    need = blocks_needed_for_hit(window, block_size)
    used: set[int] = set()
    for boundary in range(alignment, num_blocks * block_size + 1, alignment):
        (hit,) = mgr.find_longest_cache_hit(hashes, boundary, [0])
        assert len(hit) * block_size == boundary, (boundary, keep)
        last = boundary // block_size  # one past the run's last block
        run = range(max(0, last - need), last)
        assert all(keep[i] for i in run)
        assert all(hit[i] is blocks[i] for i in run if i < len(hit))
        used.update(run)
    covered_end = max(used) + 1 if used else 0
    wasted = [i for i in range(covered_end) if keep[i] and i not in used]
    assert not wasted, (wasted, keep)


def test_evictable_hits_consume_capacity_and_skipped_hits_do_not():
    pool = BlockPool(30)
    mgr = KVGroupManager(KVGroupSpec("full", 2), 0, pool, alignment=2)
    hits = pool.get_new_blocks(10)
    pool.free_blocks(hits)  # all 10 sit in the free queue: adopting them takes capacity
    assert mgr.num_blocks_to_allocate("r", 40, hits, num_computed=20) == 20
    swa = SlidingWindowManager(KVGroupSpec("sliding", 2, sliding_window=4), 0, pool, alignment=2)
    swa_hits = [pool.null_block] * 5 + hits[5:]
    # 20 computed tokens, window 4: 17 skipped tokens = 8 skipped blocks; 2 evictable hits remain.
    assert swa.num_blocks_to_allocate("r", 40, swa_hits, num_computed=20) == 10 + 2
