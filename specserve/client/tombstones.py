"""Ids of requests the client gave up on, kept until their late outputs can no longer arrive.

A request the client aborts (a timeout, a stream closed early, an interrupted call) may still
have outputs on the way. Its id is kept as a tombstone until the control plane's final output for
it (finish reason "abort") arrives: every output for a tombstoned id is dropped, and a new request
that reuses the id is held back until the tombstone clears, so a retry never receives the old
request's outputs. The control plane answers each abort of a request it still holds with that
final output and stays silent otherwise, so tombstones also expire after `TOMBSTONE_TTL_S`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import structlog

from specserve.client.wire import Reply, ends_request

log = structlog.get_logger(__name__)

# How long an aborted request's id waits for the control plane's final output before it is
# forgotten (the control plane sends none for a request it no longer holds).
TOMBSTONE_TTL_S = 30.0


class Tombstones:
    """Aborted ids whose final output has not arrived yet: id -> when to forget it. Every
    tombstone lives as long, so insertion order is expiry order and expiring visits only the
    dict's expired head. `on_clear` hears of every id that leaves."""

    def __init__(self, on_clear: Callable[[str], None]) -> None:
        self._expiry: dict[str, float] = {}
        self._on_clear = on_clear

    def __iter__(self) -> Iterator[str]:
        return iter(self._expiry)

    def expiry(self, request_id: str, now: float) -> float | None:
        """When the id's tombstone expires; None when it has none (expired ones are dropped)."""
        self.expire(now)
        return self._expiry.get(request_id)

    def add(self, request_id: str, now: float) -> None:
        self.expire(now)
        self._expiry.pop(request_id, None)  # re-inserted at the end: keeps expiry order
        self._expiry[request_id] = now + TOMBSTONE_TTL_S

    def expire(self, now: float) -> None:
        expired = []
        for request_id, expiry in self._expiry.items():
            if expiry > now:
                break
            expired.append(request_id)
        for request_id in expired:
            self._clear(request_id)

    def swallow(self, reply: Reply) -> bool:
        """True when the reply is the tail of a request we aborted (its final one clears it)."""
        if reply.request_id not in self._expiry:
            return False
        if ends_request(reply):
            self._clear(reply.request_id)
        log.debug("client.reply.aborted", request_id=reply.request_id)
        return True

    def clear_all(self) -> None:
        for request_id in list(self._expiry):
            self._clear(request_id)

    def _clear(self, request_id: str) -> None:
        del self._expiry[request_id]
        self._on_clear(request_id)
