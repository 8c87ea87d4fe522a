"""Hostile input against a live service (a real Redis, a control plane on a real socket, a worker
process): each attack of issue 17 is its own regression test, and after each one a legitimate
client still gets exactly the greedy tokens transformers computes on the same weights."""

from __future__ import annotations

import contextlib
import os
import random
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest
import zmq
from hf_reference import hf_greedy
from service_harness import Service, start_up, up_ports
from zmq.utils.monitor import recv_monitor_message

from specserve.cache_index import IndexReader, connect
from specserve.client import Client, RequestFailed
from specserve.control.limits import ServiceLimits
from specserve.shared import protocol
from specserve.shared.config import AttentionType, KVGroupSpec
from specserve.shared.curve import CLIENTS, PeerKeys
from specserve.shared.hashing import BlockHasher, extend_block_hashes
from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    ErrorReply,
    GenerateRequest,
    Heartbeat,
    OutputBatch,
    Register,
    Rejected,
    RequestOutput,
    RequestResult,
    SamplingParams,
    StepResult,
    Welcome,
)

MAX_MESSAGE_BYTES = 16 << 20  # room for a 1e7-token prompt, which the length check must refuse
MAX_PENDING = 4
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
N = 12


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def svc(llama_ckpt, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One service for every attack here; each test checks that it still serves exactly."""
    limits = ServiceLimits(
        max_message_bytes=MAX_MESSAGE_BYTES,
        max_frame_objects=1 << 24,  # a 1e7-token prompt gets past the frame check to the prompt's
        max_pending_per_client=MAX_PENDING,
    )
    service = Service(
        str(llama_ckpt.path), redis_url, tmp_path_factory.mktemp("hostile"), limits=limits
    )
    try:
        service.start("w0")
        yield service
    finally:
        service.close()


@pytest.fixture(scope="module")
def expected(llama_ckpt) -> list[int]:
    return hf_greedy(llama_ckpt.hf_model, PROMPT, N)


def assert_still_serving(svc: Service, expected: list[int]) -> None:
    """A legitimate client gets the exact greedy tokens; the loop and the worker live on."""
    with Client(svc.url, timeout=60) as client:
        out = client.generate(PROMPT, greedy(N))
    assert out.token_ids == expected
    assert svc._thread is not None and svc._thread.is_alive()
    assert svc.workers["w0"].poll() is None
    assert svc.plane is not None and set(svc.plane.workers) == {"w0"}


@contextmanager
def raw_socket(url: str | None, identity: bytes | None = None) -> Iterator[zmq.Socket]:
    """A plain DEALER socket, speaking whatever the test makes it send (connected to `url`
    unless that is None)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if url is not None:
        sock.connect(url)
    try:
        yield sock
    finally:
        sock.close()


def receive(sock: zmq.Socket, timeout_s: float = 20.0) -> protocol.Message:
    assert sock.poll(int(timeout_s * 1000)), f"no reply within {timeout_s} s"
    return protocol.decode(sock.recv())


def nested_generate(request_id: str, depth: int) -> bytes:
    """A `generate` message whose prompt is an array nested `depth` levels deep."""
    head = msgspec.msgpack.encode(
        {"type": "generate", "version": PROTOCOL_VERSION, "request_id": request_id}
    )
    assert head[0] == 0x83  # a map of 3 entries: grow it to 4
    value = msgspec.msgpack.encode("prompt_token_ids") + b"\x91" * depth + b"\x01"
    return b"\x84" + head[1:] + value


def index_error_count(svc: Service) -> float:
    assert svc.plane is not None
    return sum(
        s.value
        for metric in svc.plane.metrics.registry.collect()
        for s in metric.samples
        if s.name == "specserve_index_errors_total"
    )


# --- frames ----------------------------------------------------------------------------------


def test_a_deeply_nested_generate_frame_is_refused_naming_its_request(svc, expected) -> None:
    frame = nested_generate("deep", 1000)
    assert len(frame) < 1100  # about 1 KB
    with raw_socket(svc.url) as sock:
        sock.send(frame)
        reply = receive(sock)
    assert isinstance(reply, ErrorReply)
    assert reply.request_id == "deep"
    assert reply.message == f"frame refused ({len(frame)} bytes): nested deeper than 32 levels"
    assert_still_serving(svc, expected)


def test_a_frame_over_max_message_bytes_drops_only_its_sender(svc, expected) -> None:
    with Client(svc.url, timeout=60) as client, raw_socket(None) as attacker:
        monitor = attacker.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        attacker.connect(svc.url)  # after the monitor, so that it sees the connection
        assert monitor.poll(10_000)
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED
        streamed: list[int] = []
        attacked: list[int] = []
        for out in client.stream(PROMPT, greedy(N)):
            streamed.extend(out.token_ids)
            if streamed and not out.finished and not attacked:  # mid-stream for this client
                attacked.append(len(streamed))
                attacker.send(b"\x00" * (MAX_MESSAGE_BYTES + 1))
                assert monitor.poll(10_000), "the oversized frame did not cost its connection"
                assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        assert attacked
        attacker.disable_monitor()
        monitor.close()
        assert not attacker.poll(200)  # nothing was answered to it
    assert streamed == expected
    assert_still_serving(svc, expected)


def test_a_prompt_of_ten_million_ids_is_refused_by_length_before_any_index_work(
    svc, expected
) -> None:
    plane = svc.plane
    assert plane is not None
    before = (
        plane.metrics.sample("specserve_prefix_query_tokens_total"),
        plane.metrics.sample("specserve_index_lookup_seconds_count"),
        index_error_count(svc),
    )
    # Ids outside the vocabulary (-1 is one byte): the exact refusal below shows the length
    # was checked before ten million ids were range-checked.
    frame = protocol.encode(
        GenerateRequest(PROTOCOL_VERSION, "huge", prompt_token_ids=[-1] * 10_000_000)
    )
    assert 9 << 20 < len(frame) < MAX_MESSAGE_BYTES
    with raw_socket(svc.url) as sock:
        start = time.monotonic()
        sock.send(frame)
        reply = receive(sock)
        elapsed = time.monotonic() - start
    assert isinstance(reply, ErrorReply) and reply.request_id == "huge"
    assert reply.message == (
        "the prompt has 10000000 tokens; at most 255 prompt tokens are allowed "
        "(max_model_len 256, one position kept for output)"
    )
    assert elapsed < 5.0  # it took 15 s when the ids were hashed and looked up first
    after = (
        plane.metrics.sample("specserve_prefix_query_tokens_total"),
        plane.metrics.sample("specserve_index_lookup_seconds_count"),
        index_error_count(svc),
    )
    assert after == before  # no hashing, no Redis lookup, no Redis failure
    assert plane.index.up  # the index was not marked down
    assert_still_serving(svc, expected)


def test_random_bytes_and_worker_messages_from_a_client_socket_change_nothing(
    svc, expected
) -> None:
    plane = svc.plane
    assert plane is not None
    worker = plane.workers["w0"]
    epoch, session = worker.epoch, plane.session
    rng = random.Random(17)
    frames = [rng.randbytes(rng.randrange(1, 300)) for _ in range(300)]
    frames += [
        protocol.encode(StepResult(PROTOCOL_VERSION, rng.randrange(1 << 40))) for _ in range(100)
    ]
    frames += [
        protocol.encode(Heartbeat(PROTOCOL_VERSION, "w0", rng.randbytes(8).hex()))
        for _ in range(100)
    ]
    frames += [protocol.encode(Heartbeat(PROTOCOL_VERSION, "w0", ""))] * 20
    rng.shuffle(frames)
    with Client(svc.url, timeout=60) as client, raw_socket(svc.url, b"intruder") as sock:
        rid = client.submit(PROMPT, greedy(N))  # in flight while the frames arrive
        for frame in frames:
            sock.send(frame)
        out = client.result(rid)
        # Let every frame be handled before looking at the state.
        sock.send(protocol.encode(GenerateRequest(PROTOCOL_VERSION, "probe", prompt_token_ids=[])))
        deadline = time.monotonic() + 20
        while True:
            assert time.monotonic() < deadline, "the probe was never answered"
            reply = receive(sock)
            if isinstance(reply, ErrorReply) and reply.request_id == "probe":
                assert reply.message == "the prompt is empty"
                break
    assert out.token_ids == expected
    assert plane.workers["w0"] is worker  # not replaced, not re-registered
    assert (worker.epoch, plane.session) == (epoch, session)
    assert "intruder" not in plane.workers
    assert_still_serving(svc, expected)


# --- requests --------------------------------------------------------------------------------


def test_a_client_flooding_pending_requests_is_capped_and_others_are_served(svc, expected) -> None:
    flood = [
        GenerateRequest(PROTOCOL_VERSION, f"flood-{i}", prompt_token_ids=[7, i + 1, 9],
                        sampling=greedy(60), stream=False)
        for i in range(MAX_PENDING + 3)
    ]  # fmt: skip
    with raw_socket(svc.url) as flooder:
        for msg in flood:
            flooder.send(protocol.encode(msg))
        refused: list[ErrorReply] = []
        while len(refused) < 3:
            reply = receive(flooder)
            assert isinstance(reply, ErrorReply), reply
            refused.append(reply)
        assert sorted(r.request_id for r in refused) == [f"flood-{i}" for i in (4, 5, 6)]
        for reply in refused:
            assert reply.message == (
                f"this client already has {MAX_PENDING} requests in flight, the most allowed "
                f"(--max-pending-per-client {MAX_PENDING}); wait for one to finish"
            )
        with Client(svc.url, timeout=60) as other:  # another client is served meanwhile
            assert other.generate(PROMPT, greedy(N)).token_ids == expected
        done: list[protocol.Message] = []
        while len(done) < MAX_PENDING:  # outputs of one step come in one frame
            reply = receive(flooder, 60)
            done += reply.outputs if isinstance(reply, OutputBatch) else [reply]
        assert all(isinstance(d, RequestOutput) and d.finished for d in done)
        assert sorted(d.request_id for d in done) == [f"flood-{i}" for i in range(MAX_PENDING)]
        # Its requests finished: it may submit again.
        again = GenerateRequest(PROTOCOL_VERSION, "again", prompt_token_ids=PROMPT,
                                sampling=greedy(N), stream=False)  # fmt: skip
        flooder.send(protocol.encode(again))
        reply = receive(flooder, 60)
    assert isinstance(reply, RequestOutput) and reply.request_id == "again"
    assert reply.token_ids == expected
    assert_still_serving(svc, expected)


def test_vanishing_temperature_is_greedy_and_vanishing_top_p_is_the_argmax(svc, expected) -> None:
    with Client(svc.url, timeout=60) as client:
        tiny_t = SamplingParams(max_tokens=N, temperature=1e-39, ignore_eos=True)
        assert client.generate(PROMPT, tiny_t).token_ids == expected
        tiny_p = SamplingParams(max_tokens=N, temperature=1.0, top_p=1e-45, seed=5, ignore_eos=True)
        assert client.generate(PROMPT, tiny_p).token_ids == expected
    assert_still_serving(svc, expected)


# --- registrations ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("claims", "reason"),
    [
        ({"num_blocks": 1 << 24}, "num_blocks must be in [2, 262144], got 16777216"),
        ({"device": "x" * (1 << 20)}, "device has 1048576 characters; at most 256 are allowed"),
    ],
    ids=["2^24 blocks", "1 MB device"],
)
def test_an_oversized_registration_is_refused_fast_and_nothing_is_kept(
    svc, expected, claims, reason
) -> None:
    plane = svc.plane
    assert plane is not None
    info = msgspec.structs.replace(plane.workers["w0"].info, worker_id="bloated", **claims)
    with raw_socket(svc.worker_url, b"bloated") as sock:
        start = time.monotonic()
        sock.send(protocol.encode(Register(PROTOCOL_VERSION, info)))
        reply = receive(sock)
        elapsed = time.monotonic() - start
    assert isinstance(reply, Rejected) and reply.reason == reason
    assert elapsed < 2.0  # 2^24 blocks froze the loop for 12 s when they were built
    assert "bloated" not in plane.workers
    assert plane.metrics.sample("specserve_worker_up", {"worker": "bloated"}) is None
    redis = connect(svc.redis_url)
    try:
        ns = plane.workers["w0"].namespace
        assert redis.hget(ns.epochs_key, "bloated") is None
        assert redis.hget(ns.live_key, "bloated") is None
        assert not list(redis.scan_iter(match=b"*bloated*", count=1000))
    finally:
        redis.close()
    assert_still_serving(svc, expected)


