"""The control plane: a ZeroMQ ROUTER socket for clients, another for workers, and the registry
of workers (a scheduler per worker).

Each socket accepts only its role's messages, and with `--keys` each is a CURVE server whose ZAP
domain admits only that role's public keys (`shared/curve.py`), so a client key never acts as a
worker. A worker is bound at registration to its connection and authenticated key: its step
results and heartbeats count only from those, a heartbeat must carry the token its Welcome gave,
and a second registration under a live worker id is refused.

The loop, single-threaded: read every waiting frame; hand each idle worker its next step the
moment its last result is applied (the result, the index write-through and the next batch are
handled back to back, before any client traffic); then a periodic tick checks heartbeats, the
prefix index and the gauges. Client requests are validated and answered by the frontend
(`frontend.py`) and put on workers by placement (`placement.py`); the index is kept in step by
`index_sync.py`.

A worker that misses heartbeats is removed: its index epoch is fenced at once and its requests
resume on the other workers from the tokens already delivered, so a client's stream continues
with nothing lost and nothing repeated. While Redis is unavailable the control plane keeps
serving, then re-registers every worker under a fresh epoch and resyncs the index when Redis is
back.
"""

from __future__ import annotations

import gc
import itertools
import math
import secrets
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
import zmq

from specserve.cache_index import Namespace, connect
from specserve.cache_index.schema import key_model_name
from specserve.control.forwarding import (
    FORWARD_MIN_TOKENS,
    OWNERS_REFRESH_S,
    PeerLinks,
    advertised_url,
)
from specserve.control.frontend import (
    AlreadyResumed,
    ClientRequest,
    Frontend,
    Overloaded,
    PromptLimit,
)
from specserve.control.index_sync import IndexSync
from specserve.control.limits import MAX_VOCAB, ServiceLimits, clip
from specserve.control.metrics import ServiceMetrics
from specserve.control.placement import RESUME_HOLD_S, Placement
from specserve.control.router import Router, Routing
from specserve.control.scheduler import Scheduler
from specserve.control.worker_handle import WorkerHandle
from specserve.shared import protocol
from specserve.shared.config import SchedulingPolicy
from specserve.shared.curve import (
    CLIENTS,
    WORKERS,
    PeerKeys,
    ServerKeys,
    is_loopback,
    serve_curve,
    start_authenticator,
)
from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    ErrorReply,
    GenerateRequest,
    Heartbeat,
    Leaving,
    OutputBatch,
    ProtocolError,
    Register,
    Rejected,
    Released,
    RequestOutput,
    Reregister,
    Resume,
    ServiceStatus,
    StatusRequest,
    StepResult,
    Welcome,
    WorkerInfo,
    check_worker_id,
)
from specserve.shared.ready_file import ReadyFile
from specserve.shared.socket_limits import bound_socket
from specserve.shared.tokenizer import load_tokenizer

log = structlog.get_logger(__name__)

TICK_S = 0.1
SHUTDOWN_LINGER_MS = 1000  # how long a stopping control plane keeps delivering final outputs
FRAMES_PER_PASS = 256  # frames handled between two dispatch/tick passes of the loop
HEARTBEAT_SUFFIX = b"#hb"
GC_THRESHOLDS = (50_000, 10, 10)  # `tune_gc`; Python's default is (700, 10, 10)


def default_worker_bind(bind: str) -> str:
    """The worker port next to the client port: `tcp://HOST:PORT` -> `tcp://HOST:PORT+1`
    (port 0, any free port, stays 0)."""
    head, sep, port = bind.rpartition(":")
    if not (bind.startswith("tcp://") and sep and port.isdigit() and int(port) < 65535):
        raise ValueError(f"give --worker-bind: no worker port can be derived from {bind!r}")
    return f"{head}:{int(port) + 1 if int(port) else 0}"  # 0: any free port, for both


@dataclass(frozen=True)
class ControlArgs:
    bind: str = "tcp://*:5555"  # clients
    worker_bind: str | None = None  # workers; None: the client port + 1
    keys: str | None = None  # a `specserve keys generate` directory: CURVE on both ports
    insecure: bool = False  # allow a non-loopback bind without keys
    redis_url: str | None = None  # None: no global index; routing uses the local block pools
    model: str = "smollm2-135m"  # the served model: its tokenizer, and what workers must load
    routing: str = "prefix"  # prefix | round-robin
    heartbeat_timeout_s: float = 3.0
    step_timeout_s: float = 120.0  # a worker that owes a step result this long is removed
    metrics_port: int | None = None
    policy: str = "fcfs"  # fcfs | priority
    hash_algo: str = "sha256"  # sha256 | xxh3_128
    load_weight: float = 1.0  # how much a fully loaded worker outweighs a fully cached prompt
    # What one peer may make the control plane spend (`--max-...`, control/limits.py).
    limits: ServiceLimits = field(default_factory=ServiceLimits)
    ready_file: str | None = None  # exists while at least one worker is registered
    # With several planes on one index: where the others reach this one's client port (None:
    # the bound endpoint, a wildcard host replaced by this host's address), and how many more
    # cached tokens another plane's worker must hold for a request to go there (0: never).
    advertise_url: str | None = None
    forward_min_tokens: int = FORWARD_MIN_TOKENS
    # How long a resumed request waits for the worker the index says holds its KV (moving here
    # after its plane died, or not yet registered again after this plane restarted).
    resume_hold_s: float = RESUME_HOLD_S


