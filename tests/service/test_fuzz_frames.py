"""A bounded, reproducible fuzz run against a live control plane over a real socket: random
bytes, mutated real messages (bit flips, truncation, splices), deeply nested frames and forged
messages of every type with absurd field values. Afterwards the control plane's loop is alive,
its worker is the same registration, and a legitimate request gets the exact greedy tokens."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq
from hf_reference import hf_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_harness import Service

from specserve.client import Client
from specserve.shared import protocol
from specserve.shared.config import AttentionType, KVGroupSpec
from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    ErrorReply,
    GenerateRequest,
    Heartbeat,
    NewRequest,
    Register,
    Rejected,
    RequestOutput,
    RequestResult,
    Reregister,
    RunningDelta,
    SamplingParams,
    SpecStats,
    StepBatch,
    StepResult,
    TokenLogprobs,
    Welcome,
    WorkerInfo,
)

PROMPT = [2, 7, 1, 8, 2, 8, 1, 8]
N = 10
EXAMPLES = 3000  # a few seconds on a small host
FUZZ_IDENTITY = b"fuzzer"

_info = WorkerInfo(
    worker_id="fuzz-w", model="fuzz-model", device="cpu",
    kv_groups=[KVGroupSpec(AttentionType.FULL, 4)], num_blocks=160, max_model_len=256,
    vocab_size=256, eos_token_ids=[0], max_num_batched_tokens=2048, max_num_seqs=16,
)  # fmt: skip
_sampling = SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, seed=1, logprobs=2)
_logprobs = TokenLogprobs([-0.5], [[1, 2]], [[-0.5, -1.5]])
# Real encoded messages of every type, the material that mutations start from.
SEEDS = [
    protocol.encode(msg)
    for msg in (
        GenerateRequest(PROTOCOL_VERSION, "seed-ids", prompt_token_ids=[1, 2, 3],
                        sampling=SamplingParams(max_tokens=2, temperature=0.0)),
        GenerateRequest(PROTOCOL_VERSION, "seed-text", prompt="hello", chat=True,
                        sampling=_sampling, stream=False, cache_salt="t", priority=3),
        AbortRequest(PROTOCOL_VERSION, "seed-ids"),
        Register(PROTOCOL_VERSION, _info),
        Heartbeat(PROTOCOL_VERSION, "w0", "0123456789abcdef"),
        StepResult(PROTOCOL_VERSION, 7, [RequestResult(0, [5, 6], [7], _logprobs),
                                         RequestResult(1, [], error="boom")]),
        StepBatch(PROTOCOL_VERSION, 7,
                  [NewRequest(0, "r", [1, 2], 2, _sampling, [[1]], 0, 2)],
                  [RunningDelta(1, 4, 1, [[2]], 0)], [2], [3]),
        Welcome(PROTOCOL_VERSION, "w0", "s", 1),
        Rejected(PROTOCOL_VERSION, "no"),
        Reregister(PROTOCOL_VERSION, "again"),
        RequestOutput(PROTOCOL_VERSION, "r", [1], "a", True, "length", logprobs=[_logprobs],
                      spec=SpecStats(1, 2, 1, [0, 1, 0])),
        ErrorReply(PROTOCOL_VERSION, "bad", "r"),
    )
]  # fmt: skip

# Field names of each message type, for forged messages that name real fields.
FIELDS = {
    cls.__struct_config__.tag: [f for f in cls.__struct_fields__ if f != "version"]
    for cls in protocol.Message.__args__
}

ints = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, -1, 1 << 24, 2**31, 2**63 - 1, 2**64 - 1, -(2**63)]),
)
scalars = st.one_of(
    ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-39, 1e-45, 5e-324, -0.0, 1e308]),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.none(),
    st.booleans(),
)
absurd = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=20,
) | st.sampled_from([10, 1000, 100_000]).map(lambda n: [5] * n)  # long but shallow arrays


@st.composite
def forged(draw: st.DrawFn) -> bytes:
    """Valid MessagePack of one message type, its fields holding absurd values."""
    tag = draw(st.sampled_from(sorted(FIELDS)))
    message: dict = {"type": tag, "version": draw(st.sampled_from([PROTOCOL_VERSION]) | ints)}
    for name in FIELDS[tag]:
        if draw(st.booleans()):
            message[name] = draw(absurd)
    if tag == "generate" and draw(st.booleans()):
        message["sampling"] = draw(
            st.dictionaries(st.sampled_from(SamplingParams.__struct_fields__), scalars, max_size=5)
        )
    return msgspec.msgpack.encode(message)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A real message with bit flips, truncations, insertions and splices of another."""
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "splice", "byte"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and data:
            data[at] = draw(st.sampled_from([0xC1, 0xDC, 0xDD, 0xDE, 0xDF, 0xC6, 0xDB, 0xFF]))
        elif op == "truncate":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            other = draw(st.sampled_from(SEEDS))
            cut = draw(st.integers(0, len(other)))
            data[at:] = other[cut:]
    return bytes(data)