# --- through the user's command --------------------------------------------------------------


def test_specserve_up_shrugs_off_a_hostile_socket(llama_ckpt, redis_url) -> None:
    port, api_port = up_ports()
    url = f"tcp://127.0.0.1:{port}"
    argv = [
        "up", "--workers", "1", "--port", str(port), "--model", str(llama_ckpt.path),
        "--redis-url", redis_url, "--num-blocks", "64", "--block-size", "4",
        "--max-model-len", "256", "--max-message-bytes", str(1 << 20),
        "--api-port", str(api_port),
    ]  # fmt: skip
    up, lines = start_up(argv)
    try:
        want = hf_greedy(llama_ckpt.hf_model, [1, 2, 3], 5)
        keys = os.environ["SPECSERVE_KEYS"]  # where `up` made its keys
        # A socket without a key gets nothing through either port; one with the client key
        # gets the bounded refusals.
        for port_url in (url, f"tcp://127.0.0.1:{port + 1}"):
            with raw_socket(port_url) as stranger:
                with contextlib.suppress(zmq.Again):  # no connection: not even queued
                    stranger.send(nested_generate("deep", 5000), zmq.NOBLOCK)
                assert not stranger.poll(1000)
        with raw_socket(None) as hostile:
            PeerKeys.load(keys, CLIENTS, "client").apply(hostile)
            hostile.connect(url)
            hostile.send(nested_generate("deep", 5000))
            reply = receive(hostile)
            assert isinstance(reply, ErrorReply) and reply.request_id == "deep"
            assert "nested deeper than 32 levels" in reply.message
            for data in random.Random(3).sample(range(256), 64):
                hostile.send(bytes([data]) * 40)
            hostile.send(protocol.encode(StepResult(PROTOCOL_VERSION, 1)))
            hostile.send(b"\x90" * ((1 << 20) + 1))  # over --max-message-bytes: dropped
            with Client(url, timeout=60, keys=keys) as client:
                out = client.generate([1, 2, 3], greedy(5))
        assert out.token_ids == want
        refused = pytest.raises(RequestFailed, match="at most 255 prompt tokens")
        with Client(url, timeout=60, keys=keys) as client, refused:
            client.generate([1] * 300, greedy(1))
        assert up.poll() is None, "".join(lines)
        up.terminate()
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    log = "".join(lines)
    assert re.search(r"\[control\].*control\.bad_frame", log), log[-3000:]


