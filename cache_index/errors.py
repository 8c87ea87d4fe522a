"""Errors of the Redis prefix index, so callers can keep serving when the index cannot.

The index is an optimisation: the router falls back to load-only routing and the scheduler keeps
scheduling when Redis is down, so every Redis connection failure surfaces as one catchable type.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis


class CacheIndexError(Exception):
    """Base class of every error the index raises on purpose."""


class IndexUnavailable(CacheIndexError):
    """Redis could not be reached (connection refused, reset or timed out)."""


class IndexOutOfSync(IndexUnavailable):
    """An earlier batch was dropped, so deltas would be applied to a stale state: resync first."""


class IndexFenced(CacheIndexError):
    """This writer's epoch is no longer the worker's live epoch (marked dead or re-registered).

    Its writes no longer count; the owner must register the worker again and resync.
    """


_UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, TimeoutError)


@contextmanager
def unavailable_as_index_error(what: str) -> Iterator[None]:
    """Turn Redis connection and timeout errors into `IndexUnavailable` naming the operation."""
    try:
        yield
    except _UNAVAILABLE as exc:
        raise IndexUnavailable(f"redis unavailable during {what}: {exc}") from exc
