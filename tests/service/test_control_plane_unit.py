"""The control plane's decisions in hard interleavings, driven message by message.

`RecordingPlane` is a test double for the socket side only: the real `ControlPlane` (real
scheduler, router, frontend, index code) runs, but what it would send is recorded, and a peer
can be marked unreachable. Workers are played by answering the recorded step batches.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from specserve.control import control_plane, forwarding, placement
from specserve.control.control_plane import ControlArgs, ControlPlane
from specserve.control.limits import ServiceLimits
from specserve.launch.local_redis import LocalRedis, RedisNotFound
from specserve.shared.config import AttentionType, KVGroupSpec
from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    ErrorReply,
    GenerateRequest,
    Heartbeat,
    KeptRequest,
    NewRequest,
    OutputBatch,
    Register,
    Rejected,
    RequestOutput,
    RequestResult,
    Reregister,
    Resume,
    SamplingParams,
    StepBatch,
    StepResult,
    WorkerInfo,
    encode,
)

P = PROTOCOL_VERSION


def _info(worker_id: str, **fields) -> WorkerInfo:
    values = dict(
        worker_id=worker_id, model="unset", device="cpu",
        kv_groups=[KVGroupSpec(AttentionType.FULL, 4)], num_blocks=64, max_model_len=256,
        vocab_size=256, eos_token_ids=[], max_num_batched_tokens=512, max_num_seqs=16,
    )  # fmt: skip
    return WorkerInfo(**{**values, **fields})


class RecordingPlane(ControlPlane):
    def __init__(self, model: str, **kwargs) -> None:
        super().__init__(ControlArgs(bind="tcp://127.0.0.1:0", model=model, **kwargs))
        self.sent: list[tuple[bytes, object]] = []
        self.unreachable: set[bytes] = set()

    def _send(self, identity: bytes, msg) -> bool:
        if identity in self.unreachable:
            return False
        self.sent.append((identity, msg))
        return True

    _send_worker = _send  # worker connections are named after their worker id here

    def register(self, worker_id: str, **fields) -> None:
        info = _info(worker_id, **{"model": self.args.model, **fields})
        self._on_register(worker_id.encode(), "", Register(P, info))

    def generate(self, request_id: str, prompt: list[int], client: bytes = b"c1", **sampling):
        params = SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **sampling})
        self._on_generate(client, GenerateRequest(P, request_id, prompt_token_ids=prompt,
                                                  sampling=params))  # fmt: skip
        self._place_accepted()  # as the loop does after each pass

    def batches(self, worker_id: str) -> list[StepBatch]:
        wid = worker_id.encode()
        return [m for i, m in self.sent if i == wid and isinstance(m, StepBatch)]

    def outputs(self, client: bytes = b"c1") -> list:
        """What `client` was sent, a step's batched outputs one by one."""
        sent = [m for i, m in self.sent if i == client]
        return [
            m
            for msg in sent
            for m in (msg.outputs if isinstance(msg, OutputBatch) else [msg])
            if isinstance(m, RequestOutput | ErrorReply)
        ]

    def answer(self, worker_id: str, batch: StepBatch, token: int) -> None:
        """One token for every request that reaches the end of its known tokens."""
        results = []
        for new in batch.new_requests:
            done = new.num_computed_tokens + new.num_scheduled_tokens >= len(new.token_ids)
            results.append(RequestResult(new.handle, [token] if done else []))
        results += [RequestResult(d.handle, [token]) for d in batch.running]
        self._on_result(worker_id.encode(), "", StepResult(P, batch.step_id, results))


@pytest.fixture
def plane(llama_ckpt):
    p = RecordingPlane(str(llama_ckpt.path))
    yield p
    p._close_sockets()


@pytest.fixture
def redis_planes(llama_ckpt, tmp_path: Path):
    """`make()` a RecordingPlane on a private Redis index (the test is skipped without a Redis
    server); every plane made is closed, then the server."""
    try:
        redis_server = LocalRedis(tmp_path).start()
    except RedisNotFound as exc:
        pytest.skip(str(exc))
    made: list[RecordingPlane] = []

    def make() -> RecordingPlane:
        made.append(RecordingPlane(str(llama_ckpt.path), redis_url=redis_server.url))
        return made[-1]

    try:
        yield make
    finally:
        for plane in made:
            plane._close_sockets()
        redis_server.close()


