"""Redis clients and namespaces for the index tests (the session's Redis is `redis_url`, from
tests/conftest.py).

Each test gets its own namespace (a unique model name), so tests never see each other's keys and
a shared REDIS_URL server is left as it was found.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from index_testing import RoundTrips, drop_namespace, local_redis, new_namespace

from specserve.cache_index import Namespace, connect
from specserve.launch.local_redis import LocalRedis


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
