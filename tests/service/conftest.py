"""Fixtures for the service tests: a real Redis and a whole service around the tiny Llama."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from service_harness import Service

from specserve.cache_index.local_server import LocalRedis, RedisNotFound


@pytest.fixture(scope="session")
def service_redis_url() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    try:
        server = LocalRedis().start()
    except RedisNotFound as exc:
        pytest.skip(str(exc))
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
def service(llama_ckpt, service_redis_url: str, tmp_path: Path) -> Iterator[Service]:
    svc = Service(str(llama_ckpt.path), service_redis_url, tmp_path)
    try:
        yield svc
    finally:
        svc.close()
