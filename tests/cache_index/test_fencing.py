"""Epoch fencing: dead or restarted workers stop counting at once; the janitor cleans up later."""

from __future__ import annotations

import hashlib
import time

import pytest
from index_testing import command_calls

from specserve.cache_index import (
    IndexFenced,
    IndexReader,
    IndexWriter,
    cleanup_dead_worker,
    cleanup_fenced,
    expire_stale_workers,
    heartbeat,
    list_workers,
    mark_dead,
    register_worker,
    stats,
)
from specserve.shared.kv_events import BlockStored


def digest(i: int) -> bytes:
    return hashlib.sha256(b"chain-%d" % i).digest()


CHAIN = [digest(i) for i in range(300)]


def writer_for(client, ns, worker_id, n, info=None):
    writer = IndexWriter(client, ns, worker_id, register_worker(client, ns, worker_id, info or {}))
    writer.apply([BlockStored(CHAIN[:n], list(range(n)), None, 0)])
    return writer


def test_mark_dead_fences_in_the_next_lookup(client, ns):
    writer_for(client, ns, "a", 4)
    writer_for(client, ns, "b", 2)
    reader = IndexReader(client, ns)
    assert reader.longest_prefix(CHAIN[:4]) == {"a": 4, "b": 2}
    assert mark_dead(client, ns, "a") == 1
    assert reader.longest_prefix(CHAIN[:4]) == {"b": 2}
    assert mark_dead(client, ns, "a") is None  # already fenced
    assert mark_dead(client, ns, "b", epoch=7) is None  # not its live epoch: untouched
    assert reader.longest_prefix(CHAIN[:4]) == {"b": 2}


def test_reregistration_fences_the_old_epoch(client, ns):
    old = writer_for(client, ns, "a", 4)
    reader = IndexReader(client, ns)
    new_epoch = register_worker(client, ns, "a", {"restarted": True})  # the worker restarted
    assert new_epoch == old.epoch + 1
    assert reader.longest_prefix(CHAIN[:4]) == {}
    new = IndexWriter(client, ns, "a", new_epoch)
    new.apply([BlockStored(CHAIN[:2], [1, 2], None, 0)])
    assert reader.longest_prefix(CHAIN[:4]) == {"a": 2}
    # The old writer learns it is fenced in the same round trip and stops.
    with pytest.raises(IndexFenced):
        old.apply([BlockStored(CHAIN[4:5], [9], CHAIN[3], 0)])
    with pytest.raises(IndexFenced):
        old.apply([])
    assert reader.longest_prefix(CHAIN[:5]) == {"a": 2}


def test_cleanup_uses_the_reverse_set_and_never_scans(client, ns):
    writer_for(client, ns, "a", 250)
    writer_for(client, ns, "b", 3)
    mark_dead(client, ns, "a")
    scans_before = command_calls(client, "scan", "keys")
    result = cleanup_dead_worker(client, ns, "a", 1, batch_size=64)
    assert command_calls(client, "scan", "keys") == scans_before
    assert result.entries_removed == 250 and result.batches == 4 and result.done
    assert not client.exists(ns.reverse_key("a", 1))
    assert not client.exists(ns.block_key(0, CHAIN[100]))
    assert client.hgetall(ns.block_key(0, CHAIN[0])) == {b"b": b"1"}
    assert client.smembers(ns.fenced_key) == set()
    assert IndexReader(client, ns).longest_prefix(CHAIN[:3]) == {"b": 3}


def test_cleanup_keeps_entries_a_newer_epoch_rewrote(client, ns):
    old = writer_for(client, ns, "a", 5)
    new = IndexWriter(client, ns, "a", register_worker(client, ns, "a", {}))
    new.apply([BlockStored(CHAIN[:3], [1, 2, 3], None, 0)])
    results = cleanup_fenced(client, ns)
    assert list(results) == [("a", old.epoch)]
    assert results[("a", old.epoch)].entries_removed == 2  # blocks 3 and 4
    assert IndexReader(client, ns).longest_prefix(CHAIN[:5]) == {"a": 3}
    with pytest.raises(ValueError, match="live"):
        cleanup_dead_worker(client, ns, "a", new.epoch)


def test_zombie_writes_after_cleanup_are_swept_again(client, ns):
    zombie = writer_for(client, ns, "a", 2)
    mark_dead(client, ns, "a")
    cleanup_fenced(client, ns)
    with pytest.raises(IndexFenced):  # its write lands, but it sees the fence in the same trip
        zombie.apply([BlockStored(CHAIN[2:4], [3, 4], CHAIN[1], 0)])
    assert IndexReader(client, ns).longest_prefix(CHAIN[:4]) == {}
    assert client.smembers(ns.fenced_key) == {b"a@1"}
    cleanup_fenced(client, ns)
    assert not client.exists(ns.block_key(0, CHAIN[2]))


def test_heartbeat_expiry_and_listing(client, ns):
    a = writer_for(client, ns, "a", 3, {"addr": "tcp://a"})
    writer_for(client, ns, "b", 1)
    assert heartbeat(client, ns, "a", a.epoch)
    time.sleep(0.06)
    assert heartbeat(client, ns, "b", 1)
    assert expire_stale_workers(client, ns, max_age_ms=40) == ["a"]
    assert not heartbeat(client, ns, "a", a.epoch)  # fenced: it must register again
    assert IndexReader(client, ns).longest_prefix(CHAIN[:3]) == {"b": 1}
    records = {w.worker_id: w for w in list_workers(client, ns)}
    assert records["a"].state == "dead" and not records["a"].live
    assert records["a"].info == {"addr": "tcp://a"} and records["a"].dead_ms is not None
    assert records["b"].live and records["b"].heartbeat_age_ms < 1000

    s = stats(client, ns)
    assert [(w.worker_id, w.blocks, w.live) for w in s.workers] == [("a", 3, False), ("b", 1, True)]
    assert s.live_workers == 1 and s.live_entries == 1
    assert s.fenced_epochs == 1 and s.fenced_entries == 3
    assert s.block_keys_upper_bound == 4 and s.db_keys >= 9
