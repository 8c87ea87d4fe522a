import pytest

from specserve.control.kv_cache_manager import KVCacheManager
from specserve.control.limits import ServiceLimits
from specserve.control.request import Request
from specserve.shared.config import CacheConfig, KVGroupSpec
from specserve.shared.protocol import KeptRequest, SamplingParams, WorkerInfo

FULL16 = (KVGroupSpec("full", 16),)


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams())


def _manager(num_blocks=20, groups=FULL16, caching=True) -> KVCacheManager:
    cfg = CacheConfig(num_blocks=num_blocks, kv_groups=groups, enable_prefix_caching=caching)
    return KVCacheManager(cfg, max_model_len=4096)


def _run_prefill(kv: KVCacheManager, req: Request, lookahead: int = 0) -> list[list[int]]:
    hit = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - hit.num_tokens, hit, lookahead)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return new


def test_prefill_caches_only_full_blocks_and_decode_grows_the_table():
    kv = _manager()
    req = _request("a", list(range(55)))
    assert _run_prefill(kv, req) == [[1, 2, 3, 4]]
    blocks = kv.coordinator.managers[0].req_blocks["a"]
    assert [b.block_hash is not None for b in blocks] == [True, True, True, False]
    assert [b.block_hash for b in blocks[:3]] == req.block_hashes
    req.all_token_ids += [7] * 4
    assert kv.allocate_slots(req, 4) == [[]]  # 59 tokens still fit in 4 blocks
    req.num_computed_tokens += 4
    req.all_token_ids += [8] * 15
    assert kv.allocate_slots(req, 15) == [[5]]  # 74 tokens: one more block
    assert blocks[3].block_hash == req.block_hashes[3]  # the old tail is now full and cached
    assert blocks[4].block_hash is None


def test_lookahead_slots_are_allocated_but_never_cached():
    kv = _manager(groups=(KVGroupSpec("full", 4),))
    req = _request("a", [1, 2, 3])
    assert kv.allocate_slots(req, 3, num_lookahead_tokens=2) == [[1, 2]]
    kv.free(req)
    req2 = _request("b", [1, 2, 3])
    assert len(kv.allocate_slots(req2, 3, num_lookahead_tokens=4)[0]) == 2
    req3 = _request("c", [1, 2, 3, 4, 5, 6, 7, 8])
    new = kv.allocate_slots(req3, 8, num_lookahead_tokens=4)
    assert len(new[0]) == 3
    cached = [b.block_hash is not None for b in kv.coordinator.managers[0].req_blocks["c"]]
    assert cached == [True, True, False]  # the lookahead block is never hashed


def test_second_request_hits_the_shared_prefix_and_recomputes_the_last_token():
    kv = _manager()
    a = _request("a", list(range(48)))
    _run_prefill(kv, a)
    b = _request("b", list(range(48)))
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 32  # limit 47 tokens: two full blocks; the last block is recomputed
    assert [blk.block_id for blk in hit.blocks[0]] == [1, 2]
    assert kv.allocate_slots(b, 16, hit) == [[4]]
    assert kv.block_ids(b) == [[1, 2, 4]]
    assert [blk.ref_cnt for blk in kv.pool.blocks[1:4]] == [2, 2, 1]


def test_lookup_has_no_side_effects():
    kv = _manager()
    a = _request("a", list(range(40)))
    _run_prefill(kv, a)
    kv.free(a)
    free_before = kv.pool.free_queue.block_ids()
    hit = kv.get_computed_blocks(_request("b", list(range(40))))
    assert hit.num_tokens == 32
    assert kv.pool.free_queue.block_ids() == free_before
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_failed_allocation_changes_nothing_and_evictable_hits_count():
    kv = _manager(num_blocks=10)
    a = _request("a", list(range(96)))  # six full blocks
    _run_prefill(kv, a)
    kv.free(a)  # six cached blocks, all in the free queue
    b = _request("b", [*range(96), *range(1000, 1040)])
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 96
    blocker = _request("x", list(range(5000, 5032)))
    kv.allocate_slots(blocker, 32)  # takes the two uncached blocks, free: 7
    # 6 hits revived from the queue + 3 new blocks = 9 > 7 free: refused, nothing touched.
    refs = [blk.ref_cnt for blk in kv.pool.blocks]
    queue = kv.pool.free_queue.block_ids()
    assert kv.allocate_slots(b, 40, hit) is None
    assert [blk.ref_cnt for blk in kv.pool.blocks] == refs
    assert kv.pool.free_queue.block_ids() == queue
    kv.free(blocker)
    assert kv.allocate_slots(b, 40, hit) is not None


