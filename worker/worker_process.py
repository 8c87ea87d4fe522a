"""The worker process: one `WorkerEngine` serving step batches from the control plane over ZeroMQ.

The main thread owns the engine and a DEALER socket: it registers (re-sending `Register` until a
`Welcome` arrives, since the control plane may start later), then executes each `StepBatch` and
replies with its `StepResult` at once. A second thread with its own DEALER socket sends
heartbeats, so a long forward pass never looks like a dead worker. zmq sockets are not
thread-safe, so the two threads share only the session string, under a lock.

Given several control planes (active-active, sharing one Redis index), a worker serves one at a
time: when its connection to that one drops (the process died, or it stopped answering ZeroMQ
heartbeats), or none welcomed it within SWITCH_S, it moves to the next with fresh sockets (so
nothing queued for or from the old one survives) and registers there; that plane's Welcome
resets the engine, as after any registration. The first plane given is its home: while away, it
checks every HOME_CHECK_S whether home answers again, and then goes back the way a draining
worker leaves (its requests move to the away plane's other workers first), so a restarted
plane gets its workers back.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import re
import secrets
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType

import structlog
import torch
import zmq

from specserve.shared import protocol
from specserve.shared.connection import (
    HANDSHAKE_REFUSALS,
    heartbeat,
    next_url,
    pending_events,
    watch_connection,
)
from specserve.shared.curve import PeerKeys
from specserve.shared.protocol import PROTOCOL_VERSION
from specserve.shared.ready_file import ReadyFile
from specserve.shared.socket_limits import bound_socket, worker_max_message_bytes
from specserve.worker.engine import EngineArgs, WorkerEngine

__all__ = [
    "EXIT_OK",
    "EXIT_REJECTED",
    "WorkerServer",
    "WorkerStats",
    "default_worker_id",
    "failed_result",
    "run_worker",
]

log = structlog.get_logger(__name__)

EXIT_OK = 0
EXIT_REJECTED = 3
REGISTER_RETRY_S = 2.0  # re-send Register this often until the control plane answers
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # after SIGTERM, wait this long at most to be released
POLL_MS = 100  # how often the main loop looks at `stop`
HEARTBEAT_SUFFIX = "#hb"  # '#' cannot appear in a worker id, so the identities never collide
HEARTBEAT_MAX_MESSAGE_BYTES = 1 << 20  # only short error replies ever reach that socket
SWITCH_S = 5.0  # with several control planes: how long to wait for a Welcome before the next
# While away from the first control plane given: how long before, and how often, to look for it
# (not at once: a plane that was just restarted is in the middle of a failover burst).
HOME_CHECK_S = 10.0

_NOT_ID_CHAR = re.compile(f"[^{protocol.WORKER_ID_CHARS}]")


def default_worker_id(pid: int | None = None) -> str:
    """`{hostname}-{pid}`, with the hostname cleaned and cut so the id stays valid."""
    suffix = f"-{pid if pid is not None else os.getpid()}"
    host = _NOT_ID_CHAR.sub("-", platform.node()) or "worker"
    return host[: 64 - len(suffix)] + suffix


def _check_interval(heartbeat_interval_s: float) -> float:
    if not (math.isfinite(heartbeat_interval_s) and heartbeat_interval_s > 0):
        raise ValueError(f"heartbeat_interval_s must be > 0, got {heartbeat_interval_s}")
    return heartbeat_interval_s


@dataclass
class WorkerStats:
    """Counters for one worker process. They stay off the wire: logs and callers read them."""

    registrations: int = 0
    steps: int = 0
    failed_steps: int = 0  # steps whose whole batch raised inside execute
    bad_frames: int = 0  # undecodable or unexpected messages, skipped
    dropped_sends: int = 0  # frames zmq would not queue (no connection, or a full queue)
    execute_s: float = 0.0  # total time inside engine.execute
    idle_s: float = 0.0  # total gap between a sent StepResult and the next StepBatch

    def record_step(self, execute_s: float, idle_s: float | None, failed: bool) -> None:
        self.steps += 1
        self.failed_steps += failed
        self.execute_s += execute_s
        if idle_s is not None:
            self.idle_s += idle_s


def _dealer(
    ctx: zmq.Context,
    identity: str,
    url: str,
    max_message_bytes: int,
    keys: PeerKeys | None,
    connect: bool = True,
) -> zmq.Socket:
    """A DEALER that queues nothing until its connection is up (IMMEDIATE), so a control plane
    that starts late is not flooded with stale Registers and heartbeats, and that drops a
    connection sending a message over `max_message_bytes`. With `keys` it authenticates with
    CURVE (and a control plane without our key never completes the connection)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    bound_socket(sock, max_message_bytes)
    if keys is not None:
        keys.apply(sock)
    if connect:
        sock.connect(url)
    return sock


