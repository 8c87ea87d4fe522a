"""A real Redis for the index tests: REDIS_URL if set, else a private redis-server per session.

Each test gets its own namespace (a unique model name), so tests never see each other's keys and
a shared REDIS_URL server is left as it was found.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from index_testing import RoundTrips, drop_namespace, local_redis, new_namespace

from specserve.cache_index import Namespace, connect
from specserve.cache_index.local_server import LocalRedis


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    server = local_redis(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def session_client(redis_url: str) -> Iterator[redis.Redis]:
    client = connect(redis_url, socket_timeout=5, connect_timeout=2)
    yield client
    client.close()


@pytest.fixture
def client(session_client: redis.Redis) -> redis.Redis:
    return session_client


@pytest.fixture
def ns(session_client: redis.Redis) -> Iterator[Namespace]:
    namespace = new_namespace()
    yield namespace
    drop_namespace(session_client, namespace)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[LocalRedis]:
    """A second, disposable server for tests that stop Redis on purpose."""
    server = local_redis(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def round_trips(redis_url: str) -> Iterator[RoundTrips]:
    counter = RoundTrips(redis_url)
    yield counter
    counter.client.close()