def test_caching_disabled_never_hits():
    kv = _manager(caching=False)
    a = _request("a", list(range(48)))
    _run_prefill(kv, a)
    assert kv.get_computed_blocks(_request("b", list(range(48)))).num_tokens == 0
    assert kv.pool.num_cached_blocks() == 0


def test_hybrid_second_request_gets_the_hit_the_mask_promised():
    # Full attention in blocks of 32, sliding window 8 in blocks of 8: hits align to 32 tokens,
    # and the sliding group caches the last block before each boundary.
    groups = (KVGroupSpec("full", 32), KVGroupSpec("sliding", 8, sliding_window=8))
    kv = _manager(num_blocks=64, groups=groups)
    prompt = list(range(100))
    a = _request("a", prompt)
    _run_prefill(kv, a)
    swa_blocks = kv.coordinator.managers[1].req_blocks["a"]
    b = _request("b", [*prompt[:97], 7, 7, 7])  # shares 97 tokens: three segments and one
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 96
    assert [blk.block_id for blk in hit.blocks[0]] == kv.block_ids(a)[0][:3]
    swa_hit = hit.blocks[1]
    assert len(swa_hit) == 12 and swa_hit[11] is swa_blocks[11]
    assert all(blk.is_null for blk in swa_hit[:11])
    assert kv.allocate_slots(b, b.num_tokens - 96, hit) is not None


def test_hybrid_caches_segment_tails_only():
    groups = (KVGroupSpec("full", 32), KVGroupSpec("sliding", 8, sliding_window=8))
    kv = _manager(num_blocks=64, groups=groups)
    a = _request("a", list(range(100)))
    _run_prefill(kv, a)
    swa_blocks = kv.coordinator.managers[1].req_blocks["a"]
    assert [i for i, b in enumerate(swa_blocks) if b.block_hash is not None] == [3, 7, 11]
    hit = kv.get_computed_blocks(_request("b", list(range(100))))
    assert hit.num_tokens == 96


def test_allocate_needs_tokens():
    kv = _manager()
    with pytest.raises(ValueError, match="at least one new token"):
        kv.allocate_slots(_request("a", [1]), 0)


def test_blocks_needed_counts_lookahead_and_only_the_sliding_window():
    hybrid = (KVGroupSpec("full", 4), KVGroupSpec("sliding", 4, sliding_window=8))
    kv = _manager(groups=hybrid)
    assert kv.blocks_needed(10) == 3 + 3
    assert kv.blocks_needed(100, num_lookahead_tokens=4) == 26 + 3  # window 8: 2 blocks + 1
    assert _manager(groups=(KVGroupSpec("full", 4),)).blocks_needed(9, 3) == 3


def test_routing_hashes_and_cached_blocks_agree_with_the_scheduler():
    kv = _manager()
    req = _request("a", list(range(40)))
    req.cache_salt = "tenant"
    _run_prefill(kv, req)
    hashes = kv.block_hashes(list(range(40)), "tenant")
    assert hashes == req.block_hashes
    assert kv.cached_blocks(hashes) == 2
    assert kv.cached_blocks(kv.block_hashes(list(range(40)), None)) == 0


def _kept(tokens: list[int], block_ids: list[int], salt: str | None = None) -> KeptRequest:
    return KeptRequest(tokens, [block_ids], salt)