def connection_identity(worker_id: str) -> str:
    """The worker socket's identity: the id (for readable logs) and a nonce, so that a restarted
    worker never collides with the connection of its previous life."""
    return f"{worker_id}#{secrets.token_hex(4)}"


def _try_send(sock: zmq.Socket, msg: protocol.Message) -> bool:
    """Send without blocking: a blocked send would stop the loop from seeing `stop`."""
    try:
        sock.send(protocol.encode(msg), zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


class _Heartbeater:
    """Sends `Heartbeat` on its own socket and thread, once registered (session set)."""

    def __init__(
        self,
        ctx: zmq.Context,
        control_url: str,
        worker_id: str,
        identity: str,
        interval_s: float,
        keys: PeerKeys | None,
    ) -> None:
        self._ctx = ctx
        self._url = control_url
        self._worker_id = worker_id
        self._identity = identity + HEARTBEAT_SUFFIX
        self._keys = keys
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._session = ""
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"heartbeat-{worker_id}", daemon=True
        )

    @property
    def session(self) -> str:
        with self._lock:
            return self._session

    @session.setter
    def session(self, value: str) -> None:
        with self._lock:
            self._session = value

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        sock = _dealer(
            self._ctx, self._identity, self._url, HEARTBEAT_MAX_MESSAGE_BYTES, self._keys
        )
        try:
            while not self._done.wait(self._interval_s):
                self._beat(sock)
        finally:
            sock.close(linger=0)

    def _beat(self, sock: zmq.Socket) -> None:
        _drain(sock)  # nothing is meant for this socket; never let replies pile up
        session = self.session
        if session:
            beat = protocol.Heartbeat(PROTOCOL_VERSION, self._worker_id, session)
            _try_send(sock, beat)


def _drain(sock: zmq.Socket) -> None:
    while True:
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return


