"""A whole service for integration tests: a real Redis, a control plane on a real socket (in a
thread of the test process, so tests can read its state and metrics) and worker processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import redis

from specserve.cache_index.schema import key_model_name
from specserve.client import ServiceUnreachable, get_status
from specserve.control.control_plane import ControlArgs, ControlPlane
from specserve.launch.local_redis import free_port
from specserve.launch.up import LaunchError, check_port_free

WORKER_ENGINE = dict(num_blocks=160, block_size=4, max_model_len=256, max_num_seqs=16)


def up_ports(control_planes: int = 1) -> tuple[int, int]:
    """`--port` and `--api-port` for `specserve up`: a run of free ports, since plane i listens on
    port + 2i and port + 2i + 1; the API port follows the run (two independent free ports could
    make the API port another's port + 1)."""
    count = 2 * control_planes + 1
    while True:
        port = free_port()
        try:
            for offset in range(count):
                check_port_free(port + offset)
        except LaunchError:
            continue
        return port, port + count - 1


def start_up(argv: list[str], timeout_s: float = 240.0) -> tuple[subprocess.Popen, list[str]]:
    """`specserve up` with `argv`, once it says it is serving. Its stderr lines collect in the
    returned list (a thread keeps reading them), so the caller can read the log at the end."""
    up = subprocess.Popen(
        [sys.executable, "-m", "specserve.cli", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not any("specserve is serving" in line for line in lines):
            line = up.stderr.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
    except BaseException:
        up.kill()
        up.wait()
        raise
    threading.Thread(target=lambda: lines.extend(up.stderr), daemon=True).start()
    return up, lines


def stop_up(up: subprocess.Popen, redis_url: str, model: str, timeout_s: float = 60.0) -> None:
    """SIGTERM to `specserve up` (killed if it has not stopped in `timeout_s`), then its index
    keys dropped from the shared Redis."""
    up.terminate()
    try:
        up.wait(timeout_s)
    except subprocess.TimeoutExpired:
        up.kill()
        up.wait()
    drop_model_keys(redis_url, model)


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def wait_healthy(api: str, timeout_s: float = 120.0, want: int = 200) -> httpx.Response:
    """The HTTP API's /health reply once its status is `want`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = httpx.get(f"{api}/health", timeout=2)
            if response.status_code == want:
                return response
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{api}/health never answered {want}"
        time.sleep(0.2)


def drop_model_keys(redis_url: str, model: str) -> None:
    """Remove every index key of `model` (all block sizes and hashes): the session's Redis is
    shared, and a test that reads the index must see only what its own service wrote."""
    client = redis.Redis.from_url(redis_url)
    try:
        pattern = f"ssi:{{{key_model_name(model)}|*".encode()
        keys = list(client.scan_iter(match=pattern, count=1000))
        if keys:
            client.unlink(*keys)
    finally:
        client.close()


class Service:
    def __init__(self, model: str, redis_url: str | None, logdir: Path, **control: object) -> None:
        self.model = model
        self.redis_url = redis_url
        self.logdir = logdir
        # Ports are taken at the first start (port 0: the kernel's pick, bound at once) and kept
        # for restarts: a port chosen early could be taken meanwhile, e.g. as the local end of
        # an outgoing connection.
        self.url = "tcp://127.0.0.1:0"
        self.worker_url = "tcp://127.0.0.1:0"
        self.keys = control.get("keys")  # a key directory: CURVE for the workers too
        if redis_url is not None:
            drop_model_keys(redis_url, model)
        self.control_kwargs = control
        self.plane: ControlPlane | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.workers: dict[str, subprocess.Popen] = {}

    # --- control plane ----------------------------------------------------------------------

    def start_control(self) -> ControlPlane:
        args = ControlArgs(
            bind=self.url,
            worker_bind=self.worker_url,
            redis_url=self.redis_url,
            model=self.model,
            heartbeat_timeout_s=2.0,
            **self.control_kwargs,  # type: ignore[arg-type]
        )
        self.plane = ControlPlane(args)
        self.url, self.worker_url = self.plane.endpoint, self.plane.worker_endpoint
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.plane.run, args=(self._stop,), daemon=True)
        self._thread.start()
        return self.plane

    def stop_control(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._thread = None

    # --- workers ----------------------------------------------------------------------------

    def start_worker(
        self, worker_id: str, key_name: str = "worker", **engine: object
    ) -> subprocess.Popen:
        kwargs = dict(WORKER_ENGINE, model=self.model, **engine)
        keys = None if self.keys is None else (str(self.keys), "workers", key_name)
        code = (
            "import sys, torch\n"
            "torch.set_num_threads(1)\n"
            "from specserve.shared.curve import PeerKeys\n"
            "from specserve.worker.engine import EngineArgs\n"
            "from specserve.worker.worker_process import run_worker\n"
            f"keys = None if {keys!r} is None else PeerKeys.load(*{keys!r})\n"
            f"sys.exit(run_worker(EngineArgs(**{kwargs!r}), {self.worker_url!r}, {worker_id!r}, "
            "heartbeat_interval_s=0.2, keys=keys))\n"
        )
        env = dict(os.environ, SPECSERVE_LOG_LEVEL="warning", OMP_NUM_THREADS="1")
        log = open(self.logdir / f"{worker_id}.log", "ab")  # noqa: SIM115 (lives with the process)
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=log, env=env)
        self.workers[worker_id] = proc
        return proc

    def start(self, *worker_ids: str) -> ControlPlane:
        """The control plane and these workers, once every worker is registered."""
        plane = self.start_control()
        for worker_id in worker_ids:
            self.start_worker(worker_id)
        self.wait_workers(set(worker_ids))
        return plane

    def wait_workers(self, worker_ids: set[str], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.plane is not None
            if set(self.plane.workers) == worker_ids:
                return
            for wid, proc in self.workers.items():
                if proc.poll() is not None:
                    log = (self.logdir / f"{wid}.log").read_text()[-2000:]
                    raise AssertionError(f"worker {wid} exited with {proc.returncode}:\n{log}")
            time.sleep(0.05)
        raise AssertionError(f"workers {sorted(worker_ids)} did not register in {timeout}s")

    def close(self) -> None:
        self.stop_control()
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        if self.redis_url is not None:
            drop_model_keys(self.redis_url, self.model)


class ControlProcess:
    """`specserve control` as its own process, so it can be killed like a real one."""

    def __init__(self, model: str, redis_url: str, logdir: Path, name: str, *extra: str) -> None:
        self.model, self.redis_url, self.extra = model, redis_url, extra
        # Ports are the kernel's pick at the first start (a port chosen beforehand could be taken
        # meanwhile), read from its `control.ready` line, and kept for restarts.
        self.url = "tcp://127.0.0.1:0"
        self.worker_url = "tcp://127.0.0.1:0"
        self.log = logdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        argv = [
            sys.executable, "-m", "specserve.cli", "control", "--bind", self.url,
            "--worker-bind", self.worker_url, "--redis-url", self.redis_url,
            "--model", self.model, "--heartbeat-timeout", "2", *self.extra,
        ]  # fmt: skip
        first = self.url.endswith(":0")
        seen = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=log)
        if first:
            self.url, self.worker_url = self._bound_ports(seen)

    def _bound_ports(self, seen: int, timeout: float = 60.0) -> tuple[str, str]:
        """The endpoints the new process logs in `control.ready` (after byte `seen` of its log)."""
        pattern = re.compile(r"control\.ready .*endpoint=(\S+) .*worker_endpoint=(\S+)")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            found = pattern.search(self.log.read_text(errors="replace")[seen:])
            if found:
                return found.group(1), found.group(2)
            time.sleep(0.05)
        raise AssertionError(f"no control.ready line:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(timeout=10) == -signal.SIGKILL

    def wait_workers(self, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            try:
                if get_status(self.url, timeout=1.0).live_workers == count:
                    return
            except ServiceUnreachable:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{count} workers did not register:\n{self.log.read_text()[-3000:]}")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def workers_for(
    planes: ControlProcess | list[ControlProcess], model: str, logdir: Path, *ids: str
) -> Service:
    """Worker processes registered with `planes` (the harness's, pointed at their worker ports;
    given several, the first is their home and they move to the next when it goes)."""
    workers = Service(model, None, logdir)
    if isinstance(planes, ControlProcess):
        workers.worker_url = planes.worker_url
    else:
        workers.worker_url = [p.worker_url for p in planes]  # type: ignore[assignment]
    for worker_id in ids:
        workers.start_worker(worker_id)
    return workers
