"""`specserve up`: a whole local service (Redis, one or more control planes, N workers and the
HTTP API) from one command, kept running: a child that dies is restarted with backoff.

Every part runs as its own process, exactly as it would across machines, so `up` exercises the
real wire protocol. Children get their own session (Ctrl-C reaches only the launcher, which then
stops them in order) and die with the launcher even if it is killed (`lifetime`).
Their output is merged into the launcher's stderr, each line prefixed with the child's name.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO

from redis import Redis

from specserve.cache_index import CacheIndexError, Namespace, connect, list_workers
from specserve.cache_index.redis_url import REDIS_URL_ENV, redact
from specserve.launch.lifetime import child_environment
from specserve.launch.local_redis import LocalRedis, RedisNotFound
from specserve.shared.cpus import divide_cpus, format_cpus, usable_cpus

STOP_GRACE_S = 10.0
# A child that dies is started again after a backoff (doubling from RESTART_BACKOFF_S up to
# RESTART_BACKOFF_MAX_S); more than RESTARTS_PER_MINUTE restarts of one child in a minute mean
# something is wrong that restarting will not fix, and `up` stops everything.
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 8.0
RESTARTS_PER_MINUTE = 5
POLL_INTERVAL_S = 0.2
PROGRESS_EVERY_S = 15.0

_stderr_lock = threading.Lock()


class LaunchError(RuntimeError):
    """The service could not be started (or died while starting); everything was stopped."""


@dataclass(frozen=True)
class UpPlan:
    """What to start: plain values, so the launcher does not depend on the command line."""

    model: str
    block_size: int
    hash_algo: str
    workers: int
    port: int
    redis_url: str | None = None
    control_flags: list[str] = field(default_factory=list)  # routing, policy, metrics...
    worker_flags: list[str] = field(default_factory=list)  # engine flags, for every worker
    log_flags: list[str] = field(default_factory=list)  # global flags for every child
    ready_timeout_s: float = 300.0
    keys: str | None = None  # the key directory (CURVE on both ports); None: unauthenticated
    api_port: int | None = None  # the OpenAI-compatible HTTP API on 127.0.0.1; None: none
    api_flags: list[str] = field(default_factory=list)  # model name, concurrency
    # Active-active control planes on one Redis index: plane i listens on port + 2i (clients)
    # and port + 2i + 1 (workers); workers and the API know them all and move when one goes.
    control_planes: int = 1
    # Each worker is pinned to its own share of the cores `up` may use (unless not `pin`), with
    # this many threads (None: one per core of its share, or of the machine when not pinned).
    threads_per_worker: int | None = None
    pin: bool = True

    @property
    def urls(self) -> list[str]:
        return [f"tcp://127.0.0.1:{self.port + 2 * i}" for i in range(self.control_planes)]

    @property
    def worker_urls(self) -> list[str]:
        return [f"tcp://127.0.0.1:{self.port + 2 * i + 1}" for i in range(self.control_planes)]

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def worker_url(self) -> str:
        return self.worker_urls[0]

    def control_names(self) -> list[str]:
        return ["control"] + [f"control-{i}" for i in range(1, self.control_planes)]

    def ports(self) -> list[int]:
        """Every port `up` listens on."""
        api = [] if self.api_port is None else [self.api_port]
        return [self.port + i for i in range(2 * self.control_planes)] + api

    @property
    def namespace(self) -> Namespace:
        """Where the control plane registers the workers (named after `--model`)."""
        return Namespace.for_model(self.model, self.block_size, self.hash_algo)

    def worker_ids(self) -> list[str]:
        return [f"worker-{i}" for i in range(self.workers)]


def say(line: str, name: str = "up") -> None:
    """One progress line on stderr, prefixed like the children's lines."""
    with _stderr_lock:
        sys.stderr.write(f"[{name}] {line}\n")
        sys.stderr.flush()


def _pump(name: str, stream: IO[bytes]) -> None:
    """Copy a child's output to our stderr line by line, marked with its name."""
    prefix = f"[{name}] ".encode()
    field = b'{"process": ' + json.dumps(name).encode() + b", "
    out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    for line in iter(stream.readline, b""):
        if line.startswith(b"{") and not line.startswith(b"{}"):
            # A JSON log line (--log-json): name the process inside it, so it stays one object.
            line = field + line[1:]
            prefix_line = line
        else:
            prefix_line = prefix + line
        with _stderr_lock:
            if out is not None:
                out.write(prefix_line if line.endswith(b"\n") else prefix_line + b"\n")
                out.flush()
            else:
                sys.stderr.write(f"{prefix_line.decode(errors='replace').rstrip()}\n")
    stream.close()


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    pump: threading.Thread
    argv: list[str]  # how to start it again
    redis_url: str | None
    restarts: list[float] = field(default_factory=list)  # when it was restarted (monotonic)
    restart_at: float | None = None  # dead, to be started again at this time

    def exit_status(self) -> int | None:
        return self.proc.poll() if self.restart_at is None else None