@st.composite
def nested(draw: st.DrawFn) -> bytes:
    """A frame nested far deeper than any message, bare or inside a `generate` message."""
    depth = draw(st.integers(33, 20_000))
    opener = draw(
        st.sampled_from([b"\x91", b"\x81\xa1k", b"\xdc\x00\x01", b"\xdf\x00\x00\x00\x01\x00"])
    )
    body = opener * depth + b"\x01"
    if draw(st.booleans()):
        return body
    head = msgspec.msgpack.encode(
        {"type": "generate", "version": PROTOCOL_VERSION, "request_id": "nest"}
    )
    return b"\x84" + head[1:] + msgspec.msgpack.encode("prompt_token_ids") + body


frames = st.one_of(st.binary(max_size=600), mutated(), nested(), forged())


@pytest.fixture(scope="module")
def svc(llama_ckpt, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    service = Service(str(llama_ckpt.path), redis_url, tmp_path_factory.mktemp("fuzz"))
    try:
        service.start("w0")
        yield service
    finally:
        service.close()


def drain(sock: zmq.Socket) -> int:
    n = 0
    while sock.poll(0):
        sock.recv()
        n += 1
    return n


def recording(fn: Callable[..., None], failures: list[str]) -> Callable[..., None]:
    """`fn`, noting every exception it raises (the loop survives them, but each is a bug: a
    hostile frame deserves a clear refusal, not an internal error)."""

    def wrapper(*args: object) -> None:
        try:
            fn(*args)
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
            raise

    return wrapper


def test_fuzzed_frames_leave_the_control_plane_serving_exactly(
    svc: Service, llama_ckpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    plane = svc.plane
    assert plane is not None and svc._thread is not None
    failures: list[str] = []
    for name in ("_on_frame", "_on_generate"):  # the frame as a whole, and a decoded request
        monkeypatch.setattr(plane, name, recording(getattr(plane, name), failures))
    worker = plane.workers["w0"]
    expected = hf_greedy(llama_ckpt.hf_model, PROMPT, N)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, FUZZ_IDENTITY)
    sock.connect(svc.url)
    sent: list[int] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(frame=frames)
    def throw(frame: bytes) -> None:
        sock.send(frame)
        sent.append(len(frame))
        if len(sent) % 50 == 0:
            drain(sock)
            assert svc._thread is not None and svc._thread.is_alive()

    try:
        with Client(svc.url, timeout=120) as client:
            rid = client.submit(PROMPT, SamplingParams(max_tokens=N, temperature=0.0,
                                                       ignore_eos=True))  # fmt: skip
            throw()
            during = client.result(rid)
        # Every frame has been handled once a probe sent after them is answered.
        sock.send(protocol.encode(GenerateRequest(PROTOCOL_VERSION, "probe", prompt_token_ids=[])))
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the probe was never answered"
            assert sock.poll(60_000)
            try:
                reply = protocol.decode(sock.recv())
            except protocol.ProtocolError:
                continue
            if isinstance(reply, ErrorReply) and reply.request_id == "probe":
                break
    finally:
        sock.close()
    assert len(sent) == EXAMPLES
    assert not failures, sorted(set(failures))[:10]
    assert during.token_ids == expected  # served while the frames arrived
    assert svc._thread.is_alive()
    assert svc.workers["w0"].poll() is None
    assert plane.workers == {"w0": worker}  # the same registration: nothing replaced it
    with Client(svc.url, timeout=120) as client:
        after = client.generate(PROMPT, SamplingParams(max_tokens=N, temperature=0.0,
                                                       ignore_eos=True))  # fmt: skip
    assert after.token_ids == expected
