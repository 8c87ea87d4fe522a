"""A whole service around the tiny Llama, on the session's Redis (`redis_url`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from service_harness import ControlProcess, Service, workers_for


@pytest.fixture
def service(llama_ckpt, redis_url: str, tmp_path: Path) -> Iterator[Service]:
    svc = Service(str(llama_ckpt.path), redis_url, tmp_path)
    try:
        yield svc
    finally:
        svc.close()


@pytest.fixture
def planes(llama_ckpt, redis_url, tmp_path):
    """`planes(name, *worker_ids, extra=())`: a control plane process (`extra`: more of its
    flags) and workers told of it alone, registered; `planes.workers(targets, *worker_ids)`:
    workers told of several planes. Everything made is closed after the test."""
    model = str(llama_ckpt.path)
    made: list[ControlProcess] = []
    services: list[Service] = []

    def make(name: str, *worker_ids: str, extra: tuple[str, ...] = ()) -> ControlProcess:
        plane = ControlProcess(model, redis_url, tmp_path, name, *extra)
        made.append(plane)
        plane.start()
        services.append(workers_for(plane, model, tmp_path, *worker_ids))
        plane.wait_workers(len(worker_ids))
        return plane

    def workers(targets: list[ControlProcess], *worker_ids: str) -> Service:
        services.append(workers_for(targets, model, tmp_path, *worker_ids))
        return services[-1]

    make.workers = workers  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for plane in made:
            plane.close()
        for service in services:
            service.close()
