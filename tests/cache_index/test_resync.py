"""Redis outages: writers raise IndexUnavailable instead of crashing, then resync."""

from __future__ import annotations

import hashlib
import os
import signal

import pytest

from specserve.cache_index import (
    IndexOutOfSync,
    IndexReader,
    IndexUnavailable,
    IndexWriter,
    cleanup_fenced,
    connect,
    list_workers,
    register_worker,
)
from specserve.shared.kv_events import BlockRemoved, BlockStored


def digest(i: int) -> bytes:
    return hashlib.sha256(b"chain-%d" % i).digest()


CHAIN = [digest(i) for i in range(8)]


def fast_client(url):
    return connect(url, socket_timeout=0.2, connect_timeout=0.2, retries=0)


def test_restart_with_stale_snapshot_then_resync(private_redis, ns):
    client = fast_client(private_redis.url)
    writer = IndexWriter(client, ns, "w", register_worker(client, ns, "w", {"addr": "tcp://w"}))
    writer.apply([BlockStored(CHAIN[:6], list(range(6)), None, 0)])
    # The restarted server comes back with this state. A synchronous save writes to disk, which
    # can take longer than the fast client's 0.2 s on a loaded machine: another client saves.
    connect(private_redis.url).save()
    private_redis.stop()

    with pytest.raises(IndexUnavailable):  # the eviction of blocks 4 and 5 is lost
        writer.apply([BlockRemoved(CHAIN[4:6], 0)])
    with pytest.raises(IndexOutOfSync):
        writer.apply([BlockStored(CHAIN[6:7], [6], CHAIN[5], 0)])
    assert writer.stats.batches_dropped == 2
    reader = IndexReader(client, ns)
    with pytest.raises(IndexUnavailable):
        reader.longest_prefix(CHAIN)

    private_redis.start()
    # Back up with the pre-outage state: it would claim blocks 4 and 5 that the worker evicted.
    assert reader.longest_prefix(CHAIN) == {"w": 6}
    pool_state = [(0, h) for h in CHAIN[:4]]
    old_epoch = writer.epoch
    new_epoch = writer.resync(pool_state)
    assert new_epoch == old_epoch + 1 and not writer.needs_resync
    assert reader.longest_prefix(CHAIN) == {"w": 4}  # stale entries fenced at once
    cleanup_fenced(client, ns)
    assert not client.exists(ns.block_key(0, CHAIN[5]))
    assert client.smembers(ns.reverse_key("w", new_epoch)) == {b"\x00" + h[:16] for h in CHAIN[:4]}
    writer.apply([BlockRemoved(CHAIN[3:4], 0)])  # deltas flow again
    assert reader.longest_prefix(CHAIN) == {"w": 3}
    assert [w.info for w in list_workers(client, ns)] == [{"addr": "tcp://w"}]


def test_restart_without_persistence_and_automatic_resync(private_redis, ns):
    client = fast_client(private_redis.url)
    held = [(0, h) for h in CHAIN[:3]]
    writer = IndexWriter(
        client, ns, "w", register_worker(client, ns, "w", {}), snapshot=lambda: list(held)
    )
    writer.apply([BlockStored(CHAIN[:3], [1, 2, 3], None, 0)])
    private_redis.stop()
    with pytest.raises(IndexUnavailable):
        writer.apply([BlockStored(CHAIN[3:5], [4, 5], CHAIN[2], 0)])
    held.extend((0, h) for h in CHAIN[3:5])
    private_redis.start()  # empty: no persistence

    held.pop()  # the pool evicted block 4: its event comes with a snapshot that reflects it
    writer.apply([BlockRemoved(CHAIN[4:5], 0)])  # resyncs from the snapshot instead
    assert writer.stats.resyncs == 1 and writer.epoch == 2  # never below the epoch it held
    assert IndexReader(client, ns).longest_prefix(CHAIN) == {"w": 4}
    writer.apply([BlockRemoved(CHAIN[3:4], 0)])
    assert IndexReader(client, ns).longest_prefix(CHAIN) == {"w": 3}


def test_hung_server_times_out_as_index_unavailable(private_redis, ns):
    client = fast_client(private_redis.url)
    writer = IndexWriter(client, ns, "w", register_worker(client, ns, "w", {}))
    reader = IndexReader(client, ns)
    reader.longest_prefix(CHAIN)
    os.kill(private_redis.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(IndexUnavailable, match=r"Timeout|timed out"):
            writer.apply([BlockStored(CHAIN[:2], [1, 2], None, 0)])
        with pytest.raises(IndexUnavailable):
            reader.longest_prefix(CHAIN)
    finally:
        os.kill(private_redis.proc.pid, signal.SIGCONT)
    assert writer.resync([(0, CHAIN[0])]) == 2
    assert reader.longest_prefix(CHAIN) == {"w": 1}