def tokens(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def test_worker_lost_right_after_its_result_resumes_without_repeats(plane: RecordingPlane):
    plane.register("w0")
    plane.register("w1")
    plane.generate("r1", [1, 2, 3, 4, 5], max_tokens=3)
    plane._dispatch_all()
    a = plane.frontend.requests["r1"].worker_id
    b = "w1" if a == "w0" else "w0"
    plane.answer(a, plane.batches(a)[-1], token=10)
    plane.unreachable.add(a.encode())  # gone right after sending its next result
    plane.answer(a, plane.batches(a)[-1], token=11)
    plane._dispatch_all()
    resumed = plane.batches(b)[-1].new_requests[0]
    assert resumed.token_ids == [1, 2, 3, 4, 5, 10, 11]
    assert resumed.num_prompt_tokens == 5
    plane.answer(b, plane.batches(b)[-1], token=12)
    assert tokens(plane.outputs()) == [10, 11, 12]
    assert [o.finish_reason for o in plane.outputs() if o.finished] == ["length"]
    assert a not in plane.workers


def test_a_steps_outputs_reach_each_client_in_one_frame(plane: RecordingPlane):
    plane.register("w0")
    for request_id in ("a1", "a2", "a3"):
        plane.generate(request_id, [1, 2, 3, 4, 5], client=b"alice", max_tokens=3)
    plane.generate("b1", [6, 7, 8, 9], client=b"bob", max_tokens=3)
    plane._dispatch_all()
    batch = plane.batches("w0")[-1]
    plane.sent.clear()
    plane.answer("w0", batch, token=10)
    (alice,) = [m for i, m in plane.sent if i == b"alice"]
    assert isinstance(alice, OutputBatch)
    assert [(o.request_id, o.token_ids) for o in alice.outputs] == [
        ("a1", [10]), ("a2", [10]), ("a3", [10])
    ]  # fmt: skip
    (bob,) = [m for i, m in plane.sent if i == b"bob"]
    assert isinstance(bob, RequestOutput) and bob.token_ids == [10]  # alone: not wrapped
    plane.unreachable.add(b"alice")  # alice is gone when the next step's frame is sent
    plane.answer("w0", plane.batches("w0")[-1], token=11)
    assert list(plane.frontend.requests) == ["b1"]
    assert plane.metrics.sample("specserve_requests_total", {"reason": "abort"}) == 3.0
    assert tokens(plane.outputs(b"bob")) == [10, 11]


def test_a_late_result_of_an_earlier_registration_is_ignored(plane: RecordingPlane):
    plane.register("w1")
    plane.generate("A", [1, 2, 3, 4, 5], client=b"alice", max_tokens=4)
    plane._dispatch_all()
    first = plane.batches("w1")[-1]
    plane._on_frame(b"alice", encode(AbortRequest(P, "A")))
    plane.register("w1")  # the worker registers again (e.g. after a Reregister)
    plane.generate("C", [9, 9, 9, 9, 9, 9, 9], client=b"bob", max_tokens=4)
    plane._dispatch_all()
    second = plane.batches("w1")[-1]
    assert second.step_id != first.step_id
    assert second.new_requests[0].handle == first.new_requests[0].handle  # handles restart
    plane.answer("w1", first, token=66)  # the old registration's step finally answers
    assert plane.outputs(b"bob") == []
    plane.answer("w1", second, token=5)
    assert tokens(plane.outputs(b"bob")) == [5]


def test_reregister_requests_are_rate_limited(plane: RecordingPlane):
    for _ in range(5):
        plane._on_heartbeat(b"ghost#hb", "", Heartbeat(P, "ghost", "old-session"))
    asks = [(i, m) for i, m in plane.sent if isinstance(m, Reregister)]
    assert [i for i, _ in asks] == [b"ghost"]


def test_tokens_outside_the_vocabulary_fail_only_their_request(plane: RecordingPlane):
    plane.register("w0")
    plane.generate("bad", [1, 2, 3])
    plane.generate("good", [4, 5, 6], client=b"c2")
    plane._dispatch_all()
    batch = plane.batches("w0")[-1]
    handle = {n.request_id: n.handle for n in batch.new_requests}
    result = [RequestResult(handle["bad"], [-1]), RequestResult(handle["good"], [9])]
    plane._on_result(b"w0", "", StepResult(P, batch.step_id, result))
    (failed,) = plane.outputs()
    assert failed.finished and failed.finish_reason == "error"
    assert "outside the vocabulary" in failed.error
    assert tokens(plane.outputs(b"c2")) == [9]
    assert "w0" in plane.workers


def test_a_request_the_worker_never_answers_fails_and_frees_its_blocks(plane: RecordingPlane):
    plane.register("w0")
    plane.generate("a", [1, 2, 3])
    plane._dispatch_all()
    batch = plane.batches("w0")[-1]
    plane._on_result(b"w0", "", StepResult(P, batch.step_id, []))
    (out,) = plane.outputs()
    assert out.finish_reason == "error" and out.error == "the worker returned no result for it"
    assert plane.frontend.requests == {}
    assert plane.workers["w0"].scheduler.kv.pool.num_free_blocks == 63


def test_a_request_that_could_outgrow_the_cache_is_refused(plane: RecordingPlane):
    plane.register("w0")  # 63 usable blocks of 4 = 252 slots, max_model_len 256
    plane.generate("big", [1, 2, 3], max_tokens=300)
    (reply,) = plane.outputs()
    assert isinstance(reply, ErrorReply) and reply.request_id == "big"
    assert "can grow to 256 tokens, which needs 64 KV blocks; a worker has 63" in reply.message
    plane.generate("ok", [1, 2, 3], max_tokens=200)
    assert "ok" in plane.frontend.requests


def test_token_ids_are_checked_against_the_vocabulary_as_requests_enter(plane: RecordingPlane):
    plane.register("w0")  # vocab_size 256
    plane.generate("prompt", [1, 256])
    plane.generate("stop", [1, 2], stop_token_ids=(300,))
    replies = plane.outputs()
    assert [r.request_id for r in replies] == ["prompt", "stop"]
    assert all(isinstance(r, ErrorReply) for r in replies)
    assert "prompt token ids [256] are outside the vocabulary (size 256)" in replies[0].message
    assert "stop_token_ids [300] are outside the vocabulary (size 256)" in replies[1].message
    assert plane.frontend.requests == {}


def test_redis_refusing_writes_does_not_stop_serving(redis_planes):
    plane = redis_planes()
    plane.register("w0")
    assert plane.index.up and plane.workers["w0"].writer is not None
    plane.index.client.config_set("maxmemory-policy", "noeviction")
    plane.index.client.config_set("maxmemory", "1")  # every write is now an OOM error
    plane.generate("a", list(range(1, 20)), max_tokens=2)
    plane._dispatch_all()
    assert not plane.index.up
    plane.answer("w0", plane.batches("w0")[-1], token=3)
    plane.answer("w0", plane.batches("w0")[-1], token=4)
    assert tokens(plane.outputs()) == [3, 4]
    plane.index.client.config_set("maxmemory", "0")
    plane.index.retry_at = 0
    plane._tick(time.monotonic())
    assert plane.index.up and plane.workers["w0"].writer is not None


# --- one frame's failure fails that frame only ----------------------------------------------


def _dealer(plane: RecordingPlane, identity: bytes):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(plane.endpoint)
    return sock


def _drain_until(plane: RecordingPlane, done, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"not done after {len(plane.sent)} sends"
        plane.sock.poll(50)
        plane._drain()


def test_an_exception_while_decoding_a_frame_fails_only_that_frame(plane, monkeypatch):
    real_decode = control_plane.protocol.decode

    def decode(payload: bytes, *args, **kwargs):
        if payload == b"poison":
            raise RecursionError("maximum recursion depth exceeded")
        return real_decode(payload, *args, **kwargs)

    monkeypatch.setattr(control_plane.protocol, "decode", decode)
    plane.register("w0")
    client = _dealer(plane, b"mallory")
    try:
        client.send(b"poison")
        client.send(encode(GenerateRequest(P, "after", prompt_token_ids=[1, 2, 3])))
        _drain_until(plane, lambda: "after" in plane.frontend.requests)
    finally:
        client.close()
    (error,) = plane.outputs(b"mallory")
    assert error == ErrorReply(P, "internal error (RecursionError) while handling this message")
    plane._dispatch_all()  # the next frame was handled as usual
    plane.answer("w0", plane.batches("w0")[-1], token=7)
    assert tokens(plane.outputs(b"mallory")[1:]) == [7]


def test_an_exception_while_handling_a_request_fails_and_forgets_that_request(
    plane: RecordingPlane, monkeypatch
):
    plane.register("w0")
    real_place = plane.placement._place

    def place(req, *args):
        if req.request_id == "boom":
            real_place(req, *args)  # on the worker's scheduler already, then the failure
            raise KeyError("lost")
        real_place(req, *args)

    monkeypatch.setattr(plane.placement, "_place", place)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    for rid, prompt in (("boom", [1, 2, 3]), ("fine", [4, 5, 6])):
        frame = encode(GenerateRequest(P, rid, prompt_token_ids=prompt, sampling=greedy))
        plane._on_frame(b"c1", frame)
    plane._place_accepted()  # both in one burst: the failure of one leaves the other placed
    (error,) = plane.outputs()
    assert error == ErrorReply(P, "internal error (KeyError): 'lost'", "boom")
    assert list(plane.frontend.requests) == ["fine"]
    assert list(plane.workers["w0"].scheduler.requests) == ["fine"]
    plane._dispatch_all()
    plane.answer("w0", plane.batches("w0")[-1], token=7)
    assert tokens(plane.outputs()[1:]) == [7]


def test_a_flood_of_frames_is_handled_a_bounded_batch_at_a_time(plane: RecordingPlane):
    client = _dealer(plane, b"flood")
    try:
        for _ in range(control_plane.FRAMES_PER_PASS + 44):
            client.send(b"\xc1")
        total = control_plane.FRAMES_PER_PASS + 44
        time.sleep(0.5)  # all of them queued at the control plane's socket
        plane._drain()
        assert len(plane.sent) == control_plane.FRAMES_PER_PASS
        _drain_until(plane, lambda: len(plane.sent) == total)
    finally:
        client.close()
    assert all(isinstance(m, ErrorReply) for _, m in plane.sent)


# --- a registration's claims are bounded before anything is built from them -----------------


def _rejections(plane: RecordingPlane, identity: bytes) -> list[str]:
    return [m.reason for i, m in plane.sent if i == identity and isinstance(m, Rejected)]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"num_blocks": 1 << 24}, "num_blocks must be in [2, 262144], got 16777216"),
        ({"num_blocks": 1}, "num_blocks must be in [2, 262144], got 1"),
        ({"max_num_seqs": 1 << 20}, "max_num_seqs must be in [1, 4096], got 1048576"),
        ({"vocab_size": 0}, "vocab_size must be in [1, 2147483648], got 0"),
        ({"device": "x" * (1 << 20)}, "device has 1048576 characters; at most 256 are allowed"),
        ({"spec_method": "y" * 257}, "spec_method has 257 characters; at most 256 are allowed"),
        ({"eos_token_ids": list(range(300))},
         "at most 64 KV groups and 256 EOS token ids are allowed, got 1 and 300"),
    ],
)  # fmt: skip
def test_registration_claims_beyond_the_limits_are_rejected_at_once(
    plane: RecordingPlane, fields: dict, reason: str
):
    start = time.monotonic()
    plane.register("w0", **fields)
    assert time.monotonic() - start < 1.0  # nothing sized by the claim was built
    assert _rejections(plane, b"w0") == [reason]
    assert plane.workers == {}


