"""A real worker process over real sockets; the test plays the control plane with a ROUTER.

One module-scoped worker serves the conversation tests (registration, heartbeats, scheduler-driven
steps against the in-process engine, bad frames, failed batches, re-registration); the exit-code
tests each start their own.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import zmq

from specserve.control.request import Request
from specserve.control.scheduler import Scheduler
from specserve.in_process import InProcessEngine
from specserve.shared import protocol
from specserve.shared.config import AttentionType, KVGroupSpec
from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    Heartbeat,
    KeptRequest,
    Leaving,
    NewRequest,
    Register,
    Released,
    RequestResult,
    RunningDelta,
    SamplingParams,
    StepBatch,
    StepResult,
    Welcome,
)
from specserve.worker.engine import EngineArgs
from specserve.worker.worker_process import run_worker

WORKER_ID = "w-test"
HB_SUFFIX = b"#hb"
HEARTBEAT_S = 0.1
STARTUP_S = 60.0  # interpreter, torch import and model load, on a busy host
REPLY_S = 10.0
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

WORKER_MAIN = """
import sys
from specserve.shared.logging import configure_logging
from specserve.worker.engine import EngineArgs
from specserve.worker.worker_process import run_worker
configure_logging("debug")
args = EngineArgs(model=sys.argv[1], num_blocks=64, block_size=4, max_model_len=256)
ready = sys.argv[5] if len(sys.argv) > 5 else None
sys.exit(run_worker(args, sys.argv[2], sys.argv[3], heartbeat_interval_s=float(sys.argv[4]),
                    ready_file=ready))
"""


def engine_args(path: Path) -> EngineArgs:
    return EngineArgs(model=str(path), num_blocks=64, block_size=4, max_model_len=256)


class FakeControl:
    """The control plane's ROUTER, bound on a free port. Heartbeats are set aside as they come."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a stranger raises
        self.sock.bind("tcp://127.0.0.1:*")
        self.url = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.heartbeats: list[Heartbeat] = []
        # The worker's connection, `<worker id>#<nonce>` (new in each worker process); its
        # heartbeat socket is that and "#hb".
        self.identity = b""

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def send(self, msg: protocol.Message | bytes) -> None:
        frame = msg if isinstance(msg, bytes) else protocol.encode(msg)
        self.sock.send_multipart([self.identity, frame])

    def _pump(self, deadline: float) -> protocol.Message | None:
        """Receive one frame; a worker-socket message is returned, a heartbeat is stored."""
        if not self.sock.poll(max(deadline - time.monotonic(), 0) * 1e3):
            return None
        identity, frame = self.sock.recv_multipart()
        msg = protocol.decode(frame)
        if identity.endswith(HB_SUFFIX):
            assert identity.startswith(WORKER_ID.encode() + b"#"), identity
            assert isinstance(msg, Heartbeat), msg
            self.heartbeats.append(msg)
            return None
        assert re.fullmatch(re.escape(WORKER_ID.encode()) + rb"#[0-9a-f]{8}", identity), identity
        self.identity = identity
        return msg

    def recv(self, timeout_s: float = REPLY_S) -> protocol.Message:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self._pump(deadline)
            if msg is not None:
                return msg
        raise TimeoutError(f"no message from the worker in {timeout_s} s")

    def wait_heartbeats(self, n: int, timeout_s: float = REPLY_S) -> list[Heartbeat]:
        """Discard what came so far, then collect the next `n` heartbeats."""
        self.heartbeats.clear()
        deadline = time.monotonic() + timeout_s
        while len(self.heartbeats) < n and time.monotonic() < deadline:
            msg = self._pump(deadline)
            assert msg is None, f"unexpected {msg!r} while waiting for heartbeats"
        assert len(self.heartbeats) >= n, f"{len(self.heartbeats)} heartbeats in {timeout_s} s"
        return self.heartbeats[:n]

    def step(self, batch: StepBatch) -> StepResult:
        self.send(batch)
        result = self.recv()
        assert isinstance(result, StepResult), result
        assert result.step_id == batch.step_id
        return result


