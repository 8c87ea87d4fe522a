"""Background janitor: delete the entries of fenced epochs through their reverse sets.

Fencing already made these entries invisible to lookups, so this is only about memory. It reads
one reverse set in bounded batches (SRANDMEMBER, then one atomic Lua sweep per batch) and never
scans the keyspace, so its cost is proportional to the dead worker's own entries.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis import Redis

from specserve.cache_index.client import check_client
from specserve.cache_index.errors import unavailable_as_index_error
from specserve.cache_index.schema import (
    Namespace,
    check_worker_id,
    fenced_member,
    split_fenced_member,
)
from specserve.cache_index.scripts import Scripts

MAX_BATCH = 4096  # members per Lua call; keeps each script short and its unpack() in bounds


@dataclass
class CleanupResult:
    entries_removed: int = 0  # block-key fields deleted (those a newer epoch rewrote are kept)
    members_swept: int = 0  # reverse-set members processed
    batches: int = 0
    done: bool = True  # False if max_batches stopped it early


def cleanup_dead_worker(
    client: Redis,
    ns: Namespace,
    worker_id: str,
    epoch: int,
    *,
    batch_size: int = 1000,
    max_batches: int | None = None,
) -> CleanupResult:
    """Delete the entries written by `worker_id` under the fenced `epoch`.

    Raises ValueError for the worker's live epoch: only fenced state may be swept.
    """
    check_client(client)
    check_worker_id(worker_id)
    batch_size = max(1, min(batch_size, MAX_BATCH))
    sweep = Scripts(client).sweep
    reverse = ns.reverse_key(worker_id, epoch)
    member = fenced_member(worker_id, epoch)
    result = CleanupResult()
    with unavailable_as_index_error("cleanup_dead_worker"):
        while max_batches is None or result.batches < max_batches:
            members = client.srandmember(reverse, batch_size) or []
            keys = [reverse, ns.fenced_key, ns.live_key]
            keys.extend(ns.block_key_from_member(m) for m in members)
            removed, left = sweep(keys, [worker_id, str(epoch), member, *members])
            if removed == -1:
                raise ValueError(f"epoch {epoch} of worker {worker_id} is live; fence it first")
            result.entries_removed += removed
            result.members_swept += len(members)
            result.batches += 1
            if left == 0:
                return result
    result.done = False
    return result


def fenced_epochs(client: Redis, ns: Namespace) -> list[tuple[str, int]]:
    """(worker, epoch) pairs whose entries still await deletion."""
    with unavailable_as_index_error("fenced_epochs"):
        members = client.smembers(ns.fenced_key)
    return sorted(split_fenced_member(m) for m in members)


def cleanup_fenced(
    client: Redis, ns: Namespace, *, batch_size: int = 1000, max_batches: int | None = None
) -> dict[tuple[str, int], CleanupResult]:
    """One janitor pass over every fenced epoch of the namespace."""
    return {
        (worker_id, epoch): cleanup_dead_worker(
            client, ns, worker_id, epoch, batch_size=batch_size, max_batches=max_batches
        )
        for worker_id, epoch in fenced_epochs(client, ns)
    }