class ControlPlane:
    def __init__(self, args: ControlArgs) -> None:
        self.args = args
        self.policy = SchedulingPolicy(args.policy)
        router = Router(Routing(args.routing), args.load_weight)
        if args.heartbeat_timeout_s <= 0 or args.step_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s and step_timeout_s must be > 0")
        if args.resume_hold_s < 0:
            raise ValueError(f"resume_hold_s must be >= 0, got {args.resume_hold_s}")
        if args.forward_min_tokens < 0:
            raise ValueError(f"forward_min_tokens must be >= 0, got {args.forward_min_tokens}")
        tokenizer = load_tokenizer(args.model)
        self.session = uuid.uuid4().hex[:16]
        self.ready = ReadyFile(args.ready_file)
        self.metrics = ServiceMetrics()
        self.workers: dict[str, WorkerHandle] = {}
        self._registrations = itertools.count(1)
        self._reregistered: dict[bytes, float] = {}  # identity -> last Reregister sent
        client = None
        if args.redis_url:
            client = connect(args.redis_url, socket_timeout=0.5, connect_timeout=0.5)
        self.index = IndexSync(client, self.workers, self.metrics, self.session)
        self.placement = Placement(
            self.workers,
            router,
            self.index,
            self.metrics,
            self._forward,
            self._other_planes,
            args.resume_hold_s,
        )
        self.frontend = Frontend(
            tokenizer,
            self.metrics,
            self._send,
            self._withdraw,
            max_pending_per_client=args.limits.max_pending_per_client,
        )
        self._last_tick = 0.0
        worker_bind = args.worker_bind or default_worker_bind(args.bind)
        check_exposure(args.bind, worker_bind, args.keys, args.insecure)
        keys = ServerKeys.load(args.keys) if args.keys else None
        self.authenticated = keys is not None
        # Control planes link to each other with the service's own pair: a frame under this key
        # comes from another plane.
        self.plane_key = keys.pair.public.decode() if keys else None
        # Its own context: the ZAP handler is per context, and tests run several planes.
        self.ctx = zmq.Context()
        self._auth = start_authenticator(self.ctx, keys) if keys else None
        try:
            self.sock = self._router(CLIENTS, keys)
            self.worker_sock = self._router(WORKERS, keys)
            self.endpoint = self._bind(self.sock, args.bind)
            self.worker_endpoint = self._bind(self.worker_sock, worker_bind)
        except Exception:
            self._close_sockets()
            raise
        self.index.control_url = args.advertise_url or advertised_url(self.endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.worker_sock, zmq.POLLIN)
        self.peers: PeerLinks | None = None  # the other planes (forwarding needs the index)
        if client is not None and args.forward_min_tokens > 0:
            peer_keys = PeerKeys(keys.pair.public, keys.pair) if keys else None
            self.peers = PeerLinks(self.ctx, self._poller, peer_keys, args.forward_min_tokens)
        self._owners_at = 0.0  # when the other planes' workers were last read from the index
        self.freeze_gc = False  # `run_control`: a server process freezes long-lived objects
        self._by_identity: dict[bytes, WorkerHandle] = {}  # worker socket identity -> worker
        self._accepted: list[ClientRequest] = []  # accepted this pass, placed at its end
        if args.metrics_port is not None:
            self.metrics.serve(args.metrics_port)
        log.info(
            "control.ready",
            endpoint=self.endpoint,
            worker_endpoint=self.worker_endpoint,
            authenticated=self.authenticated,
            session=self.session,
            model=args.model,
            routing=args.routing,
            redis=bool(client),
            metrics_port=args.metrics_port,
        )

    def _router(self, role: str, keys: ServerKeys | None) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        # No ROUTER_HANDOVER: a peer that names itself after a connected one is turned away
        # instead of taking over its connection.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer raises, not drops
        sock.setsockopt(zmq.LINGER, 0)
        # A larger frame drops its peer; a client that leaves socket_hwm outputs unread is gone.
        bound_socket(sock, self.args.limits.max_message_bytes, self.args.limits.socket_hwm)
        if keys is not None:
            serve_curve(sock, keys.pair, role)
        return sock

    @staticmethod
    def _bind(sock: zmq.Socket, endpoint: str, wait_s: float = 5.0) -> str:
        """Bind, waiting a little for a port a previous instance is still releasing."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                sock.bind(endpoint)
                return sock.getsockopt_string(zmq.LAST_ENDPOINT)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise ValueError(f"cannot bind {endpoint}: {exc}") from None
                time.sleep(0.1)

    def _close_sockets(self) -> None:
        # The client socket lingers, so the final outputs queued by `fail_all` still reach the
        # clients; the worker socket has nothing worth waiting for.
        if getattr(self, "peers", None) is not None:
            self.peers.close()
        if getattr(self, "sock", None) is not None:
            self.sock.close(linger=SHUTDOWN_LINGER_MS)
        if getattr(self, "worker_sock", None) is not None:
            self.worker_sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()

    # --- the loop ---------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                self._poller.poll(timeout=20)
                self._drain()
                now = time.monotonic()
                if now - self._last_tick >= TICK_S:
                    self._last_tick = now
                    self._tick(now)
                self._dispatch_all()
        finally:
            self._shutdown()

    def _drain(self) -> None:
        """Handle the waiting frames, at most FRAMES_PER_PASS per socket: a peer that floods a
        socket must not keep the loop from dispatching steps and checking heartbeats."""
        self._drain_socket(self.worker_sock, self._on_worker_frame)
        self._drain_socket(self.sock, self._on_frame)
        self._drain_peers()
        self._place_accepted()
        # Heartbeats that arrived while client frames were handled count before the heartbeat
        # check that follows: a slow client frame must not make a live worker look dead.
        self._drain_socket(self.worker_sock, self._on_worker_frame)

    def _drain_socket(
        self, sock: zmq.Socket, on_frame: Callable[[bytes, bytes, str], None]
    ) -> None:
        for _ in range(FRAMES_PER_PASS):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:  # a peer speaking something else
                continue
            identity, payload = frames[0].bytes, frames[1].bytes
            # With CURVE, the ZAP handler's user id: the peer's authenticated public key.
            key = frames[1].get("User-Id") if self.authenticated else ""
            try:
                on_frame(identity, payload, key)
            except Exception as exc:  # one frame's failure must never stop the loop
                log.exception(
                    "frame.failed",
                    peer=_peer(identity),
                    error_type=type(exc).__name__,
                    size=len(payload),
                )
                if sock is self.sock:
                    reason = f"internal error ({type(exc).__name__}) while handling this message"
                    self._send(identity, ErrorReply(PROTOCOL_VERSION, reason))

    def _decode(self, identity: bytes, payload: bytes) -> protocol.Message | ProtocolError:
        limits = self.args.limits
        try:
            return protocol.decode(payload, limits.max_nesting_depth, limits.max_frame_objects)
        except ProtocolError as exc:
            log.warning("control.bad_frame", peer=_peer(identity), reason=str(exc))
            return exc

    def _on_frame(self, identity: bytes, payload: bytes, key: str = "") -> None:
        """A frame on the client port: only `generate`, `abort` and `status` are accepted there."""
        msg = self._decode(identity, payload)
        if isinstance(msg, ProtocolError):
            self._send(identity, ErrorReply(PROTOCOL_VERSION, str(msg), msg.request_id))
            return
        try:
            if isinstance(msg, GenerateRequest):
                self._on_generate(identity, msg, key)
            elif isinstance(msg, AbortRequest):
                self.frontend.abort(identity, msg.request_id)
            elif isinstance(msg, StatusRequest):
                self._send(identity, self._status())
            else:
                reason = f"the client port does not accept {type(msg).__name__} messages"
                self._send(identity, ErrorReply(PROTOCOL_VERSION, reason))
        except Exception as exc:  # a bug or an unforeseen input must not stop the service
            log.exception(
                "frame.failed",
                peer=_peer(identity),
                type=type(msg).__name__,
                error_type=type(exc).__name__,
            )
            reason = f"internal error ({type(exc).__name__}): {exc}"
            if isinstance(msg, GenerateRequest):
                self._fail_generate(identity, msg.request_id, reason)
            elif isinstance(msg, AbortRequest):
                self._send(identity, ErrorReply(PROTOCOL_VERSION, reason, msg.request_id))

    def _on_worker_frame(self, identity: bytes, payload: bytes, key: str = "") -> None:
        """A frame on the worker port: registrations, heartbeats, step results and leaving."""
        msg = self._decode(identity, payload)
        if isinstance(msg, ProtocolError):
            return  # never answered: a worker's bad frame is a bug the worker logs can't fix
        if isinstance(msg, Register):
            self._on_register(identity, key, msg)
        elif isinstance(msg, Heartbeat):
            self._on_heartbeat(identity, key, msg)
        elif isinstance(msg, Leaving):
            self._on_leaving(identity, key)
        elif isinstance(msg, StepResult):
            worker = self._by_identity.get(identity)
            try:
                self._on_result(identity, key, msg)
            except Exception as exc:  # its requests move on; the loop goes on
                log.exception("frame.failed", peer=_peer(identity), type="StepResult")
                if worker is not None:
                    worker.failed = f"its step result could not be applied ({exc})"
                    self._remove_worker(worker, worker.failed)
        else:
            log.warning("control.refused", peer=_peer(identity), type=type(msg).__name__)

    def _fail_generate(self, client: bytes, request_id: str, reason: str) -> None:
        """Fail a request whose handling raised: stop it wherever it got to, forget it, and
        tell its client."""
        req = self.frontend.requests.get(request_id)
        if req is None or req.client != client:
            self._send(client, ErrorReply(PROTOCOL_VERSION, reason, request_id))
            return
        try:
            self.placement.withdraw(req)
        finally:
            self.frontend.refuse(req, reason)

    def _send(self, identity: bytes, msg: protocol.Message) -> bool:
        """To a client. False when the peer is gone (ROUTER_MANDATORY makes that an error)."""
        return _send_on(self.sock, identity, msg)

    def _send_worker(self, identity: bytes, msg: protocol.Message) -> bool:
        return _send_on(self.worker_sock, identity, msg)

    # --- workers ----------------------------------------------------------------------------

    def _on_register(self, identity: bytes, key: str, msg: Register) -> None:
        info = msg.info
        old = self.workers.get(info.worker_id) if isinstance(info.worker_id, str) else None
        try:
            check_worker_id(info.worker_id)
            if old is not None and (old.identity, old.key) != (identity, key):
                raise ValueError(
                    f"worker id {info.worker_id!r} is registered by a live worker; a second "
                    "registration under it is refused (give each worker its own --worker-id)"
                )
            # Its claims are bounded before anything is built or stored from them.
            self.args.limits.check_worker(info, self.args.model)
            # Step ids never repeat across registrations, so a late result of an earlier
            # registration can never match a step of this one.
            first_step_id = next(self._registrations) << 32
            scheduler = Scheduler.for_worker(info, self.policy, self.args.hash_algo, first_step_id)
        except ValueError as exc:
            log.warning("worker.rejected", worker=clip(info.worker_id), reason=str(exc))
            self._send_worker(identity, Rejected(PROTOCOL_VERSION, str(exc)))
            return
        if old is not None:  # the same connection registering again: its requests wait for it
            self._remove_worker(old, "re-registered", hold=True)
        adopted = self._adopt_kept(info, msg, scheduler)
        namespace = Namespace.for_cache(key_model_name(info.model), scheduler.kv.config)
        worker = WorkerHandle(
            info,
            scheduler,
            namespace,
            last_seen=time.monotonic(),
            identity=identity,
            key=key,
            token=secrets.token_hex(16),  # its heartbeats' proof; only the worker learns it
        )
        self.workers[info.worker_id] = worker
        self._by_identity[identity] = worker
        self.index.register(worker)
        welcome = Welcome(PROTOCOL_VERSION, info.worker_id, worker.token, worker.epoch)
        self._send_worker(identity, welcome)
        self.metrics.worker_up.labels(info.worker_id).set(1)
        self.metrics.workers.set(len(self.workers))
        log.info(
            "worker.registered",
            worker=info.worker_id,
            device=info.device,
            kv_blocks=info.num_blocks,
            epoch=worker.epoch,
            pid=info.pid,
            key=key or None,
            adopted_blocks=adopted,
        )
        for req in self.placement.take_pending():
            self._place(req)
        self._rebalance(worker, everything=adopted > 0)
        if self.freeze_gc:
            # The new pool's blocks live as long as the worker: the cyclic collector need not
            # walk them at every full collection (4 x 262,144 blocks took 93 ms, a stall of
            # every worker). `_remove_worker` unlinks them, so they are still freed.
            gc.freeze()

    def _adopt_kept(self, info: WorkerInfo, msg: Register, scheduler: Scheduler) -> int:
        """The KV the worker kept from its last control plane (it moved, or this plane
        restarted) becomes its new pool's cached prefixes, so the resumed requests that follow
        hit it instead of computing their prompts again; claims beyond the worker's own limits
        are ignored (logged), never trusted. Returns the blocks adopted."""
        if not msg.kept:
            return 0
        try:
            self.args.limits.check_kept(msg.kept, info)
        except ValueError as exc:
            log.warning("worker.kept_kv_ignored", worker=info.worker_id, reason=str(exc))
            return 0
        return scheduler.kv.adopt(msg.kept)

    def _rebalance(self, joined: WorkerHandle, everything: bool) -> None:
        """A worker joined: the later half of each other worker's queued requests that never
        started there are placed again, so the newcomer takes queued load at once (the router
        may still keep one where its prefix is cached). `everything`: all of them, since the
        newcomer brought KV that requests placed before it came (resumed ones) may hit."""
        requests = self.frontend.requests
        moved = 0
        for other in list(self.workers.values()):
            if other is joined or other.failed:
                continue
            queued = other.scheduler.unstarted_waiting()
            for request_id in queued if everything else queued[len(queued) // 2 :]:
                req = requests.get(request_id)
                if req is None:
                    continue
                # Placement hashed it already (unless that worker caches nothing).
                hashes = other.scheduler.requests[request_id].block_hashes or other.block_hashes(
                    req.prompt_token_ids + req.output_token_ids, req.cache_salt
                )
                other.scheduler.abort_requests([request_id])
                other.forget_routed(hashes)
                req.num_resumptions += 1  # counted once, at its first placement
                req.num_cached_tokens = None  # it has not started: the new placement's hit
                self._place(req)
                moved += req.worker_id != other.worker_id
        if moved:
            log.info("worker.rebalanced", worker=joined.worker_id, requests=moved)

    def _on_heartbeat(self, identity: bytes, key: str, msg: Heartbeat) -> None:
        worker = self.workers.get(msg.worker_id)
        now = time.monotonic()
        if worker is not None:
            # Only the token of its Welcome, from its own key, keeps a worker alive.
            if secrets.compare_digest(msg.session, worker.token) and key == worker.key:
                worker.last_seen = now
            else:
                log.debug("heartbeat.refused", worker=worker.worker_id, peer=_peer(identity))
            return
        if not msg.session:
            return  # still registering
        # A worker this control plane does not know (it restarted, or dropped the worker).
        self._ask_to_reregister(identity.removesuffix(HEARTBEAT_SUFFIX), now)

    def _ask_to_reregister(self, identity: bytes, now: float) -> None:
        """At most one Reregister per worker identity per second: a worker answers each with a
        registration, and a burst of them would churn its scheduler."""
        if now - self._reregistered.get(identity, -math.inf) < 1.0:
            return
        self._reregistered[identity] = now
        self._send_worker(identity, Reregister(PROTOCOL_VERSION, "unknown session; register again"))

    def _on_leaving(self, identity: bytes, key: str) -> None:
        """A worker is stopping: its requests move to other workers once its step in flight
        has come back (so they resume from every token it made), then it is released."""
        worker = self._by_identity.get(identity)
        if worker is None or worker.key != key:
            self._send_worker(identity, Released(PROTOCOL_VERSION))  # nothing of it is here
            return
        log.info("worker.leaving", worker=worker.worker_id, requests=len(worker.scheduler.requests))
        worker.leaving = True
        worker.failed = "it is stopping"
        if worker.outstanding is None:
            self._remove_worker(worker, worker.failed)

    def _on_result(self, identity: bytes, key: str, msg: StepResult) -> None:
        worker = self._by_identity.get(identity)
        if worker is None or worker.key != key:
            self._ask_to_reregister(identity, time.monotonic())
            return
        now = time.monotonic()
        worker.last_seen = now
        step = worker.outstanding
        if step is None or step.batch.step_id != msg.step_id:
            log.warning("worker.stale_result", worker=worker.worker_id, step_id=msg.step_id)
            return
        worker.outstanding = None
        worker.result_at = now
        msg = worker.checked_result(msg)
        updates = worker.scheduler.update_from_output(step, msg)
        self._dispatch(worker)  # keep the worker busy before anything else
        self.frontend.deliver(updates)
        if worker.failed:  # only now: resumption must start from the tokens just delivered
            self._remove_worker(worker, worker.failed)

    def _dispatch_all(self) -> None:
        for worker in list(self.workers.values()):
            if worker.outstanding is None:
                self._dispatch(worker)

    def _dispatch(self, worker: WorkerHandle) -> None:
        scheduler = worker.scheduler
        if worker.outstanding is not None or worker.failed:
            return
        # Turnaround counts only a batch that follows its result at once, not idle time.
        result_at, worker.result_at = worker.result_at, None
        if not scheduler.has_unfinished_requests:
            return
        step = scheduler.schedule()
        self.index.write(worker)
        early = scheduler.take_early_updates()
        if early:
            self.frontend.deliver(early)
        batch = step.batch
        if not (step.num_scheduled_tokens or batch.finished or batch.preempted):
            return
        if not self._send_worker(worker.identity, batch):
            worker.failed = "unreachable"  # removed at the next safe point (see _on_result)
            return
        worker.outstanding = step
        worker.sent_at = time.monotonic()
        if result_at is not None:
            self.metrics.step_gap.observe(time.monotonic() - result_at)

    def _remove_worker(self, worker: WorkerHandle, reason: str, hold: bool = False) -> None:
        """Drop a dead (or replaced) worker and resume its requests elsewhere (`hold`: held
        for its next registration, which follows at once)."""
        if self.workers.get(worker.worker_id) is not worker:
            return
        del self.workers[worker.worker_id]
        self._by_identity.pop(worker.identity, None)
        self.metrics.worker_up.labels(worker.worker_id).set(0)
        self.metrics.workers.set(len(self.workers))
        self.index.remove(worker)
        requests = self.frontend.requests
        orphans = [rid for rid in worker.scheduler.requests if rid in requests]
        log.warning("worker.removed", worker=worker.worker_id, reason=reason, resumed=len(orphans))
        for request_id in orphans:
            req = requests[request_id]
            req.num_resumptions += 1
            self.metrics.resumed.inc()
            if hold:
                self.placement.hold(req)
            else:
                self._place(req)
        if worker.leaving:
            self._send_worker(worker.identity, Released(PROTOCOL_VERSION))
        worker.scheduler.kv.pool.release()

    # --- clients ----------------------------------------------------------------------------

    def _on_generate(self, client: bytes, msg: GenerateRequest, key: str = "") -> None:
        # A plane forwarding a request names the client it serves: that client may resume it
        # here. Anyone else's `origin_key` is ignored.
        via_plane = msg.forwarded and key == self.plane_key  # (None without authentication)
        try:
            req = self.frontend.accept(
                client,
                msg,
                self._vocab_size(),
                self._eos_token_ids(),
                self._prompt_limit(),
                msg.origin_key if via_plane else key,
                via_plane,
            )
        except AlreadyResumed:
            log.debug("request.resent", request_id=msg.request_id)
            return
        except ValueError as exc:
            code = "overloaded" if isinstance(exc, Overloaded) else "invalid"
            self.frontend.reject(client, msg.request_id, str(exc), code)
            return
        self._accepted.append(req)  # placed with the rest of this pass (`_place_accepted`)

    def _status(self) -> ServiceStatus:
        lens = [w.info.max_model_len for w in self.workers.values()]
        return ServiceStatus(
            PROTOCOL_VERSION,
            model=self.args.model,
            live_workers=len(self.workers),
            peer_workers=self.peers.reachable_workers() if self.peers is not None else 0,
            max_model_len=min(lens, default=None),
            requests_in_flight=len(self.frontend.requests),
        )

    def _vocab_size(self) -> int:
        """The served model's vocabulary size; until a worker tells it, the largest allowed."""
        return min((w.info.vocab_size for w in self.workers.values()), default=MAX_VOCAB)

    def _prompt_limit(self) -> PromptLimit:
        """The most prompt tokens any current worker can take, and within the service's limit."""
        limit = PromptLimit(self.args.limits.max_prompt_tokens, "--max-prompt-tokens")
        for worker in self.workers.values():
            n = worker.info.max_model_len
            if n - 1 < limit.tokens:
                limit = PromptLimit(n - 1, f"max_model_len {n}, one position kept for output")
        return limit

    def _eos_token_ids(self) -> tuple[int, ...]:
        for worker in self.workers.values():
            return tuple(worker.info.eos_token_ids)
        return ()

    # --- placing requests on workers --------------------------------------------------------

    def _place(self, req: ClientRequest) -> None:
        try:
            self.placement.place(req)
        except ValueError as exc:
            self.frontend.refuse(req, str(exc))

    def _place_accepted(self) -> None:
        """Place the requests accepted in this pass of the loop, with one index round trip."""
        accepted, self._accepted = self._accepted, []
        requests = self.frontend.requests
        live = [req for req in accepted if requests.get(req.request_id) is req]  # not aborted
        self._place_burst(live)

    def _place_burst(self, reqs: list[ClientRequest]) -> None:
        """Place `reqs` with one index round trip; refuse those no worker can serve."""
        for req, exc in self.placement.place_many(reqs):
            if isinstance(exc, ValueError):
                self.frontend.refuse(req, str(exc))
                continue
            log.error(  # a bug: that request fails alone, the burst and the loop go on
                "request.place_failed",
                request_id=req.request_id,
                error_type=type(exc).__name__,
                exc_info=exc,
            )
            self._fail_generate(
                req.client, req.request_id, f"internal error ({type(exc).__name__}): {exc}"
            )

    # --- other control planes (forwarding.py) ----------------------------------------------

    def _forward(self, req: ClientRequest, away: dict[str, int], here: int) -> bool:
        """Send `req` to the plane whose worker holds enough more of its tokens than any worker
        here; its outputs are relayed (`_on_peer_frame`). False: it is placed here.

        Where no worker here is live, to any plane with a live worker, whatever it caches: a
        request under way (its worker died) goes on there from what its client has (`Resume`,
        as a client's own resume would), or, not streamed, starts over there (its client has
        nothing yet)."""
        if self.peers is None or req.stays:
            return False
        stranded = not self.placement.has_live_worker()
        under_way = req.resumed or req.sent_first or bool(req.output_token_ids)
        prompt_logprobs = req.sampling.prompt_logprobs is not None  # computed in full anyway
        if under_way and (not stranded or prompt_logprobs):
            return False  # waits for a worker here (or for the one holding its KV)
        target = None if under_way or prompt_logprobs else self.peers.target(away, here)
        if target is None and stranded:  # served elsewhere now rather than here later
            target = self.peers.any_target()
        if target is None:
            return False
        resume = None
        if under_way and req.stream:
            resume = Resume(list(req.output_token_ids), req.sent_chars)
        msg = GenerateRequest(
            PROTOCOL_VERSION,
            req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
            stream=req.stream,
            cache_salt=req.cache_salt,
            priority=req.priority,
            resume=resume,
            forwarded=True,
            origin_key=req.client_key,
        )
        if not self.peers.send(target.url, msg):
            return False
        if under_way and not req.stream:
            self.frontend.start_over(req)  # the peer serves it from its prompt
        self.peers.links[target.url].requests.add(req.request_id)
        req.forwarded_to, req.worker_id = target.url, None
        self.metrics.forwarded.inc()
        log.info(
            "request.forwarded",
            request_id=req.request_id,
            peer=target.url,
            worker=target.worker_id,
            cached_tokens=target.cached_tokens,
            here=here,
            no_live_worker_here=stranded,
            under_way=under_way,
        )
        return True

    def _other_planes(self) -> bool:
        """Whether another plane's workers could take a request from here (forwarding is on
        and the index names some)."""
        return self.peers is not None and bool(self.peers.owners)

    def _withdraw(self, req: ClientRequest) -> None:
        """Stop serving `req` (its client aborted or left): on the plane it was forwarded to,
        or here."""
        if req.forwarded_to is not None and self.peers is not None:
            self.peers.send(req.forwarded_to, AbortRequest(PROTOCOL_VERSION, req.request_id))
            self.peers.done(req.forwarded_to, req.request_id)
            req.forwarded_to = None
            return
        self.placement.withdraw(req)

    def _drain_peers(self) -> None:
        if self.peers is None:
            return
        for link in list(self.peers.links.values()):
            for _ in range(FRAMES_PER_PASS):
                try:
                    payload = link.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    self._on_peer_frame(link.url, payload)
                except Exception:  # one frame's failure must never stop the loop
                    log.exception("frame.failed", peer=link.url)

    def _on_peer_frame(self, url: str, payload: bytes) -> None:
        """An answer from a plane requests were forwarded to: an output to relay, or a refusal
        (the request is then served here)."""
        msg = self._decode(url.encode(), payload)
        for reply in msg.outputs if isinstance(msg, OutputBatch) else [msg]:
            self._on_peer_reply(url, reply)

    def _on_peer_reply(self, url: str, msg: protocol.Message | ProtocolError) -> None:
        request_id = getattr(msg, "request_id", None)
        req = self.frontend.requests.get(request_id) if isinstance(request_id, str) else None
        if req is None or req.forwarded_to != url:
            return  # finished, aborted or taken back already
        if isinstance(msg, RequestOutput) and not msg.resumable:
            if msg.finished and self.peers is not None:
                self.peers.done(url, req.request_id)
            self.frontend.relay(req, msg)
        elif isinstance(msg, ErrorReply) and not self.placement.has_live_worker():
            self._refused_by_peer(req, msg)
        elif isinstance(msg, RequestOutput | ErrorReply):
            self._serve_here(req, msg.error if isinstance(msg, RequestOutput) else msg.message)

    def _refused_by_peer(self, req: ClientRequest, msg: ErrorReply) -> None:
        """A plane with no live worker of its own had `req` refused by the plane it forwarded
        it to: for what the request is ("invalid"), its client is told, since nothing here
        could serve it either; for now ("overloaded"), it is held and forwarded again at the
        next look at the other planes (or served by a worker here, if one comes first)."""
        assert req.forwarded_to is not None and self.peers is not None
        self.peers.done(req.forwarded_to, req.request_id)
        log.warning("request.refused_by_peer", request_id=req.request_id, peer=req.forwarded_to,
                    code=msg.code, why=msg.message)  # fmt: skip
        req.forwarded_to = None
        if msg.code == "invalid":
            self.frontend.refuse(req, msg.message)
            return
        if req.output_token_ids:
            self.frontend.continue_from(req, req.sent_chars)
        self.placement.hold(req)

    def _serve_here(self, req: ClientRequest, why: str | None) -> None:
        """Take back a forwarded request whose plane refused it, stopped or died: it goes on
        here from what its client already has."""
        assert req.forwarded_to is not None and self.peers is not None
        self.peers.done(req.forwarded_to, req.request_id)
        log.warning("request.taken_back", request_id=req.request_id, peer=req.forwarded_to, why=why)
        req.forwarded_to, req.stays = None, True  # never sent back and forth
        if req.output_token_ids:
            self.frontend.continue_from(req, req.sent_chars)
        self._place(req)

    def _peers_tick(self, now: float) -> None:
        """Follow the other planes' workers in the index; take back what was forwarded to a
        plane whose connection dropped."""
        if self.peers is None:
            return
        if now - self._owners_at >= OWNERS_REFRESH_S:
            self._owners_at = now
            owners = self.index.other_planes_workers()
            if owners is not None:
                self.peers.set_owners(owners)
            waiting = self.placement.pending and not self.placement.has_live_worker()
            if waiting and self.peers.reachable_workers():
                self._place_burst(self.placement.take_pending())  # forwarded now, if they can be
        for link in self.peers.lost():
            for request_id in list(link.requests):
                req = self.frontend.requests.get(request_id)
                if req is not None and req.forwarded_to == link.url:
                    self._serve_here(req, "its control plane's connection dropped")
            link.requests.clear()

    # --- periodic work ----------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        timeout, step_timeout = self.args.heartbeat_timeout_s, self.args.step_timeout_s
        for worker in list(self.workers.values()):
            if worker.failed:
                self._remove_worker(worker, worker.failed)
            elif now - worker.last_seen > timeout:
                self._remove_worker(worker, f"no heartbeat for {now - worker.last_seen:.1f}s")
            elif worker.outstanding is not None and now - worker.sent_at > step_timeout:
                # Alive (it heartbeats) but stuck, e.g. a hung device: its requests move on.
                self._remove_worker(worker, f"no step result for {now - worker.sent_at:.0f}s")
        self.index.tick(now)
        self._peers_tick(now)
        for req in self.placement.expired_holds(now):
            self._place(req)
        self.ready.set(bool(self.workers))
        if len(self._reregistered) > 1024:
            self._reregistered = {k: t for k, t in self._reregistered.items() if now - t < 60}
        for worker in self.workers.values():
            s = worker.scheduler
            self.metrics.queue_depth.labels(worker.worker_id).set(len(s.waiting))
            self.metrics.running.labels(worker.worker_id).set(len(s.running))
            self.metrics.kv_usage.labels(worker.worker_id).set(s.kv.usage())

    def _shutdown(self) -> None:
        self.ready.set(False)
        self.frontend.fail_all("the control plane is shutting down")
        self._close_sockets()
        log.info("control.stopped")


