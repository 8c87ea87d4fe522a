"""Worker lifecycle in the index: registration with epochs, heartbeats, fencing, listing.

A worker's entries count only while they carry its live epoch (`<ns>:live`). Every registration
issues a new epoch, and marking a worker dead removes its live epoch, so its entries stop counting
in the very next lookup; deleting them is left to the background janitor (`cleanup.py`).
"""

from __future__ import annotations

from typing import Any

import msgspec
from redis import Redis

from specserve.cache_index.client import check_client
from specserve.cache_index.errors import unavailable_as_index_error
from specserve.cache_index.schema import Namespace, check_worker_id
from specserve.cache_index.scripts import Scripts


class WorkerRecord(msgspec.Struct, frozen=True):
    """One worker as the registry sees it; `live` is what lookups obey."""

    worker_id: str
    epoch: int
    live: bool
    state: str
    registered_ms: int
    heartbeat_ms: int
    heartbeat_age_ms: int
    dead_ms: int | None = None
    info: dict[str, Any] = {}


def _new_epoch(
    client: Redis, ns: Namespace, worker_id: str, info: bytes, mode: str, expected: str
) -> int:
    keys = [ns.epochs_key, ns.live_key, ns.worker_key(worker_id), ns.fenced_key]
    with unavailable_as_index_error("worker registration"):
        return int(Scripts(client).new_epoch(keys, [worker_id, info, mode, expected]))


def register_worker(client: Redis, ns: Namespace, worker_id: str, info: dict[str, Any]) -> int:
    """(Re)register a worker and return its new epoch; any previous epoch is fenced at once."""
    check_client(client)
    check_worker_id(worker_id)
    return _new_epoch(client, ns, worker_id, msgspec.json.encode(info), "register", "")


def bump_epoch(client: Redis, ns: Namespace, worker_id: str, expected: int) -> int:
    """A new epoch for the writer that holds `expected`; -1 superseded, -2 marked dead.

    Used by resync and by AllBlocksCleared: fencing the old epoch drops its entries in O(1).
    """
    return _new_epoch(client, ns, worker_id, b"", "bump", str(expected))


def heartbeat(client: Redis, ns: Namespace, worker_id: str, epoch: int) -> bool:
    """Refresh the heartbeat; False means this epoch is fenced and the worker must re-register."""
    with unavailable_as_index_error("heartbeat"):
        done = Scripts(client).heartbeat(
            [ns.live_key, ns.worker_key(worker_id)], [worker_id, str(epoch)]
        )
    return bool(done)


def mark_dead(
    client: Redis, ns: Namespace, worker_id: str, *, epoch: int | None = None
) -> int | None:
    """Fence the worker's live epoch (only `epoch`, if given); returns the fenced epoch or None.

    Lookups stop counting its entries from the next round trip on; the janitor deletes them.
    """
    return _mark_dead(client, ns, worker_id, "", "" if epoch is None else str(epoch))


def _mark_dead(
    client: Redis, ns: Namespace, worker_id: str, max_age: str, epoch: str
) -> int | None:
    keys = [ns.live_key, ns.worker_key(worker_id), ns.fenced_key]
    with unavailable_as_index_error("mark_dead"):
        fenced = Scripts(client).mark_dead(keys, [worker_id, max_age, epoch])
    return None if fenced is None else int(fenced)


def expire_stale_workers(client: Redis, ns: Namespace, max_age_ms: int) -> list[str]:
    """Mark dead every live worker whose last heartbeat (server clock) is older than max_age_ms.

    Background work for a janitor; the age is re-checked atomically per worker, so a worker that
    heartbeats meanwhile is spared.
    """
    with unavailable_as_index_error("expire_stale_workers"):
        live = client.hkeys(ns.live_key)
    expired = []
    for raw in live:
        worker_id = raw.decode()
        if _mark_dead(client, ns, worker_id, str(max_age_ms), "") is not None:
            expired.append(worker_id)
    return expired


def live_owner(client: Redis, ns: Namespace, worker_id: str) -> str | None:
    """The `session` that registered the worker's live epoch (the control plane that owns it
    now), or None when it is not live or no session was recorded."""
    with unavailable_as_index_error("live_owner"):
        pipe = client.pipeline(transaction=False)
        pipe.hget(ns.live_key, worker_id).hmget(ns.worker_key(worker_id), "epoch", "info")
        live, (epoch, info) = pipe.execute()
    if live is None or live != epoch or info is None:
        return None
    session = msgspec.json.decode(info).get("session")
    return session if isinstance(session, str) else None


def _int(record: dict[bytes, bytes], field: bytes) -> int | None:
    value = record.get(field)
    return None if value is None else int(value)


def list_workers(client: Redis, ns: Namespace) -> list[WorkerRecord]:
    """Every worker ever registered in the namespace, sorted by id (two round trips, no SCAN)."""
    with unavailable_as_index_error("list_workers"):
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(ns.epochs_key).hgetall(ns.live_key).time()
        epochs, live, (sec, usec) = pipe.execute()
        ids = sorted(raw.decode() for raw in epochs)
        pipe = client.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(ns.worker_key(worker_id))
        records = pipe.execute() if ids else []
    now_ms = sec * 1000 + usec // 1000
    out = []
    for worker_id, record in zip(ids, records, strict=True):
        live_epoch = live.get(worker_id.encode())
        epoch = _int(record, b"epoch") or int(epochs[worker_id.encode()])
        heartbeat_ms = _int(record, b"heartbeat_ms") or 0
        out.append(
            WorkerRecord(
                worker_id=worker_id,
                epoch=epoch,
                live=live_epoch is not None and int(live_epoch) == epoch,
                state=record.get(b"state", b"unknown").decode(),
                registered_ms=_int(record, b"registered_ms") or 0,
                heartbeat_ms=heartbeat_ms,
                heartbeat_age_ms=max(0, now_ms - heartbeat_ms),
                dead_ms=_int(record, b"dead_ms"),
                info=msgspec.json.decode(record[b"info"]) if b"info" in record else {},
            )
        )
    return out
