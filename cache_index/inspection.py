"""Read-only views of the index for operators (what `specserve cache` prints).

Counts come from SCARD of reverse sets and the registry, never from a keyspace scan, so they are
safe to run against a production Redis. Only `discover_namespaces` scans, and only when an
operator asks for every namespace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import msgspec
from redis import Redis

from specserve.cache_index.cleanup import fenced_epochs
from specserve.cache_index.errors import unavailable_as_index_error
from specserve.cache_index.reader import IndexReader, usable_hit_blocks
from specserve.cache_index.registry import WorkerRecord, list_workers
from specserve.cache_index.schema import Namespace, UnknownHasher
from specserve.shared.hashing import (
    DEFAULT_HASH_SEED,
    BlockHash,
    BlockHasher,
    extend_block_hashes,
)


class DiscoveredNamespaces(NamedTuple):
    namespaces: list[Namespace]  # sorted by key prefix
    unknown_hasher: list[str]  # epochs keys of namespaces hashed with another algorithm or seed


def discover_namespaces(
    client: Redis, prefix: str = "ssi", hash_seed: str = DEFAULT_HASH_SEED
) -> DiscoveredNamespaces:
    """Every namespace under `prefix` that ever registered a worker (`<ns>:epochs` outlives them).

    A SCAN over the whole keyspace: for operators only, never on a request path.
    """
    found: set[Namespace] = set()
    unknown: set[str] = set()
    with unavailable_as_index_error("namespace discovery"):
        for key in client.scan_iter(match=Namespace.epochs_key_pattern(prefix), count=1000):
            try:
                found.add(Namespace.from_epochs_key(key, hash_seed))
            except UnknownHasher:
                unknown.add(key.decode(errors="replace"))
            except ValueError:
                continue  # a key that only looks like one, e.g. the record of worker "epochs"
    return DiscoveredNamespaces(sorted(found, key=lambda ns: ns.base), sorted(unknown))


class WorkerBlocks(msgspec.Struct, frozen=True):
    worker_id: str
    epoch: int
    live: bool
    blocks: int  # entries under the registry's epoch (SCARD of its reverse set)


class IndexStats(msgspec.Struct, frozen=True):
    namespace: str
    workers: list[WorkerBlocks]
    live_workers: int
    live_entries: int  # (worker, block) entries that lookups count
    fenced_epochs: int  # (worker, epoch) pairs awaiting the janitor
    fenced_entries: int  # their reverse-set members, still in memory
    block_keys_upper_bound: int  # distinct block keys are at most all entries (shared blocks)
    registry_keys: int
    db_keys: int  # DBSIZE of the whole database, other namespaces included


def stats(client: Redis, ns: Namespace) -> IndexStats:
    """Workers, their block counts and key-count estimates, in three round trips."""
    workers = list_workers(client, ns)
    fenced = fenced_epochs(client, ns)
    with unavailable_as_index_error("stats"):
        pipe = client.pipeline(transaction=False)
        for w in workers:
            pipe.scard(ns.reverse_key(w.worker_id, w.epoch))
        for worker_id, epoch in fenced:
            pipe.scard(ns.reverse_key(worker_id, epoch))
        pipe.dbsize()
        replies = pipe.execute()
    counts, fenced_counts, db_keys = (
        replies[: len(workers)],
        replies[len(workers) : -1],
        replies[-1],
    )
    rows = [
        WorkerBlocks(w.worker_id, w.epoch, w.live, int(n))
        for w, n in zip(workers, counts, strict=True)
    ]
    live_entries = sum(r.blocks for r in rows if r.live)
    fenced_entries = sum(int(n) for n in fenced_counts)
    reverse_sets = sum(1 for r in rows if r.blocks) + sum(1 for n in fenced_counts if n)
    # live, epochs, fenced, one record per worker, one reverse set per non-empty epoch
    registry_keys = 3 + len(workers) + reverse_sets
    return IndexStats(
        namespace=ns.base.decode(),
        workers=rows,
        live_workers=sum(1 for r in rows if r.live),
        live_entries=live_entries,
        fenced_epochs=len(fenced),
        fenced_entries=fenced_entries,
        block_keys_upper_bound=live_entries + fenced_entries,
        registry_keys=registry_keys,
        db_keys=int(db_keys),
    )


class PromptLookup(msgspec.Struct, frozen=True):
    namespace: str
    num_tokens: int
    num_full_blocks: int
    block_hashes: list[str]  # hex of the 16 key bytes, as in the block keys
    matched_blocks: dict[str, int]  # per live worker: leading blocks held
    usable_blocks: dict[str, int]  # what the engine could use (never the last token)
    best_worker: str | None


def lookup_prompt_blocks(
    client: Redis,
    ns: Namespace,
    token_ids: Sequence[int],
    *,
    cache_salt: str | None = None,
    adapter: str | None = None,
    group: int = 0,
) -> PromptLookup:
    """Hash a tokenized prompt as the scheduler does and ask the index who holds its prefix."""
    hasher = BlockHasher(ns.hash_algo, ns.hash_seed)
    hashes: list[BlockHash] = []
    extend_block_hashes(hasher, hashes, token_ids, ns.block_size, cache_salt, adapter)
    matched = IndexReader(client, ns).longest_prefix(hashes, group) if hashes else {}
    usable = {w: usable_hit_blocks(n, len(token_ids), ns.block_size) for w, n in matched.items()}
    best = max(sorted(matched), key=lambda w: matched[w], default=None)
    return PromptLookup(
        namespace=ns.base.decode(),
        num_tokens=len(token_ids),
        num_full_blocks=len(hashes),
        block_hashes=[h[:16].hex() for h in hashes],
        matched_blocks=matched,
        usable_blocks=usable,
        best_worker=best,
    )


class WorkerList(msgspec.Struct, frozen=True):
    namespace: str
    workers: list[WorkerRecord]


def worker_list(client: Redis, ns: Namespace) -> WorkerList:
    """The registry of one namespace, labelled with it like the other views."""
    return WorkerList(ns.base.decode(), list_workers(client, ns))