def test_rejections_never_echo_a_huge_string(plane: RecordingPlane):
    plane._on_register(b"w" * 100, "", Register(P, _info("w" * (1 << 20))))
    plane._on_register(b"w1", "", Register(P, _info("w1", model="m" * (1 << 20))))
    first, second = [m.reason for _, m in plane.sent if isinstance(m, Rejected)]
    assert (
        first == f"worker id '{'w' * 63}... (1048576 characters) must be 1-64 characters from "
        "[A-Za-z0-9._-]"
    )
    assert second.endswith(f"the worker loaded '{'m' * 64}... (1048512 more characters)'")
    assert plane.workers == {}


def test_limits_are_the_operators(llama_ckpt):
    limits = ServiceLimits(max_registration_blocks=64, max_registration_seqs=16)
    p = RecordingPlane(str(llama_ckpt.path), limits=limits)
    try:
        p.register("w0")  # 64 blocks, 16 sequences: at the limits
        assert "w0" in p.workers
        p.register("w1", num_blocks=65)
        assert _rejections(p, b"w1") == ["num_blocks must be in [2, 64], got 65"]
    finally:
        p._close_sockets()


def test_the_prompt_limit_is_the_smallest_of_the_service_and_the_workers(llama_ckpt):
    p = RecordingPlane(str(llama_ckpt.path), limits=ServiceLimits(max_prompt_tokens=100))
    try:
        p.generate("a", [1] * 101)  # no worker yet: the service's limit
        p.register("w0")  # max_model_len 256: the service's 100 is still smaller
        p.generate("b", [1] * 101)
        p.register("w1", max_model_len=50)
        p.generate("c", [1] * 50)
        p.generate("d", [1] * 49)
    finally:
        p._close_sockets()
    assert [(r.request_id, r.message) for r in p.outputs() if isinstance(r, ErrorReply)] == [
        ("a", "the prompt has 101 tokens; at most 100 prompt tokens are allowed "
              "(--max-prompt-tokens)"),
        ("b", "the prompt has 101 tokens; at most 100 prompt tokens are allowed "
              "(--max-prompt-tokens)"),
        ("c", "the prompt has 50 tokens; at most 49 prompt tokens are allowed "
              "(max_model_len 50, one position kept for output)"),
    ]  # fmt: skip
    assert "d" in p.frontend.requests