class Cluster:
    """The processes of one local service, and their orderly shutdown."""

    def __init__(self, plan: UpPlan) -> None:
        self.plan = plan
        self.children: list[Child] = []
        self.redis: LocalRedis | None = None
        self.redis_url = plan.redis_url or ""

    # --- starting ------------------------------------------------------------------------

    def start_redis(self) -> None:
        """A private Redis unless the plan names one."""
        if self.plan.redis_url is None:
            try:
                self.redis = LocalRedis(die_with_parent=True).start()
            except RedisNotFound as exc:
                raise LaunchError(f"{exc}, or pass --redis-url") from None
            except RuntimeError as exc:
                raise LaunchError(f"could not start a private Redis: {exc}") from None
            self.redis_url = self.redis.url
            say(f"started Redis at {self.redis_url} (pid {self.redis.proc.pid})")

    def start_processes(self) -> None:
        """The control plane, then the workers (which retry until the control plane answers).

        The Redis URL, which may hold a password, reaches the control plane in its environment,
        never in its arguments (readable by every user of the machine); workers never get it.
        """
        plan = self.plan
        keys = ["--keys", plan.keys] if plan.keys else []
        for name, url, worker_url in zip(
            plan.control_names(), plan.urls, plan.worker_urls, strict=True
        ):
            control = ["control", "--bind", url, "--worker-bind", worker_url, *keys]
            control += ["--model", plan.model, *plan.control_flags]
            self.spawn(name, control, redis_url=self.redis_url)
        shares = divide_cpus(usable_cpus(), plan.workers)
        for i, (worker_id, share) in enumerate(zip(plan.worker_ids(), shares, strict=True)):
            first = i % plan.control_planes  # spread the workers over the planes
            planes = ",".join(plan.worker_urls[first:] + plan.worker_urls[:first])
            worker = ["worker", "--control", planes, "--worker-id", worker_id, *keys]
            if plan.pin:
                worker += ["--cpus", format_cpus(share)]
            if plan.pin or plan.threads_per_worker:
                worker += ["--threads", str(plan.threads_per_worker or len(share))]
            self.spawn(worker_id, [*worker, *plan.worker_flags])
        if plan.api_port is not None:
            client_key = [*keys, "--key-name", "client"] if keys else []
            api = ["api", "--control", ",".join(plan.urls), "--port", str(plan.api_port)]
            api += [*client_key, *plan.api_flags]
            self.spawn("api", api)

    def spawn(self, name: str, argv: list[str], redis_url: str | None = None) -> Child:
        proc, pump = self._start(name, argv, redis_url)
        child = Child(name, proc, pump, argv, redis_url)
        self.children.append(child)
        return child

    def _start(
        self, name: str, argv: list[str], redis_url: str | None
    ) -> tuple[subprocess.Popen, threading.Thread]:
        cmd = [sys.executable, "-m", "specserve.cli", *self.plan.log_flags, *argv]
        env = child_environment()
        env.pop(REDIS_URL_ENV, None)
        if redis_url is not None:
            env[REDIS_URL_ENV] = redis_url
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        pump = threading.Thread(target=_pump, args=(name, proc.stdout), daemon=True)
        pump.start()
        say(f"started {name} (pid {proc.pid})")
        return proc, pump

    # --- watching ------------------------------------------------------------------------

    def check_children(self) -> None:
        """Raise LaunchError naming the first child that has exited."""
        for child in self.children:
            code = child.proc.poll()
            if code is not None:
                raise LaunchError(
                    f"{child.name} exited with status {code}; its log is above (prefixed "
                    f"[{child.name}])"
                )

    def live_workers(self, client: Redis, since_ms: int) -> set[str]:
        """Our workers that the control plane registered as live after `since_ms` (server clock).

        The time bound ignores records left in a shared Redis by an earlier run.
        """
        ours = set(self.plan.worker_ids())
        try:
            records = list_workers(client, self.plan.namespace)
        except CacheIndexError:
            return set()  # Redis hiccup: ask again on the next poll
        return {
            r.worker_id
            for r in records
            if r.live and r.worker_id in ours and r.registered_ms >= since_ms
        }

    def wait_ready(self, since_ms: int) -> None:
        plan = self.plan
        client = connect(self.redis_url)
        start = time.monotonic()
        last_count, last_said = -1, start
        try:
            while True:
                self.check_children()
                live = len(self.live_workers(client, since_ms))
                if live >= plan.workers:
                    return
                now = time.monotonic()
                if live != last_count or now - last_said >= PROGRESS_EVERY_S:
                    say(f"waiting for workers: {live}/{plan.workers} live ({now - start:.0f} s)")
                    last_count, last_said = live, now
                if now - start > plan.ready_timeout_s:
                    raise LaunchError(
                        f"only {live} of {plan.workers} workers were live after "
                        f"{plan.ready_timeout_s:.0f} s (raise --ready-timeout for large models)"
                    )
                time.sleep(POLL_INTERVAL_S)
        finally:
            client.close()

    def serve_forever(self) -> int:
        """Until a signal arrives (KeyboardInterrupt), restarting children that die; 1 when one
        keeps dying (more than RESTARTS_PER_MINUTE restarts in a minute)."""
        while True:
            try:
                self.supervise(time.monotonic())
            except LaunchError as exc:
                print(f"error: {exc}; stopping", file=sys.stderr)
                return 1
            time.sleep(POLL_INTERVAL_S)

    def supervise(self, now: float) -> None:
        """Schedule a restart for each child that died, and start those whose time has come.

        The control plane moves a dead worker's requests to the others (and takes the new one
        when it registers); workers and the HTTP API reconnect to a restarted control plane.
        """
        for child in self.children:
            code = child.exit_status()
            if code is not None:
                child.restarts = [t for t in child.restarts if now - t < 60.0]
                if len(child.restarts) >= RESTARTS_PER_MINUTE:
                    raise LaunchError(
                        f"{child.name} exited with status {code}, its {len(child.restarts) + 1}"
                        f"th exit within a minute: not restarting it again; its log is above "
                        f"(prefixed [{child.name}])"
                    )
                delay = min(RESTART_BACKOFF_S * 2 ** len(child.restarts), RESTART_BACKOFF_MAX_S)
                say(f"{child.name} exited with status {code}; restarting it in {delay:g} s")
                child.pump.join(timeout=1.0)
                child.restart_at = now + delay
            elif child.restart_at is not None and now >= child.restart_at:
                child.proc, child.pump = self._start(child.name, child.argv, child.redis_url)
                child.restarts.append(now)
                child.restart_at = None

    # --- stopping ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every child (workers first), SIGKILL what is left after 10 s, stop Redis.
        Workers get SIGINT, which stops them at once: SIGTERM would drain them, handing their
        requests to a control plane that is stopping too."""
        for child in reversed(self.children):
            if child.proc.poll() is None:
                is_worker = child.argv[0] == "worker"
                child.proc.send_signal(signal.SIGINT if is_worker else signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in reversed(self.children):
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"{child.name} did not stop within {STOP_GRACE_S:.0f} s: killing it")
                child.proc.kill()
                child.proc.wait()
        for child in self.children:
            child.pump.join(timeout=2.0)
        if self.redis is not None:
            self.redis.close()
            self.redis = None


def check_port_free(port: int) -> None:
    """Fail early when something listens on `port`. On Linux the probe binds with SO_REUSEADDR,
    as ZeroMQ does, so the connections a previous run left in TIME_WAIT do not count as "in
    use" while a live listener still does (elsewhere that option would also hide listeners)."""
    with socket.socket() as sock:
        if sys.platform.startswith("linux"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise LaunchError(f"port {port} is in use: pick another with --port") from None


def _check_redis(url: str) -> int:
    """Redis's clock in ms, which also proves it answers."""
    client = connect(url, socket_timeout=2.0, connect_timeout=2.0)
    try:
        sec, usec = client.time()
    except Exception as exc:  # any failure here means: not a reachable Redis
        raise LaunchError(f"cannot reach Redis at {redact(url)}: {exc}") from None
    finally:
        client.close()
    return sec * 1000 + usec // 1000


@contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM stops `up` the way Ctrl-C does (as KeyboardInterrupt), in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _signals_ignored() -> Iterator[None]:
    """A second Ctrl-C must not cut the shutdown short and leave orphans (it is bounded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _say_serving(plan: UpPlan, redis_url: str) -> None:
    workers = f"{plan.workers} worker{'s' if plan.workers != 1 else ''}"
    at = ", ".join(plan.urls)
    line = f"specserve is serving {plan.model} at {at} ({workers}, redis {redact(redis_url)})"
    if plan.api_port is not None:
        line += f"; OpenAI API at http://127.0.0.1:{plan.api_port}/v1"
    with _stderr_lock:
        print(line, file=sys.stderr, flush=True)


def run_up(plan: UpPlan, on_ready: Callable[[str], int] | None = None) -> int:
    """Start the service, then answer `on_ready(url)` (and stop) or serve until interrupted."""
    plan.namespace  # noqa: B018 - validate the model name etc. before starting anything
    for port in plan.ports():
        check_port_free(port)
    cluster = Cluster(plan)
    with _signals_interrupt():
        try:
            cluster.start_redis()
            since_ms = _check_redis(cluster.redis_url)  # before any worker can register
            cluster.start_processes()
            cluster.wait_ready(since_ms)
            _say_serving(plan, cluster.redis_url)
            if on_ready is not None:
                return on_ready(plan.url)
            return cluster.serve_forever()
        except KeyboardInterrupt:
            say("interrupted: stopping")
            return 0 if on_ready is None else 130
        finally:
            with _signals_ignored():
                cluster.shutdown()
            say("stopped")