def check_exposure(bind: str, worker_bind: str, keys: str | None, insecure: bool) -> None:
    """Refuse to listen beyond this machine without keys, unless told to (`--insecure`):
    anyone who reaches an unauthenticated worker port can register as a worker and read every
    prompt routed to it."""
    exposed = [e for e in (bind, worker_bind) if not is_loopback(e)]
    if exposed and keys is None and not insecure:
        raise ValueError(
            f"refusing to listen on {exposed[0]} without keys: anyone who can reach it could act "
            "as a worker (and read prompts) or as a client. Make keys with `specserve keys "
            "generate DIR` and pass --keys DIR, bind a loopback address, or pass --insecure on "
            "a network only trusted peers reach"
        )


def _send_on(sock: zmq.Socket, identity: bytes, msg: protocol.Message) -> bool:
    try:
        sock.send_multipart([identity, protocol.encode(msg)], zmq.NOBLOCK)
        return True
    except zmq.ZMQError:
        return False


def _peer(identity: bytes) -> str:
    return identity.decode(errors="replace")


def tune_gc() -> None:
    """The garbage collector settings of a control plane process. Young collections come every
    GC_THRESHOLDS[0] allocations instead of Python's 700: admitting a request allocates a few
    dozen objects that live until it finishes, and collections walking them cost admissions
    about 10% (`bench/service.py`'s admission rate). What is alive now (the tokenizer, the
    model's metadata) is frozen out of full collections."""
    gc.set_threshold(*GC_THRESHOLDS)
    gc.freeze()


def run_control(args: ControlArgs, stop: threading.Event | None = None) -> int:
    """Serve until SIGINT/SIGTERM (or `stop` is set); 0 on a clean stop."""
    stop = stop or threading.Event()
    plane = ControlPlane(args)
    plane.freeze_gc = True
    tune_gc()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    plane.run(stop)
    return 0
