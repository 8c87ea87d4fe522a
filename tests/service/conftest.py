"""A whole service around the tiny Llama, on the session's Redis (`redis_url`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from service_harness import Service


@pytest.fixture
def service(llama_ckpt, redis_url: str, tmp_path: Path) -> Iterator[Service]:
    svc = Service(str(llama_ckpt.path), redis_url, tmp_path)
    try:
        yield svc
    finally:
        svc.close()
