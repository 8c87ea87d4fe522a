"""Longest-prefix lookups: contiguous from block 0, live epochs only, one round trip."""

from __future__ import annotations

import hashlib

from specserve.cache_index import IndexReader, IndexWriter, register_worker, usable_hit_blocks
from specserve.shared.kv_events import BlockStored


def digest(i: int) -> bytes:
    return hashlib.sha256(b"chain-%d" % i).digest()


CHAIN = [digest(i) for i in range(8)]


def store(client, ns, worker_id, indices, group=0):
    writer = IndexWriter(client, ns, worker_id, register_worker(client, ns, worker_id, {}))
    hashes = [CHAIN[i] for i in indices]
    writer.apply([BlockStored(hashes, list(range(len(hashes))), None, group)])
    return writer


def test_three_workers_with_different_prefixes(client, ns):
    store(client, ns, "a", [0, 1, 2, 3, 4])
    store(client, ns, "b", [0, 1, 3])  # a gap at block 2: only blocks 0 and 1 are usable
    store(client, ns, "c", [1, 2, 3])  # misses block 0: nothing usable
    reader = IndexReader(client, ns)
    assert reader.longest_prefix(CHAIN) == {"a": 5, "b": 2}
    assert reader.longest_prefix(CHAIN[:3]) == {"a": 3, "b": 2}
    assert reader.longest_prefix(CHAIN[1:]) == {"a": 4, "b": 1, "c": 3}  # starts at block 1
    assert reader.longest_prefix([]) == {}
    assert reader.longest_prefix(CHAIN, group=1) == {}


def test_lookup_is_one_round_trip(round_trips, ns):
    client = round_trips.client
    for worker_id, n in (("a", 8), ("b", 3), ("c", 1)):
        store(client, ns, worker_id, range(n))
    reader = IndexReader(client, ns)
    reader.longest_prefix(CHAIN)  # loads the script on a fresh server
    round_trips.reset()
    for _ in range(5):
        assert reader.longest_prefix(CHAIN) == {"a": 8, "b": 3, "c": 1}
    assert round_trips.sends == 5
    round_trips.reset()
    reader.longest_prefix_multi({0: CHAIN, 1: CHAIN, 2: CHAIN[:2]})
    assert round_trips.sends == 1


def test_multi_group_takes_the_minimum(client, ns):
    a = store(client, ns, "a", range(6), group=0)
    a.apply([BlockStored(CHAIN[:2], [10, 11], None, 1)])
    b = store(client, ns, "b", range(3), group=0)
    b.apply([BlockStored(CHAIN[:3], [10, 11, 12], None, 1)])
    store(client, ns, "c", range(8), group=0)  # nothing in group 1: a hybrid hit is impossible
    reader = IndexReader(client, ns)
    assert reader.longest_prefix_by_group({0: CHAIN, 1: CHAIN}) == {
        0: {"a": 6, "b": 3, "c": 8},
        1: {"a": 2, "b": 3},
    }
    assert reader.longest_prefix_multi({0: CHAIN, 1: CHAIN}) == {"a": 2, "b": 3}
    # Group 1 with blocks twice as large: its hashes are every second fine hash.
    assert reader.longest_prefix_multi({0: CHAIN, 1: CHAIN}, {0: 16, 1: 32}) == {"a": 64, "b": 48}


def test_usable_hit_blocks_mirrors_the_engine_caps():
    assert usable_hit_blocks(4, num_prompt_tokens=64, block_size=16) == 3  # last token recomputed
    assert usable_hit_blocks(4, num_prompt_tokens=65, block_size=16) == 4
    assert usable_hit_blocks(4, num_prompt_tokens=65, block_size=16, drop_last=True) == 3
    assert usable_hit_blocks(0, num_prompt_tokens=65, block_size=16, drop_last=True) == 0