# --- a worker's KV outlives its control plane -------------------------------------------------

PROMPT = list(range(1, 30))  # 29 tokens: 7 full blocks of 4
RESUMED = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _resume(plane: RecordingPlane, request_id: str, prompt: list[int], client: bytes) -> None:
    """A client's resume of `request_id` that has received one token (7) so far."""
    msg = GenerateRequest(P, request_id, prompt_token_ids=prompt, sampling=RESUMED,
                          resume=Resume([7]))  # fmt: skip
    plane._on_generate(client, msg)
    plane._place_accepted()


def _prompt_on_x0_then_resumed_on_b(redis_planes) -> tuple[RecordingPlane, NewRequest]:
    """Two planes on one index: PROMPT's KV computed on x0 under plane a (and indexed); its
    client resumes it on plane b, which has only y0. Returns b and x0's NewRequest."""
    a, b = redis_planes(), redis_planes()
    a.register("x0")
    a.generate("r", PROMPT, max_tokens=4)
    a._dispatch_all()
    (first,) = a.batches("x0")[-1].new_requests
    a.answer("x0", a.batches("x0")[-1], token=7)
    b.register("y0")
    _resume(b, "r", PROMPT, b"c1")
    return b, first


def test_a_resumed_request_waits_for_the_worker_that_holds_its_kv(redis_planes):
    """The index says x0 holds the resumed request's prompt, so b holds the request instead of
    computing it again on y0; x0 registers with b offering that KV, and the request starts
    there on the adopted blocks. Fresh requests, and resumed ones nobody holds, never wait."""
    b, first = _prompt_on_x0_then_resumed_on_b(redis_planes)
    b._dispatch_all()
    assert b.batches("y0") == []  # held: y0 would compute all 30 tokens again
    kept = KeptRequest(PROMPT[:28], [first.block_ids[0][:7]])
    b._on_register(b"x0", "", Register(P, _info("x0", model=b.args.model), [kept]))
    b._dispatch_all()
    (started,) = b.batches("x0")[-1].new_requests
    assert started.request_id == "r"
    assert started.token_ids == [*PROMPT, 7]
    assert started.num_computed_tokens == 28  # every full block was adopted
    assert started.block_ids[0][:7] == first.block_ids[0][:7]

    b.generate("s", PROMPT, client=b"c2", max_tokens=4)  # a fresh request is never held
    _resume(b, "t", [9] * 40, b"c3")  # nothing holds these tokens: placed at once
    assert b.frontend.requests["t"].worker_id is not None