class WorkerServer:
    """Serves one built engine to the control plane at `control_url` until stopped."""

    def __init__(
        self,
        engine: WorkerEngine,
        control_url: str | Sequence[str],
        worker_id: str,
        heartbeat_interval_s: float = 0.5,
        stop: threading.Event | None = None,
        keys: PeerKeys | None = None,
        drain: threading.Event | None = None,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        ready_file: str | None = None,
    ) -> None:
        self.engine = engine
        self.ready = ReadyFile(ready_file)  # exists while registered and serving
        self.keys = keys
        self.control_urls = [control_url] if isinstance(control_url, str) else list(control_url)
        if not self.control_urls:
            raise ValueError("give at least one control plane URL")
        self.control_url = self.control_urls[0]  # the control plane in use
        self.worker_id = protocol.check_worker_id(worker_id)
        self.heartbeat_interval_s = _check_interval(heartbeat_interval_s)
        self.stop = stop if stop is not None else threading.Event()
        # Set (SIGTERM): leave gracefully, once the control plane has moved our requests away.
        self.drain = drain if drain is not None else threading.Event()
        self.drain_timeout_s = drain_timeout_s
        self._leaving_since: float | None = None  # when `Leaving` was sent
        self._released = False  # the control plane answered `Leaving` with `Released`
        self._homecoming = False  # leaving the plane in use to go back to the first one
        self._probe: zmq.Socket | None = None  # a connection attempt home, while away
        self._probe_at = 0.0
        self.info = engine.info(worker_id)
        self.stats = WorkerStats()
        self.session = ""  # the control-plane session of the last Welcome
        self._registered = False
        self._last_register = -math.inf  # when Register last left the socket
        self._result_sent_at: float | None = None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._poller = zmq.Poller()
        self._connected = False  # a handshake with the control plane in use succeeded
        self._refusal: str | None = None  # why the control plane refused the last handshake
        self._connected_at = 0.0  # when the sockets to the control plane in use were made
        self._heartbeater: _Heartbeater | None = None
        self._ctx: zmq.Context | None = None
        self._identity = connection_identity(self.worker_id)

    def run(self) -> int:
        """Serve until `stop` is set (exit code 0) or the control plane rejects us (3)."""
        self._ctx = zmq.Context()
        self._connect(self.control_urls[0])
        try:
            code = self._loop()
        finally:
            self.ready.set(False)
            self._disconnect()
            self._ctx.term()
        log.info("worker.stopped", worker_id=self.worker_id, exit_code=code, **self._summary())
        return code

    def _connect(self, url: str) -> None:
        """Sockets (and the heartbeat thread) to the control plane at `url`; register anew."""
        assert self._ctx is not None
        log.info("worker.connecting", worker_id=self.worker_id, url=url)
        info = self.info
        max_bytes = worker_max_message_bytes(
            info.max_num_seqs, info.max_model_len, len(info.kv_groups)
        )
        self.control_url = url
        self._sock = _dealer(self._ctx, self._identity, url, max_bytes, self.keys, connect=False)
        heartbeat(self._sock)  # a control plane that stops answering is left
        self._monitor = watch_connection(self._sock)
        self._sock.connect(url)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self.ready.set(False)
        self._connected, self._connected_at = False, time.monotonic()
        self._probe_at = self._connected_at  # away from home: first look for it HOME_CHECK_S on
        self._registered, self._last_register = False, -math.inf
        self._heartbeater = _Heartbeater(
            self._ctx, url, self.worker_id, self._identity, self.heartbeat_interval_s, self.keys
        )
        self._heartbeater.start()

    def _disconnect(self) -> None:
        """Close the sockets to the control plane in use: nothing queued either way survives."""
        self._close_probe()
        if self._heartbeater is not None:
            self._heartbeater.close()
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)

    def _switch(self, reason: str, to: str | None = None) -> None:
        """Move to control plane `to` (default: the next one given)."""
        old = self.control_url
        new = to or next_url(self.control_urls, old)
        log.warning("worker.switching", worker_id=self.worker_id, left=old, to=new, reason=reason)
        self._disconnect()  # (the probe home too)
        self._leaving_since, self._released, self._homecoming = None, False, False
        self._connect(new)

    def _home_is_back(self) -> bool:
        """While registered away from home: whether the home control plane answers again (a
        probe connection completes; IMMEDIATE makes it writable only then)."""
        home = self.control_urls[0]
        if self.control_url == home or not self._registered:
            self._close_probe()
            return False
        now = time.monotonic()
        if self._probe is None:
            if now - self._probe_at >= HOME_CHECK_S:
                assert self._ctx is not None
                self._probe = _dealer(
                    self._ctx,
                    self._identity + "#probe",
                    home,
                    HEARTBEAT_MAX_MESSAGE_BYTES,
                    self.keys,
                )
                self._probe_at = now
            return False
        if self._probe.poll(0, zmq.POLLOUT):
            self._close_probe()
            return True
        return False

    def _close_probe(self) -> None:
        if self._probe is not None:
            self._probe.close(linger=0)
            self._probe = None

    def _connection_lost(self) -> bool:
        """Read the monitor: True when an established connection to the control plane dropped."""
        assert self._monitor is not None
        lost = False
        for event in pending_events(self._monitor):
            refusal = HANDSHAKE_REFUSALS.get(event)
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected, self._refusal = True, None
            elif event == zmq.EVENT_DISCONNECTED and self._connected:
                self._connected, lost = False, True
            elif refusal is not None and refusal != self._refusal:  # once, not at each retry
                self._refusal = refusal
                log.error("worker.handshake_refused", control=self.control_url, reason=refusal)
        return lost

    def _summary(self) -> dict[str, object]:
        s = self.stats
        return {
            "steps": s.steps,
            "failed_steps": s.failed_steps,
            "bad_frames": s.bad_frames,
            "dropped_sends": s.dropped_sends,
            "registrations": s.registrations,
            "execute_s": round(s.execute_s, 3),
            "idle_s": round(s.idle_s, 3),
        }

    def _loop(self) -> int:
        several = len(self.control_urls) > 1
        while not self.stop.is_set():
            assert self._sock is not None
            leaving = self.drain.is_set() or self._homecoming
            if leaving and (self._released or self._done_leaving(self._sock)):
                if self.drain.is_set():
                    return EXIT_OK
                self._switch("going home", to=self.control_urls[0])
                continue
            if several and not self._homecoming and self._home_is_back():
                log.info("worker.home_is_back", worker_id=self.worker_id, home=self.control_urls[0])
                self._homecoming = True
                continue
            unwelcomed_s = time.monotonic() - self._connected_at
            if several and not self._registered and unwelcomed_s > SWITCH_S:
                self._switch(f"no Welcome within {SWITCH_S:g} s")
                continue
            self._maybe_register(self._sock)
            ready = dict(self._poller.poll(POLL_MS))
            if self._monitor in ready and self._connection_lost() and several:
                self._switch("the connection dropped")
                continue
            if self._sock not in ready:
                continue
            code = self._handle(self._sock.recv_multipart())
            if code is not None:
                return code
        return EXIT_OK

    def _done_leaving(self, sock: zmq.Socket) -> bool:
        """Draining: ask the control plane once to move our requests away (`Leaving`), and go on
        serving steps until it answers `Released`. True when there is nothing to wait for: never
        registered, or no answer within the drain timeout."""
        now = time.monotonic()
        if self._leaving_since is None:
            if not self._registered:
                log.info("worker.leaving", worker_id=self.worker_id, registered=False)
                return True
            self.ready.set(False)  # no new work: out of rotation before the control plane hears
            _try_send(sock, protocol.Leaving(PROTOCOL_VERSION, self.worker_id))
            self._leaving_since = now
            log.info("worker.leaving", worker_id=self.worker_id, registered=True)
            return False
        if now - self._leaving_since > self.drain_timeout_s:
            log.warning("worker.drain_timeout", worker_id=self.worker_id, s=self.drain_timeout_s)
            return True
        return False

    def _maybe_register(self, sock: zmq.Socket) -> None:
        """Until welcomed, (re)send Register every REGISTER_RETRY_S; while the connection is not
        up yet the send fails at once and is retried on the next tick."""
        now = time.monotonic()
        if self._registered or now - self._last_register < REGISTER_RETRY_S:
            return
        kept = self.engine.kept_requests()
        if _try_send(sock, protocol.Register(PROTOCOL_VERSION, self.info, kept)):
            self._last_register = now
            log.info(
                "worker.register_sent",
                worker_id=self.worker_id,
                url=self.control_url,
                kept_requests=len(kept),
            )

    def _handle(self, frames: list[bytes]) -> int | None:
        """Act on one message; return an exit code when the worker must stop."""
        if len(frames) != 1:
            self._bad_frame(f"expected one frame per message, got {len(frames)}")
            return None
        try:
            msg = protocol.decode(frames[0])
        except protocol.ProtocolError as exc:
            self._bad_frame(str(exc))
            return None
        match msg:
            case protocol.StepBatch() if not self._registered:
                # (only before a Welcome: e.g. a batch the last plane sent before we moved on)
                self._bad_frame("a step batch before this control plane welcomed us")
            case protocol.StepBatch():
                self._step(msg)
            case protocol.Welcome():
                self._welcome(msg)
            case protocol.Reregister():
                self._reregister(msg)
            case protocol.Released():
                log.info("worker.released", worker_id=self.worker_id)
                self._released = True
            case protocol.Rejected():
                log.error("worker.rejected", worker_id=self.worker_id, reason=msg.reason)
                return EXIT_REJECTED
            case _:
                self._bad_frame(f"unexpected {type(msg).__name__} message for a worker")
        return None

    def _bad_frame(self, reason: str) -> None:
        self.stats.bad_frames += 1
        log.warning("worker.bad_frame", worker_id=self.worker_id, reason=reason)

    def _welcome(self, msg: protocol.Welcome) -> None:
        """A new control-plane session starts with fresh handles and a block pool that holds at
        most the KV offered in Register as cached prefixes."""
        self.engine.reset()
        self.session = msg.session
        assert self._heartbeater is not None
        self._heartbeater.session = msg.session
        self._registered = True
        self.ready.set(not self.drain.is_set())
        self._result_sent_at = None
        self.stats.registrations += 1
        if msg.worker_id != self.worker_id:
            log.warning("worker.welcome_id_mismatch", worker_id=self.worker_id, got=msg.worker_id)
        log.info(
            "worker.registered", worker_id=self.worker_id, session=msg.session, epoch=msg.epoch
        )

    @property
    def _register_unanswered(self) -> bool:
        """A Register has left (since the last Reregister was acted on) with no Welcome yet."""
        return not self._registered and self._last_register != -math.inf

    def _reregister(self, msg: protocol.Reregister) -> None:
        """The control plane does not know us (it restarted): register again right away.

        The control plane answers every heartbeat it cannot place with a Reregister, so they come
        in bursts. While our own Register is still unanswered, another would only register us
        twice: it is left to the periodic retry (every REGISTER_RETRY_S), which covers a lost one.
        """
        if self._register_unanswered:
            log.debug("worker.reregister.register_pending", worker_id=self.worker_id)
            return
        log.info("worker.reregister", worker_id=self.worker_id, reason=msg.reason)
        self._registered = False
        self.ready.set(False)
        self._last_register = -math.inf

    def _step(self, batch: protocol.StepBatch) -> None:
        received = time.monotonic()
        idle_s = None if self._result_sent_at is None else received - self._result_sent_at
        error: Exception | None = None
        try:
            result = self.engine.execute(batch)
        except Exception as exc:  # fail the batch's requests, keep serving
            error = exc
            result = failed_result(batch, str(exc) or type(exc).__name__)
            # Their state may be half updated; the control plane fails them all anyway.
            self.engine.forget([r.handle for r in result.results])
        execute_s = time.monotonic() - received
        self._reply(batch.step_id, result)  # before logging: a traceback takes time to render
        if error is not None:
            log.error("worker.step_failed", step_id=batch.step_id, exc_info=error)
        self.stats.record_step(execute_s, idle_s, error is not None)
        log.debug(
            "worker.step",
            step_id=batch.step_id,
            requests=len(batch.new_requests) + len(batch.running),
            tokens=batch.num_scheduled_tokens,
            execute_ms=round(execute_s * 1e3, 3),
            idle_ms=None if idle_s is None else round(idle_s * 1e3, 3),
        )

    def _reply(self, step_id: int, result: protocol.StepResult) -> None:
        assert self._sock is not None
        if not _try_send(self._sock, result):
            self.stats.dropped_sends += 1
            log.warning("worker.result_dropped", worker_id=self.worker_id, step_id=step_id)
        self._result_sent_at = time.monotonic()


