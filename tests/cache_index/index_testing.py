"""Helpers for the index tests: a private redis-server, round-trip counting, namespaces."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis

from specserve.cache_index import Namespace
from specserve.launch.local_redis import LocalRedis, RedisNotFound


def local_redis(workdir: Path, port: int | None = None) -> LocalRedis:
    """A private server (not started yet); skips the test when no server binary exists."""
    try:
        return LocalRedis(workdir, port)
    except RedisNotFound as exc:
        pytest.skip(f"{exc}; REDIS_URL is not set either")


class RoundTrips:
    """Counts packets sent to Redis: one per pipeline execution or single command."""

    def __init__(self, url: str) -> None:
        counter = self

        class CountingConnection(redis.Connection):
            def send_packed_command(self, command, check_health=True):
                counter.sends += 1
                return super().send_packed_command(command, check_health)

        self.sends = 0
        pool = redis.ConnectionPool.from_url(url, connection_class=CountingConnection)
        self.client = redis.Redis(connection_pool=pool)
        self.client.ping()  # connect (and its handshake) before anything is measured

    def reset(self) -> None:
        self.sends = 0


def drop_namespace(client: redis.Redis, ns: Namespace) -> None:
    """Test teardown only: the library itself never scans the keyspace."""
    keys = list(client.scan_iter(match=ns.base + b"*", count=1000))
    if keys:
        client.unlink(*keys)


def new_namespace(block_size: int = 4) -> Namespace:
    return Namespace(model=f"test-{uuid.uuid4().hex[:10]}", block_size=block_size)


def command_calls(client: redis.Redis, *names: str) -> int:
    """Calls of the named commands so far, from INFO commandstats."""
    info = client.info("commandstats")
    return sum(int(info.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in names)