def test_a_hold_for_a_worker_that_never_comes_ends(redis_planes):
    """After RESUME_HOLD_S the request runs where it can, computed again."""
    b, _ = _prompt_on_x0_then_resumed_on_b(redis_planes)
    assert b.frontend.requests["r"].worker_id is None
    b._tick(time.monotonic() + placement.RESUME_HOLD_S / 2)
    assert b.frontend.requests["r"].worker_id is None
    b._tick(time.monotonic() + placement.RESUME_HOLD_S)
    assert b.frontend.requests["r"].worker_id == "y0"
    b._dispatch_all()
    (started,) = b.batches("y0")[-1].new_requests
    assert (started.token_ids, started.num_computed_tokens) == ([*PROMPT, 7], 0)


# --- forwarding to another control plane ------------------------------------------------------

PEER = "tcp://peer:1"


@pytest.fixture
def forwarding_plane(redis_planes):
    """A plane whose link to another plane is a test double: `plane.peers.target` may be set
    per test (it names the peer by default), and what it sends is recorded in `plane.to_peer`."""
    plane = redis_planes()
    assert plane.peers is not None
    plane.to_peer = []
    plane.peers.target = lambda away, here: forwarding.Target(PEER, "x9", 64)
    plane.peers.send = lambda url, msg: plane.to_peer.append(msg) or True
    plane.peers.links[PEER] = forwarding.PeerLink(PEER, None, None)
    yield plane
    plane.peers.links.clear()  # no sockets behind it to close


