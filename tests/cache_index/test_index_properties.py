"""The index agrees with a pure-Python model of the same event streams from several workers."""

from __future__ import annotations

import hashlib
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from index_testing import drop_namespace, new_namespace

from specserve.cache_index import (
    IndexReader,
    IndexWriter,
    cleanup_fenced,
    mark_dead,
    register_worker,
)
from specserve.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

HASHES = [hashlib.sha256(b"p-%d" % i).digest() for i in range(8)]
WORKERS = ("w0", "w1", "w2")

indices = st.lists(st.integers(0, len(HASHES) - 1), min_size=1, max_size=4)
event = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 1), indices),
    st.tuples(st.just("remove"), st.integers(0, 1), indices),
    st.tuples(st.just("clear"), st.just(0), st.just([])),
)
step = st.one_of(
    st.tuples(st.just("events"), st.sampled_from(WORKERS), st.lists(event, max_size=4)),
    st.tuples(st.just("restart"), st.sampled_from(WORKERS), st.just([])),
    st.tuples(st.just("resync"), st.sampled_from(WORKERS), st.just([])),
)
query = st.tuples(st.integers(0, 1), st.lists(st.integers(0, len(HASHES) - 1), max_size=6))


def expected_prefix(held: dict[str, Counter], group: int, chain: list[int]) -> dict[str, int]:
    """Each worker's length as the lookup defines it: bisection over the chain from block 0.
    For holdings that are prefix-closed (what a block pool keeps) it is the contiguous count,
    which `contiguous_prefix` checks below."""
    out = {}
    for worker_id, counts in held.items():
        if not chain or counts[(group, chain[0])] <= 0:
            continue
        lo, hi = 1, len(chain) + 1  # holds block lo - 1, not block hi - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if counts[(group, chain[mid - 1])] > 0:
                lo = mid
            else:
                hi = mid
        out[worker_id] = lo
    return out


def contiguous_prefix(counts: Counter, group: int, chain: list[int]) -> int:
    n = 0
    while n < len(chain) and counts[(group, chain[n])] > 0:
        n += 1
    return n


def to_events(counts: Counter, spec: list) -> list:
    """Events as a block pool would emit them; removals only of blocks it holds."""
    events = []
    for kind, group, idx in spec:
        if kind == "store":
            events.append(BlockStored([HASHES[i] for i in idx], idx, None, group))
            counts.update((group, i) for i in idx)
        elif kind == "remove":
            gone = []
            for i in idx:
                if counts[(group, i)] > 0:
                    counts[(group, i)] -= 1
                    gone.append(i)
            if gone:
                events.append(BlockRemoved([HASHES[i] for i in gone], group))
        else:
            events.append(AllBlocksCleared())
            counts.clear()
    return events


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(step, max_size=12), queries=st.lists(query, min_size=1, max_size=4))
def test_index_matches_model(session_client, steps, queries):
    client = session_client
    ns = new_namespace()
    try:
        held = {w: Counter() for w in WORKERS}
        writers = {
            w: IndexWriter(client, ns, w, register_worker(client, ns, w, {})) for w in WORKERS
        }
        reader = IndexReader(client, ns)
        for kind, worker_id, spec in steps:
            if kind == "events":
                writers[worker_id].apply(to_events(held[worker_id], spec))
            elif kind == "restart":  # the worker process died and came back empty
                mark_dead(client, ns, worker_id)
                epoch = register_worker(client, ns, worker_id, {})
                writers[worker_id] = IndexWriter(client, ns, worker_id, epoch)
                held[worker_id] = Counter()
            else:
                writers[worker_id].resync((g, HASHES[i]) for g, i in held[worker_id].elements())
            for group, chain in queries:
                hashes = [HASHES[i] for i in chain]
                found = reader.longest_prefix(hashes, group)
                assert found == expected_prefix(held, group, chain)
                for worker_id, counts in held.items():
                    n = contiguous_prefix(counts, group, chain)
                    closed = all(counts[(group, i)] <= 0 for i in chain[n:])
                    if closed:  # no block held past the first gap: exactly the contiguous count
                        assert found.get(worker_id, 0) == n

        # After the janitor, Redis holds exactly the model: no orphans from fenced epochs.
        cleanup_fenced(client, ns)
        assert client.smembers(ns.fenced_key) == set()
        for worker_id, writer in writers.items():
            want = {bytes((g,)) + HASHES[i][:16] for (g, i), n in held[worker_id].items() if n}
            assert client.smembers(ns.reverse_key(worker_id, writer.epoch)) == want
        for group in (0, 1):
            for i, block_hash in enumerate(HASHES):
                want = {
                    w.encode(): str(writers[w].epoch).encode()
                    for w in WORKERS
                    if held[w][(group, i)] > 0
                }
                assert client.hgetall(ns.block_key(group, block_hash)) == want
    finally:
        drop_namespace(client, ns)