def test_adopted_kv_is_a_prefix_hit_on_the_blocks_the_worker_kept():
    """A worker that moved reports the full blocks of its requests' computed tokens; the new
    pool caches them where they lie, so the resumed request hits exactly those block ids."""
    kv = _manager()
    tokens = list(range(100, 148))  # 3 full blocks
    assert kv.adopt([_kept(tokens, [7, 3, 9], salt="t1")]) == 3
    resumed = Request("r", [*tokens, 5, 6], SamplingParams(), cache_salt="t1")
    hit = kv.get_computed_blocks(resumed)
    assert hit.num_tokens == 48
    assert [b.block_id for b in hit.blocks[0]] == [7, 3, 9]
    assert kv.take_events() == []  # the registration writes the whole pool to the index
    other_salt = Request("s", [*tokens, 5], SamplingParams(), cache_salt="t2")
    assert kv.get_computed_blocks(other_salt).num_tokens == 0
    # Adopted blocks are evicted last: fresh allocations take every other free block first.
    fresh = _request("f", list(range(16 * 16)))
    new = kv.allocate_slots(fresh, fresh.num_tokens)
    assert new is not None and not {7, 3, 9} & set(new[0])
    assert kv.get_computed_blocks(resumed).num_tokens == 48


def test_adopted_requests_share_their_common_prefix_blocks():
    kv = _manager()
    head = list(range(32))
    a, b = head + list(range(500, 516)), head + list(range(600, 616))
    assert kv.adopt([_kept(a, [4, 5, 6]), _kept(b, [4, 5, 8])]) == 4
    assert [x.block_id for x in kv.get_computed_blocks(_request("b", [*b, 1])).blocks[0]] == [
        4,
        5,
        8,
    ]


def test_a_block_claimed_at_two_places_ends_the_later_claim_there():
    """One block never holds two keys: a second request that claims an adopted block for other
    tokens keeps only the blocks before it."""
    kv = _manager()
    a = list(range(48))
    b = list(range(1000, 1048))
    assert kv.adopt([_kept(a, [4, 5, 6]), _kept(b, [9, 5, 10])]) == 4
    assert kv.get_computed_blocks(_request("b", [*b, 1])).num_tokens == 16
    assert kv.get_computed_blocks(_request("a", [*a, 1])).num_tokens == 48


def test_adoption_without_prefix_caching_adopts_nothing():
    kv = _manager(caching=False)
    assert kv.adopt([_kept(list(range(16)), [3])]) == 0


@pytest.mark.parametrize(
    ("kept", "message"),
    [
        ([KeptRequest(list(range(32)), [[1, 2]])] * 5, "5 kept requests"),
        ([KeptRequest([1] * 80, [[1, 2, 3, 4, 5]])], "80 tokens; max_model_len is 64"),
        ([KeptRequest(list(range(16)), [[1], [2]])], "2 block tables for 1 KV groups"),
        ([KeptRequest([1] * 15 + [999], [[1]])], r"kept token ids \[999\]"),
        ([KeptRequest(list(range(32)), [[1]])], "fill 2 blocks; its table has 1"),
        ([KeptRequest(list(range(32)), [[1, 1]])], "repeats a block"),
        ([KeptRequest(list(range(32)), [[0, 1]])], r"outside \[1, 20\)"),
        ([KeptRequest(list(range(32)), [[1, 20]])], r"outside \[1, 20\)"),
    ],
)
def test_kv_claims_beyond_the_workers_own_limits_are_refused(kept, message):
    info = WorkerInfo(
        worker_id="w",
        model="m",
        device="cpu",
        kv_groups=list(FULL16),
        num_blocks=20,
        max_model_len=64,
        vocab_size=100,
        eos_token_ids=[0],
        max_num_batched_tokens=64,
        max_num_seqs=4,
    )
    with pytest.raises(ValueError, match=message):
        ServiceLimits.check_kept(kept, info)