def test_only_a_request_with_nothing_delivered_is_forwarded(forwarding_plane):
    """A request is forwarded to another plane only before any of its output exists: one that
    moves after its worker died (or was resumed by its client) goes on here, since the other
    plane would start it over."""
    plane = forwarding_plane
    plane.register("w0")
    plane.register("w1")
    plane.generate("fresh", list(range(1, 30)), max_tokens=4)
    assert [m.request_id for m in plane.to_peer] == ["fresh"] and plane.to_peer[0].forwarded
    assert plane.frontend.requests["fresh"].forwarded_to == PEER

    target = plane.peers.target
    plane.peers.target = lambda away, here: None  # "started" runs here
    plane.generate("started", list(range(40, 70)), max_tokens=4)
    plane._dispatch_all()
    worker = plane.frontend.requests["started"].worker_id
    plane.answer(worker, plane.batches(worker)[-1], token=7)
    plane.peers.target = target
    plane.unreachable.add(worker.encode())  # its worker dies: the request moves on
    plane._remove_worker(plane.workers[worker], "killed")
    assert [m.request_id for m in plane.to_peer] == ["fresh"]
    assert plane.frontend.requests["started"].worker_id not in (None, worker)


def test_a_request_the_peer_refuses_is_served_here_and_never_sent_again(forwarding_plane):
    plane = forwarding_plane
    plane.register("w0")
    plane.generate("r", list(range(1, 30)), max_tokens=2)
    assert [m.request_id for m in plane.to_peer] == ["r"]
    refusal = ErrorReply(P, "this client already has 1024 requests in flight", "r")
    plane._on_peer_frame(PEER, encode(refusal))
    assert [m.request_id for m in plane.to_peer] == ["r"]  # not forwarded again
    assert plane.frontend.requests["r"].worker_id == "w0"
    plane._dispatch_all()
    plane.answer("w0", plane.batches("w0")[-1], token=5)
    plane.answer("w0", plane.batches("w0")[-1], token=6)
    assert tokens(plane.outputs()) == [5, 6]
    assert plane.outputs()[-1].finished


PLANE_KEY, CLIENT_KEY = "plane-key", "client-key"  # as authenticated CURVE keys read them


def _forwarded(request_id: str, origin_key: str) -> GenerateRequest:
    return GenerateRequest(P, request_id, prompt_token_ids=PROMPT, sampling=RESUMED,
                           forwarded=True, origin_key=origin_key)  # fmt: skip