@dataclass
class WorkerProcess:
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout_s: float = REPLY_S) -> str:
        """Some lines are written just after the reply they follow, so poll briefly."""
        deadline = time.monotonic() + timeout_s
        while text not in (log := self.log()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert text in log, f"{text!r} not logged within {timeout_s} s"
        return log

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        print(f"--- worker log ---\n{self.log()[-8000:]}")  # shown when a test fails


def start_worker(
    ckpt_path: Path, url: str, log_path: Path, ready_file: Path | None = None
) -> WorkerProcess:
    cmd = [sys.executable, "-c", WORKER_MAIN, str(ckpt_path), url, WORKER_ID, str(HEARTBEAT_S)]
    cmd += [] if ready_file is None else [str(ready_file)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return WorkerProcess(proc, log_path)


@dataclass
class Live:
    """A registered worker process and the state of the conversation with it."""

    control: FakeControl
    worker: WorkerProcess
    before_welcome: list[protocol.Message]
    heartbeats_before_welcome: int
    session: str

    @property
    def info(self) -> protocol.WorkerInfo:
        first = self.before_welcome[0]
        assert isinstance(first, Register)
        return first.info

    def welcome(self, session: str) -> None:
        self.control.send(Welcome(PROTOCOL_VERSION, WORKER_ID, session, epoch=7))
        self.session = session


@pytest.fixture
def control() -> Iterator[FakeControl]:
    ctl = FakeControl()
    try:
        yield ctl
    finally:
        ctl.close()


def _spawn(
    ckpt_path: Path, control: FakeControl, log_path: Path
) -> tuple[WorkerProcess, list[protocol.Message]]:
    """Start a worker and return it with everything it sent up to its first Register."""
    worker = start_worker(ckpt_path, control.url, log_path)
    try:
        first = control.recv(STARTUP_S)
    except BaseException:
        worker.kill()
        raise
    return worker, [first]


@pytest.fixture(scope="module")
def live(llama_ckpt, tmp_path_factory) -> Iterator[Live]:
    ctl = FakeControl()
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    worker, sent = _spawn(llama_ckpt.path, ctl, log_path)
    try:
        state = Live(ctl, worker, sent, len(ctl.heartbeats), session="")
        state.welcome("session-1")
        yield state
    finally:
        worker.kill()
        ctl.close()


def make_requests(lengths: list[int], seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(f"r{i}", [rng.randrange(256) for _ in range(n)], GREEDY)
        for i, n in enumerate(lengths)
    ]


def drive(control: FakeControl, scheduler: Scheduler) -> dict[str, list[int]]:
    """Serve every request in `scheduler` through the worker, as the control plane would."""
    tokens: dict[str, list[int]] = {rid: [] for rid in scheduler.requests}
    for _ in range(200):
        step = scheduler.schedule()
        batch = step.batch
        if not (step.total_tokens or batch.finished or batch.preempted):
            break
        for update in scheduler.update_from_output(step, control.step(batch)):
            assert update.error is None, update.error
            tokens[update.request_id] += update.new_token_ids
    assert not scheduler.has_unfinished_requests
    return tokens


def in_process_tokens(ckpt_path: Path, requests: list[Request]) -> dict[str, list[int]]:
    engine = InProcessEngine(engine_args(ckpt_path))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        for update in engine.step():
            tokens[update.request_id] += update.new_token_ids
    return tokens


# --- the conversation with one long-lived worker ---------------------------------------------


def test_first_frame_is_register_with_the_engine_info(live, llama_ckpt):
    assert len(live.before_welcome) == 1
    info = live.info
    assert info.worker_id == WORKER_ID
    assert info.num_blocks == 64
    assert info.kv_groups == [KVGroupSpec(AttentionType.FULL, 4)]
    assert info.vocab_size == 256
    assert info.max_model_len == 256
    assert info.pid == live.worker.proc.pid
    expected = InProcessEngine(engine_args(llama_ckpt.path)).worker.info(WORKER_ID)
    assert msgspec.structs.replace(info, pid=0) == msgspec.structs.replace(expected, pid=0)
    assert live.heartbeats_before_welcome == 0  # not registered yet: nothing to keep alive


def test_heartbeats_come_from_their_own_socket_with_the_session(live):
    beats = live.control.wait_heartbeats(3, timeout_s=3.0)
    assert beats == [Heartbeat(PROTOCOL_VERSION, WORKER_ID, live.session)] * 3
    assert "worker.registered" in live.worker.log()


def test_greedy_tokens_match_the_in_process_engine(live, llama_ckpt):
    scheduler = Scheduler.for_worker(live.info)
    for request in make_requests([5, 11, 17], seed=0):
        scheduler.add_request(request)
    remote = drive(live.control, scheduler)
    local = in_process_tokens(llama_ckpt.path, make_requests([5, 11, 17], seed=0))
    assert remote == local
    assert sorted(remote) == ["r0", "r1", "r2"]
    assert all(len(t) == 8 for t in remote.values())


def test_bad_frames_are_logged_and_skipped(live, llama_ckpt):
    live.control.send(b"\x00garbage")
    live.control.send(StepBatch(version=99, step_id=1))
    live.control.send(Heartbeat(PROTOCOL_VERSION, "other", "s"))  # valid, but not for a worker
    scheduler = Scheduler.for_worker(live.info)
    (request,) = make_requests([9], seed=3)
    scheduler.add_request(request)
    assert drive(live.control, scheduler) == in_process_tokens(
        llama_ckpt.path, make_requests([9], seed=3)
    )
    assert live.worker.proc.poll() is None
    log = live.worker.log()
    assert "malformed frame (8 bytes): not a specserve message" in log
    assert "unsupported protocol version 99; this side speaks version 1" in log
    assert "unexpected Heartbeat message for a worker" in log


def test_a_batch_that_raises_fails_every_request_in_it(live, llama_ckpt):
    def new(handle: int, block: int) -> NewRequest:
        return NewRequest(handle, f"h{handle}", [1, 2, 3], 3, GREEDY, [[block]], 0, 3)

    # A block id past the 64-block cache raises inside the forward pass, for the whole batch.
    batch = StepBatch(
        PROTOCOL_VERSION,
        1,
        new_requests=[new(500, 0), new(501, 10_000)],
        running=[RunningDelta(502, 0, 1)],
    )
    with pytest.raises(Exception) as raised:  # the same batch on an in-process engine
        InProcessEngine(engine_args(llama_ckpt.path)).worker.execute(batch)
    error = str(raised.value)
    assert error
    result = live.control.step(batch)
    assert result.results == [RequestResult(h, [], error=error) for h in (500, 501, 502)]
    live.worker.wait_for_log("worker.step_failed")
    # Dropping the failed requests leaves a worker that still serves exact tokens.
    assert live.control.step(StepBatch(PROTOCOL_VERSION, 2, finished=[500, 501])).results == []
    scheduler = Scheduler.for_worker(live.info)
    scheduler.add_request(make_requests([6], seed=4)[0])
    assert drive(live.control, scheduler) == in_process_tokens(
        llama_ckpt.path, make_requests([6], seed=4)
    )


def test_reregister_and_a_new_welcome_reset_request_state(live):
    scheduler = Scheduler.for_worker(live.info)
    (request,) = make_requests([7], seed=5)
    scheduler.add_request(request)
    first = scheduler.schedule()  # the whole prompt: the worker now holds the request
    (sampled,) = scheduler.update_from_output(first, live.control.step(first.batch))
    assert len(sampled.new_token_ids) == 1

    live.control.send(protocol.Reregister(PROTOCOL_VERSION, "control plane restarted"))
    again = live.control.recv()
    # It offers the KV it computed: 7 prompt tokens fill one 4-token block.
    (table,) = scheduler.kv.block_ids(request)
    kept = KeptRequest(request.prompt_token_ids[:4], [table[:1]])
    assert again == Register(PROTOCOL_VERSION, live.info, [kept])
    live.welcome("session-2")

    second = scheduler.schedule()
    handle = request.handle
    assert [d.handle for d in second.batch.running] == [handle]
    assert isinstance(second.batch.running[0], RunningDelta)
    result = live.control.step(second.batch)
    # ModelRunner.execute answers a delta for a handle it does not hold with this error.
    error = f"unknown request handle {handle}"
    assert result.results == [RequestResult(handle, [], error=error)]
    (update,) = scheduler.update_from_output(second, result)
    assert (update.finished, update.error) == (True, error)
    beats = live.control.wait_heartbeats(2, timeout_s=3.0)
    assert {b.session for b in beats} == {"session-2"}


def test_a_reregister_burst_sends_one_register(live, llama_ckpt):
    # The control plane answers each heartbeat it cannot place with a Reregister: five queue up.
    for _ in range(5):
        live.control.send(protocol.Reregister(PROTOCOL_VERSION, "unknown worker"))
    assert live.control.recv() == Register(PROTOCOL_VERSION, live.info)
    # Nothing more before the Welcome; the window stays under the 2 s periodic Register retry.
    deadline = time.monotonic() + 1.0
    extra = []
    while time.monotonic() < deadline:
        msg = live.control._pump(deadline)
        if msg is not None:
            extra.append(msg)
    assert extra == []
    live.welcome("session-3")

    scheduler = Scheduler.for_worker(live.info)
    for request in make_requests([4, 10], seed=6):
        scheduler.add_request(request)
    assert drive(live.control, scheduler) == in_process_tokens(
        llama_ckpt.path, make_requests([4, 10], seed=6)
    )
    beats = live.control.wait_heartbeats(2, timeout_s=3.0)
    assert {b.session for b in beats} == {"session-3"}


# --- exits --------------------------------------------------------------------------------------


def test_rejected_exits_with_code_3(llama_ckpt, control, tmp_path):
    worker, sent = _spawn(llama_ckpt.path, control, tmp_path / "worker.log")
    try:
        assert isinstance(sent[0], Register)
        control.send(protocol.Rejected(PROTOCOL_VERSION, "serving a different model"))
        assert worker.proc.wait(REPLY_S) == 3
        assert "serving a different model" in worker.log()
    finally:
        worker.kill()


def test_sigterm_drains_then_exits_0_once_released(llama_ckpt, control, tmp_path):
    """SIGTERM: the worker asks to leave and keeps serving until the control plane releases it;
    then it exits 0 at once."""
    worker, sent = _spawn(llama_ckpt.path, control, tmp_path / "worker.log")
    try:
        assert isinstance(sent[0], Register)
        control.send(Welcome(PROTOCOL_VERSION, WORKER_ID, "s", 0))
        control.wait_heartbeats(1)  # both threads are up
        worker.proc.send_signal(signal.SIGTERM)
        assert control.recv() == Leaving(PROTOCOL_VERSION, WORKER_ID)
        time.sleep(0.5)
        assert worker.proc.poll() is None  # still serving: not released yet
        start = time.monotonic()
        control.send(Released(PROTOCOL_VERSION))
        assert worker.proc.wait(5.0) == 0
        assert time.monotonic() - start < 5.0
        assert "worker.released" in worker.log() and "worker.stopped" in worker.log()
    finally:
        worker.kill()


def test_the_ready_file_exists_while_registered_and_not_draining(llama_ckpt, control, tmp_path):
    ready = tmp_path / "ready"
    worker = start_worker(llama_ckpt.path, control.url, tmp_path / "worker.log", ready)
    try:
        assert isinstance(control.recv(STARTUP_S), Register)
        assert not ready.exists()  # loaded and registering: not serving yet
        control.send(Welcome(PROTOCOL_VERSION, WORKER_ID, "s", 0))
        control.wait_heartbeats(1)
        assert ready.exists()
        worker.proc.send_signal(signal.SIGTERM)
        assert isinstance(control.recv(), Leaving)
        assert not ready.exists()  # draining: out of rotation at once
        control.send(Released(PROTOCOL_VERSION))
        assert worker.proc.wait(5.0) == 0
        assert not ready.exists()
    finally:
        worker.kill()


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_sigterm_or_sigint_stops_a_draining_worker_at_once(
    llama_ckpt, control, tmp_path, second
):
    worker, _ = _spawn(llama_ckpt.path, control, tmp_path / "worker.log")
    try:
        control.send(Welcome(PROTOCOL_VERSION, WORKER_ID, "s", 0))
        control.wait_heartbeats(1)
        worker.proc.send_signal(signal.SIGTERM)
        assert isinstance(control.recv(), Leaving)  # never answered
        start = time.monotonic()
        worker.proc.send_signal(second)
        assert worker.proc.wait(5.0) == 0
        assert time.monotonic() - start < 5.0
    finally:
        worker.kill()


def test_sigterm_before_registration_exits_0_promptly(llama_ckpt, control, tmp_path):
    worker, sent = _spawn(llama_ckpt.path, control, tmp_path / "worker.log")
    try:
        assert isinstance(sent[0], Register)  # never welcomed: nothing to hand over
        start = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(5.0) == 0
        assert time.monotonic() - start < 5.0
    finally:
        worker.kill()


# --- in process ---------------------------------------------------------------------------------


def test_a_bad_worker_id_fails_before_loading_anything():
    with pytest.raises(ValueError, match=r"must be 1-64 characters from \[A-Za-z0-9._-\]"):
        run_worker(EngineArgs(model="/no/such/model"), "tcp://127.0.0.1:1", "bad id")
    with pytest.raises(ValueError, match="must be 1-64"):
        run_worker(EngineArgs(model="/no/such/model"), "tcp://127.0.0.1:1", "x" * 65)


def test_stop_event_leaves_the_loop_in_a_thread(llama_ckpt, control):
    stop = threading.Event()
    codes: list[int] = []
    args = engine_args(llama_ckpt.path)
    thread = threading.Thread(
        target=lambda: codes.append(run_worker(args, control.url, WORKER_ID, 0.05, stop))
    )
    thread.start()
    try:
        assert isinstance(control.recv(STARTUP_S), Register)
        control.send(Welcome(PROTOCOL_VERSION, WORKER_ID, "s", 0))
        control.wait_heartbeats(1)
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    assert codes == [0]


def test_what_loading_left_alive_is_out_of_the_collectors_full_passes(llama_ckpt):
    """A full collection walks every tracked object: 156 ms over the bundled model's ~350,000,
    a stall of one of the first steps. The loaded engine's objects are frozen out of it."""
    import gc

    from specserve.worker.worker_process import _load_engine

    gc.unfreeze()
    try:
        engine = _load_engine(engine_args(llama_ckpt.path), "w-gc")
        model = engine.runner.model
        assert gc.get_freeze_count() > 0
        assert not any(obj is model for obj in gc.get_objects())
    finally:
        gc.unfreeze()