# --- the index -------------------------------------------------------------------------------


def index_state(redis, ns, worker_id: str, epoch: int) -> dict:
    """Everything of one worker epoch in the index, but its heartbeat's clock."""
    members = redis.smembers(ns.reverse_key(worker_id, epoch))
    record = redis.hgetall(ns.worker_key(worker_id))
    record.pop(b"heartbeat_ms", None)
    return {
        "live": redis.hget(ns.live_key, worker_id),
        "epochs": redis.hget(ns.epochs_key, worker_id),
        "record": record,
        "members": members,
        "blocks": {m: redis.hget(ns.block_key_from_member(m), worker_id) for m in members},
    }


def test_no_worker_message_touches_another_workers_index_entries(svc, expected) -> None:
    plane = svc.plane
    assert plane is not None
    worker = plane.workers["w0"]
    ns, epoch = worker.namespace, worker.epoch
    system = [(5 * i + 11) % 250 + 1 for i in range(24)]
    with Client(svc.url, timeout=60) as client:
        client.generate(system, greedy(2))  # w0 now holds the prompt's blocks in the index
    redis = connect(svc.redis_url)
    try:
        before = index_state(redis, ns, "w0", epoch)
        assert before["live"] == str(epoch).encode() and len(before["members"]) >= 6
        hashes: list = []
        extend_block_hashes(BlockHasher(), hashes, system, 4)
        assert IndexReader(redis, ns).longest_prefix(hashes)["w0"] == 6

        info = worker.info
        coarse = [KVGroupSpec(AttentionType.FULL, 8)]
        with raw_socket(svc.worker_url, b"intruder") as sock:
            # w0's own registration replayed, or its id claimed, from another connection.
            for forged in (info, msgspec.structs.replace(info, pid=1)):
                sock.send(protocol.encode(Register(PROTOCOL_VERSION, forged)))
                reply = receive(sock)
                assert isinstance(reply, Rejected)
                assert "registered by a live worker" in reply.reason
            # Names that would reach into index keys or `<worker>@<epoch>` members. (Keys that
            # admit only real workers are another matter: test_auth.py.)
            for bad_id in ("w0@" + str(epoch), "w0:live", "w0:1", "w0/../w0"):
                with raw_socket(svc.worker_url, bad_id.encode()) as other:
                    forged = msgspec.structs.replace(info, worker_id=bad_id)
                    other.send(protocol.encode(Register(PROTOCOL_VERSION, forged)))
                    reply = receive(other)
                    assert isinstance(reply, Rejected) and "must be 1-64 characters" in reply.reason
            # Registered under its own id, in another namespace (block size 8), then in w0's:
            # whatever it sends is written under its own id and epochs only.
            for groups in (coarse, info.kv_groups):
                own = msgspec.structs.replace(info, worker_id="intruder", kv_groups=groups)
                sock.send(protocol.encode(Register(PROTOCOL_VERSION, own)))
                welcome = receive(sock)
                assert isinstance(welcome, Welcome) and welcome.epoch >= 0
            for step_id in range(40):
                results = [RequestResult(h, [1, 2]) for h in range(4)]
                sock.send(protocol.encode(StepResult(PROTOCOL_VERSION, step_id, results)))
        deadline = time.monotonic() + 20
        while "intruder" in plane.workers:  # silent since: removed for missing heartbeats
            assert time.monotonic() < deadline, "the intruder was never removed"
            time.sleep(0.05)

        assert plane.workers["w0"] is worker and worker.epoch == epoch
        assert index_state(redis, ns, "w0", epoch) == before
        assert IndexReader(redis, ns).longest_prefix(hashes)["w0"] == 6
        assert redis.hget(ns.live_key, "intruder") is None  # its own epoch was fenced
    finally:
        redis.close()
    assert_still_serving(svc, expected)