def test_a_forwarded_request_is_resumed_by_its_client_when_its_plane_dies(plane):
    """A request another plane forwarded here lives under that plane's connection. When that
    plane dies, its client resumes the request here, possibly before this plane has found the
    forwarding plane gone: the resume takes the request over (the forwarding plane named the
    client's key), and the forwarding plane's copy ends with an abort. A client with another
    key is refused, and `origin_key` from anyone but a plane is ignored."""
    plane.plane_key = PLANE_KEY  # as a plane loaded with the service's keys
    plane.register("w0")
    plane._on_generate(b"plane-a", _forwarded("r", CLIENT_KEY), PLANE_KEY)
    plane._place_accepted()
    plane._dispatch_all()
    plane.answer("w0", plane.batches("w0")[-1], token=7)
    assert tokens(plane.outputs(b"plane-a")) == [7]

    resume = GenerateRequest(P, "r", prompt_token_ids=PROMPT, sampling=RESUMED,
                             resume=Resume([7]))  # fmt: skip
    plane._on_generate(b"intruder", resume, "another-key")
    refused = "request id 'r' is already in flight"
    assert [o.message for o in plane.outputs(b"intruder")] == [refused]

    plane._on_generate(b"c1", resume, CLIENT_KEY)
    plane._place_accepted()
    (last,) = plane.outputs(b"plane-a")[1:]
    assert (last.finished, last.finish_reason) == (True, "abort")
    assert plane.frontend.requests["r"].client == b"c1"
    in_flight = plane.batches("w0")[-1]  # the old copy's next token, dispatched before
    plane.answer("w0", in_flight, token=99)  # dropped: that copy was withdrawn
    batch = plane.batches("w0")[-1]
    (moved,) = batch.new_requests
    assert (moved.request_id, moved.token_ids) == ("r", [*PROMPT, 7])
    assert batch.finished == [in_flight.running[0].handle]
    plane.answer("w0", batch, token=8)
    plane._dispatch_all()
    plane.answer("w0", plane.batches("w0")[-1], token=9)
    plane._dispatch_all()
    plane.answer("w0", plane.batches("w0")[-1], token=10)
    assert tokens(plane.outputs(b"c1")) == [8, 9, 10]  # max_tokens 4 with the 7 it had
    assert plane.outputs(b"c1")[-1].finished
    assert len(plane.outputs(b"plane-a")) == 2  # nothing more went to the forwarding plane

    # A client claiming to forward for CLIENT_KEY is not a plane: the request is its own.
    plane._on_generate(b"spoof", _forwarded("s", CLIENT_KEY), "spoof-key")
    plane._place_accepted()
    assert plane.frontend.requests["s"].client_key == "spoof-key"
    take = GenerateRequest(P, "s", prompt_token_ids=PROMPT, sampling=RESUMED, resume=Resume([]))
    plane._on_generate(b"c1", take, CLIENT_KEY)
    assert plane.outputs(b"c1")[-1].message == "request id 's' is already in flight"


def test_a_plane_with_no_live_worker_holds_a_request_its_peer_is_too_busy_for(forwarding_plane):
    """A plane with no live worker forwards a request to a peer that refuses it as overloaded:
    the request is held (not refused, not served here) and forwarded again at the next look at
    the other planes, whose answer reaches the client."""
    plane = forwarding_plane
    plane.peers.links[PEER].connected = True
    plane.peers.lost = lambda: []  # the link double has no connection to lose
    plane.index.other_planes_workers = lambda: {"x9": PEER}
    plane._peers_tick(time.monotonic())  # reads the other planes' workers
    plane.generate("r", list(range(1, 30)), max_tokens=2)
    assert [m.request_id for m in plane.to_peer] == ["r"]
    busy = ErrorReply(P, "this client already has 1024 requests in flight", "r", "overloaded")
    plane._on_peer_frame(PEER, encode(busy))
    assert plane.outputs() == []  # held: its client hears nothing yet
    req = plane.frontend.requests["r"]
    assert req.forwarded_to is None and req in plane.placement.pending

    plane._peers_tick(time.monotonic() + control_plane.OWNERS_REFRESH_S)
    assert [m.request_id for m in plane.to_peer] == ["r", "r"]
    assert req.forwarded_to == PEER
    out = RequestOutput(P, "r", [5, 6], None, finished=True, finish_reason="length")
    plane._on_peer_frame(PEER, encode(out))
    assert tokens(plane.outputs()) == [5, 6] and plane.outputs()[-1].finished
    assert "r" not in plane.frontend.requests
