"""Helpers for the index tests: a private redis-server, round-trip counting, namespaces."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis

from specserve.cache_index import Namespace


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A private redis-server without persistence; restartable on the same port."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not on PATH and REDIS_URL is not set")
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None


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
