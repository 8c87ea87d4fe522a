"""Longest-prefix lookups: contiguous from block 0, live epochs only, one round trip."""

from __future__ import annotations

import hashlib

from index_testing import command_calls

from specserve.cache_index import (
    IndexReader,
    IndexWriter,
    mark_dead,
    register_worker,
    usable_hit_blocks,
)
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


def test_a_burst_of_lookups_is_one_round_trip(round_trips, ns):
    client = round_trips.client
    client.script_flush()  # the first burst loads the script and retries
    for worker_id, held in (("a", range(8)), ("b", [0, 1, 3]), ("c", [1, 2, 3])):
        store(client, ns, worker_id, held)
    reader = IndexReader(client, ns)
    prompts = [CHAIN, CHAIN[:3], [], CHAIN[1:], [digest(99)]]
    expected = [reader.longest_prefix(p) for p in prompts]
    assert expected[0] == {"a": 8, "b": 2} and expected[3] == {"a": 7, "b": 1, "c": 3}
    client.script_flush()
    assert reader.longest_prefix_many(prompts) == expected
    round_trips.reset()
    for _ in range(3):
        assert reader.longest_prefix_many(prompts) == expected
    assert round_trips.sends == 3
    assert reader.longest_prefix_many([[], []]) == [{}, {}]
    assert round_trips.sends == 3  # nothing to look up: no round trip


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
    assert usable_hit_blocks(0, num_prompt_tokens=65, block_size=16) == 0


def test_bisection_reads_about_log2_blocks_and_counts_prefix_closed_holdings_exactly(client, ns):
    chain = [digest(1000 + i) for i in range(128)]
    lengths = {f"w{i}": 128 - 9 * i for i in range(14)}  # prefix-closed, as a block pool keeps
    for worker_id, n in lengths.items():
        writer = IndexWriter(client, ns, worker_id, register_worker(client, ns, worker_id, {}))
        writer.apply([BlockStored(chain[:n], list(range(n)), None, 0)])
    reader = IndexReader(client, ns)
    before = command_calls(client, "hmget")
    assert reader.longest_prefix(chain) == lengths
    assert command_calls(client, "hmget") - before <= 127  # never more reads than blocks
    for i in range(50):  # 50 workers more that hold the whole chain
        worker_id = f"all{i}"
        writer = IndexWriter(client, ns, worker_id, register_worker(client, ns, worker_id, {}))
        writer.apply([BlockStored(chain, list(range(128)), None, 0)])
    for worker_id in lengths:
        mark_dead(client, ns, worker_id)
    before = command_calls(client, "hmget")
    assert reader.longest_prefix(chain) == {f"all{i}": 128 for i in range(50)}
    assert command_calls(client, "hmget") - before == 7  # log2(128): one read per halving
    before = command_calls(client, "hmget")
    assert reader.longest_prefix([digest(5000 + i) for i in range(128)]) == {}
    assert command_calls(client, "hmget") - before == 0  # a miss reads block 0 only
