"""Write-through: event sequences become the expected Redis sets, in one round trip per step."""

from __future__ import annotations

import hashlib

import pytest

from specserve.cache_index import (
    IndexOutOfSync,
    IndexUnavailable,
    IndexWriter,
    connect,
    register_worker,
)
from specserve.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


def digest(i: int) -> bytes:
    return hashlib.sha256(b"block-%d" % i).digest()


H = [digest(i) for i in range(64)]


def holders(client, ns, group, block_hash):
    return client.hgetall(ns.block_key(group, block_hash))


def reverse(client, ns, worker_id, epoch):
    return client.smembers(ns.reverse_key(worker_id, epoch))


def member(group, block_hash):
    return bytes((group,)) + block_hash[:16]


def test_stored_removed_cleared_sequence(client, ns):
    epoch = register_worker(client, ns, "w", {})
    writer = IndexWriter(client, ns, "w", epoch)
    writer.apply([BlockStored(H[0:4], [1, 2, 3, 4], None, 0)])
    writer.apply([BlockRemoved([H[2]], 0), BlockStored(H[4:6], [5, 6], H[3], 0)])
    assert reverse(client, ns, "w", epoch) == {member(0, H[i]) for i in (0, 1, 3, 4, 5)}
    for i in (0, 1, 3, 4, 5):
        assert holders(client, ns, 0, H[i]) == {b"w": str(epoch).encode()}
    assert not client.exists(ns.block_key(0, H[2]))  # the last field gone, the key is gone
    assert writer.stats.blocks_written == 6 and writer.stats.blocks_removed == 1

    # A clear fences everything at once under a new epoch; later events of the same step land.
    writer.apply(
        [BlockStored([H[7]], [7], None, 0), AllBlocksCleared(), BlockStored([H[8]], [8], None, 0)]
    )
    assert writer.epoch == epoch + 1
    assert writer.stats.clears == 1
    assert reverse(client, ns, "w", writer.epoch) == {member(0, H[8])}
    assert not client.exists(ns.block_key(0, H[7]))  # stored before the clear: dropped
    assert client.smembers(ns.fenced_key) == {f"w@{epoch}".encode()}
    assert client.hget(ns.live_key, "w") == str(writer.epoch).encode()


def test_duplicate_blocks_are_reference_counted(client, ns):
    """The pool may cache one hash in two blocks; the entry stays until both are evicted."""
    writer = IndexWriter(client, ns, "w", register_worker(client, ns, "w", {}))
    writer.apply([BlockStored(H[0:2], [1, 2], None, 0)])
    writer.apply([BlockStored([H[1]], [3], H[0], 0)])  # a twin of block 1
    writer.apply([BlockRemoved([H[1]], 0)])
    assert holders(client, ns, 0, H[1]) == {b"w": b"1"}
    writer.apply([BlockRemoved([H[1]], 0), BlockRemoved([H[40]], 0)])
    assert holders(client, ns, 0, H[1]) == {}
    assert writer.stats.unknown_removes == 1
    assert writer.num_entries == 1


def test_groups_are_separate_entries(client, ns):
    writer = IndexWriter(client, ns, "w", register_worker(client, ns, "w", {}))
    writer.apply([BlockStored([H[0]], [1], None, 0), BlockStored([H[0]], [2], None, 1)])
    writer.apply([BlockRemoved([H[0]], 1)])
    assert holders(client, ns, 0, H[0]) == {b"w": b"1"}
    assert holders(client, ns, 1, H[0]) == {}


def test_one_round_trip_per_apply(round_trips, ns):
    client = round_trips.client
    writer = IndexWriter(client, ns, "w", register_worker(client, ns, "w", {}))
    round_trips.reset()
    steps = [
        [BlockStored(H[0:16], list(range(1, 17)), None, 0)],
        [BlockStored(H[16:20], [17, 18, 19, 20], H[15], 0), BlockRemoved(H[0:3], 0)],
        [BlockRemoved([H[5]], 0), BlockRemoved([H[6]], 0), BlockStored([H[30]], [30], None, 1)],
    ]
    for events in steps:
        writer.apply(events)
    assert round_trips.sends == len(steps) == writer.stats.round_trips
    round_trips.reset()
    writer.apply([])  # nothing to write: no round trip
    assert round_trips.sends == 0


def test_huge_steps_are_split_into_bounded_pipelines(client, ns):
    writer = IndexWriter(client, ns, "w", register_worker(client, ns, "w", {}), max_commands=8)
    writer.apply([BlockStored(H[0:20], list(range(20)), None, 0)])  # 21 commands
    assert writer.stats.round_trips == 3
    assert len(reverse(client, ns, "w", 1)) == 20


def test_redis_down_raises_index_unavailable_and_counts_drops(ns):
    dead = connect("redis://127.0.0.1:1/0", socket_timeout=0.2, connect_timeout=0.2, retries=0)
    writer = IndexWriter(dead, ns, "w", 1)
    with pytest.raises(IndexUnavailable, match="redis unavailable"):
        writer.apply([BlockStored(H[0:2], [1, 2], None, 0)])
    assert writer.stats.batches_dropped == 1 and writer.needs_resync
    # Later deltas would build on a state Redis never saw: refuse them until a resync.
    with pytest.raises(IndexOutOfSync):
        writer.apply([BlockRemoved([H[0]], 0)])
    assert writer.stats.batches_dropped == 2
    with pytest.raises(IndexUnavailable):
        writer.resync([(0, H[1])])