def failed_result(batch: protocol.StepBatch, error: str) -> protocol.StepResult:
    """A result that fails every new and running request of `batch` with `error`."""
    handles = [r.handle for r in batch.new_requests] + [d.handle for d in batch.running]
    results = [protocol.RequestResult(h, [], error=error) for h in handles]
    return protocol.StepResult(PROTOCOL_VERSION, batch.step_id, results)


def _install_signal_handlers(stop: threading.Event, drain: threading.Event) -> Callable[[], None]:
    """SIGTERM sets `drain` (a second one, or SIGINT, sets `stop`); only the main thread may
    install handlers. Returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGTERM and not drain.is_set():
            drain.set()
        else:
            stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    return restore


def run_worker(
    engine_args: EngineArgs,
    control_url: str | Sequence[str],
    worker_id: str | None = None,
    heartbeat_interval_s: float = 0.5,
    stop: threading.Event | None = None,
    keys: PeerKeys | None = None,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    threads: int | None = None,
    ready_file: str | None = None,
) -> int:
    """Load the engine, then serve the control plane's worker port at `control_url` (or the
    first of several that answers, moving on when it goes) until stopped, authenticating with
    `keys` when given.

    SIGTERM drains: the control plane moves this worker's requests to others (they go on from
    every token made here), then releases it; at most `drain_timeout_s` later it exits anyway.
    A second SIGTERM, or SIGINT, stops at once. `threads`: torch's threads for the model
    (default: torch's own choice). `ready_file` exists while the worker is registered and
    serving (for an exec probe). Returns the process exit code: 0 when stopped or released;
    3 when rejected.
    """
    worker_id = protocol.check_worker_id(
        worker_id if worker_id is not None else default_worker_id()
    )
    _check_interval(heartbeat_interval_s)  # fail before the slow load, not after
    stop = stop if stop is not None else threading.Event()
    drain = threading.Event()
    restore = _install_signal_handlers(stop, drain)
    if threads is not None:
        torch.set_num_threads(threads)
    log.info(
        "worker.threads",
        worker_id=worker_id,
        threads=torch.get_num_threads(),
        cpus=sorted(os.sched_getaffinity(0)),
        spin=os.environ.get("GOMP_SPINCOUNT"),
    )
    try:
        engine = _load_engine(engine_args, worker_id)
        if stop.is_set() or drain.is_set():
            log.info("worker.stopped", worker_id=worker_id, exit_code=EXIT_OK, steps=0)
            return EXIT_OK
        server = WorkerServer(
            engine, control_url, worker_id, heartbeat_interval_s, stop, keys, drain,
            drain_timeout_s, ready_file,
        )  # fmt: skip
        return server.run()
    finally:
        restore()


def _load_engine(engine_args: EngineArgs, worker_id: str) -> WorkerEngine:
    """Build the engine before connecting: loading can take long, and a worker that cannot
    load should never register."""
    log.info(
        "worker.loading", worker_id=worker_id, model=engine_args.model, device=engine_args.device
    )
    start = time.monotonic()
    engine = WorkerEngine(engine_args)
    # What loading left alive (modules, tensors, the tokenizer: ~350,000 objects for the bundled
    # model) lives as long as the worker: out of the cyclic collector's full passes, the first of
    # which would otherwise stall an early step for ~150 ms.
    gc.freeze()
    log.info("worker.loaded", worker_id=worker_id, load_s=round(time.monotonic() - start, 2))
    return engine
