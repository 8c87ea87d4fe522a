"""The client SDK against a scripted control plane on real ZeroMQ sockets.

`ScriptedServer` binds a real ROUTER socket on a free port and answers each message it receives
with whatever its script returns, recording every message, so each test can assert exactly what
the client sent and what it made of the replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import msgspec
import pytest
import zmq

from specserve.client import (
    AsyncClient,
    Client,
    Completion,
    RequestFailed,
    RequestTimeout,
    ServiceError,
)
from specserve.client import tombstones as client_tombstones
from specserve.client import wire as client_wire
from specserve.shared import protocol
from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    ErrorReply,
    GenerateRequest,
    Message,
    OutputBatch,
    RequestOutput,
    SamplingParams,
    SpecStats,
    TokenLogprobs,
)

Script = Callable[[Message], Sequence[Message | bytes]]
WAIT = 5.0  # seconds any single expected message may take


class ScriptedServer:
    """A scripted peer playing the control plane: a ROUTER socket served by a background thread.

    Every message received is recorded, then passed to `script`, whose return value (messages, or
    raw bytes for deliberately broken frames) is sent back to the client that sent it.
    """

    def __init__(self, script: Script) -> None:
        self._script = script
        self._received: queue.Queue[Message] = queue.Queue()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self.url = ""
        self._thread = threading.Thread(target=self._run, name="scripted-server", daemon=True)
        self._thread.start()
        assert self._ready.wait(WAIT), "the scripted server did not start"

    def next_message(self, timeout: float = WAIT) -> Message:
        return self._received.get(timeout=timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(WAIT)
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.ROUTER)
        socket.bind("tcp://127.0.0.1:*")
        self.url = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if socket.poll(20):
                    self._serve_one(socket)
        except BaseException as exc:  # surfaced by close(), in the test's thread
            self.error = exc
        finally:
            socket.close(linger=0)
            context.term()

    def _serve_one(self, socket: zmq.Socket) -> None:
        identity, payload = socket.recv_multipart()
        msg = protocol.decode(payload)
        self._received.put(msg)
        for reply in self._script(msg):
            frame = reply if isinstance(reply, bytes) else protocol.encode(reply)
            socket.send_multipart([identity, frame])


def silent(msg: Message) -> Sequence[Message | bytes]:
    return []


def on_generate(replies: Callable[[str], Sequence[Message | bytes]]) -> Script:
    """A script that answers each GenerateRequest with `replies(request_id)`."""
    return lambda msg: replies(msg.request_id) if isinstance(msg, GenerateRequest) else []


def output(request_id: str, token_ids: list[int], text: str | None = None, **kw) -> RequestOutput:
    return RequestOutput(
        version=PROTOCOL_VERSION, request_id=request_id, token_ids=token_ids, text=text, **kw
    )


LOGPROBS = TokenLogprobs(chosen=[-0.5], top_ids=[[108, 7]], top_logprobs=[[-0.5, -1.25]])
SPEC = SpecStats(num_drafts=2, num_draft_tokens=4, num_accepted_tokens=3, accepted_counts=[0, 1, 1])


def three_outputs(request_id: str) -> list[RequestOutput]:
    """A streamed request: first output with the admission facts, last with the finish."""
    return [
        output(
            request_id,
            [72, 101],
            "He",
            prompt_token_ids=[1, 2, 3],
            num_cached_tokens=2,
            worker_id="w0",
        ),
        output(request_id, [108], "l", logprobs=[LOGPROBS]),
        output(request_id, [108, 111], "lo", finished=True, finish_reason="length", spec=SPEC),
    ]


def three_outputs_folded(request_id: str) -> Completion:
    return Completion(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        token_ids=[72, 101, 108, 108, 111],
        text="Hello",
        finish_reason="length",
        logprobs=[LOGPROBS],
        num_cached_tokens=2,
        worker_id="w0",
        spec=SPEC,
    )


def echo(request: GenerateRequest, step: int) -> RequestOutput:
    """Output `step` (of two) of a request whose prompt is one token `n`: tokens 10n and 10n+1."""
    n = request.prompt_token_ids[0]
    return output(
        request.request_id,
        [10 * n + step],
        f"{n}{'ab'[step]}",
        finished=step == 1,
        finish_reason="stop" if step == 1 else None,
    )


def echoed(request_id: str, n: int) -> Completion:
    return Completion(
        request_id, token_ids=[10 * n, 10 * n + 1], text=f"{n}a{n}b", finish_reason="stop"
    )


class Interleaved:
    """Script: hold requests until `n` have arrived, then answer them round-robin, newest first,
    so every request's outputs arrive between the other requests' outputs. `batched`: each
    round in one `OutputBatch`, as the control plane sends a step's outputs for one client."""

    def __init__(self, n: int, batched: bool = False) -> None:
        self.n = n
        self.batched = batched
        self.waiting: list[GenerateRequest] = []

    def __call__(self, msg: Message) -> Sequence[Message | bytes]:
        if not isinstance(msg, GenerateRequest):
            return []
        self.waiting.append(msg)
        if len(self.waiting) < self.n:
            return []
        batch, self.waiting = self.waiting[::-1], []
        rounds = [[echo(request, step) for request in batch] for step in range(2)]
        if self.batched:
            return [OutputBatch(PROTOCOL_VERSION, outputs) for outputs in rounds]
        return [output for outputs in rounds for output in outputs]


@pytest.fixture
def serve() -> Iterator[Callable[[Script], ScriptedServer]]:
    servers: list[ScriptedServer] = []

    def start(script: Script = silent) -> ScriptedServer:
        servers.append(ScriptedServer(script))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def abort(request_id: str) -> AbortRequest:
    return AbortRequest(version=PROTOCOL_VERSION, request_id=request_id)


# -- what the client sends ---------------------------------------------------------------------


def test_submit_sends_exact_generate_requests(serve) -> None:
    server = serve(silent)
    sampling = SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(7,))
    with Client(server.url, timeout=WAIT) as client:
        rid = client.submit(
            "hello",
            sampling,
            chat=True,
            request_id="r1",
            cache_salt="tenant-a",
            priority=3,
            stream=False,
        )
        assert rid == "r1"
        assert server.next_message() == GenerateRequest(
            version=PROTOCOL_VERSION,
            request_id="r1",
            prompt="hello",
            sampling=sampling,
            chat=True,
            stream=False,
            cache_salt="tenant-a",
            priority=3,
        )
        rid = client.submit((5, 6, 7))
        assert re.fullmatch(r"[0-9a-f]{32}", rid)
        assert server.next_message() == GenerateRequest(
            version=PROTOCOL_VERSION, request_id=rid, prompt_token_ids=[5, 6, 7]
        )
    # Closing with both requests in flight aborts them.
    assert {server.next_message(), server.next_message()} == {abort("r1"), abort(rid)}


def test_invalid_sampling_raises_and_sends_nothing(serve) -> None:
    server = serve(on_generate(three_outputs))
    bad = SamplingParams(temperature=-1)
    with Client(server.url, timeout=WAIT) as client:
        with pytest.raises(ValueError, match="temperature"):
            client.generate([1, 2, 3], bad)
        with pytest.raises(ValueError, match="temperature"):
            client.stream([1, 2, 3], bad)
        with pytest.raises(ValueError, match="temperature"):
            client.submit([1, 2, 3], bad)
        with pytest.raises(ValueError, match="empty"):
            client.submit([])
        assert client.generate([1, 2, 3], request_id="ok") == three_outputs_folded("ok")
    # One DEALER connection keeps order: had anything been sent before, it would come first.
    assert server.next_message().request_id == "ok"


# -- what the client makes of the replies ------------------------------------------------------


def test_stream_yields_the_scripted_outputs_in_order(serve) -> None:
    server = serve(on_generate(three_outputs))
    with Client(server.url, timeout=WAIT) as client:
        assert list(client.stream([1, 2, 3], request_id="s1")) == three_outputs("s1")
    sent = server.next_message()
    assert isinstance(sent, GenerateRequest)
    assert sent.stream is True


def test_generate_folds_the_outputs_into_one_completion(serve) -> None:
    server = serve(on_generate(three_outputs))
    with Client(server.url, timeout=WAIT) as client:
        assert client.generate([1, 2, 3], request_id="g1") == three_outputs_folded("g1")
    sent = server.next_message()
    assert isinstance(sent, GenerateRequest)
    assert sent.stream is False


@pytest.mark.parametrize("batched", [False, True], ids=["one per frame", "batched"])
def test_interleaved_outputs_reach_their_own_requests(serve, batched: bool) -> None:
    server = serve(Interleaved(2, batched))
    with Client(server.url, timeout=WAIT) as client:
        first = client.submit([1])
        second = client.submit([2])
        # The second request's outputs arrive around the first's and wait in its buffer.
        assert client.result(first) == echoed(first, 1)
        assert client.result(second) == echoed(second, 2)


def test_error_reply_raises_request_failed(serve) -> None:
    def refuse(request_id: str) -> list[Message]:
        return [
            ErrorReply(version=PROTOCOL_VERSION, message="queue is full", request_id=request_id)
        ]

    server = serve(on_generate(refuse))
    with Client(server.url, timeout=WAIT) as client:
        with pytest.raises(RequestFailed, match="queue is full") as info:
            client.generate([1], request_id="e1")
        assert info.value.request_id == "e1"
        with pytest.raises(RequestFailed, match="queue is full"):
            next(client.stream([1], request_id="e2"))


def test_error_finish_raises_request_failed(serve) -> None:
    def fail(request_id: str) -> list[Message]:
        return [
            output(request_id, [5], "x", prompt_token_ids=[1], worker_id="w0"),
            output(request_id, [], finished=True, finish_reason="error", error="worker w0 lost"),
        ]

    server = serve(on_generate(fail))
    with Client(server.url, timeout=WAIT) as client:
        with pytest.raises(RequestFailed, match="worker w0 lost") as info:
            client.generate([1], request_id="f1")
        assert info.value.request_id == "f1"


def test_timeout_raises_and_aborts_the_request(serve) -> None:
    server = serve(silent)
    with Client(server.url, timeout=WAIT) as client:
        with pytest.raises(RequestTimeout) as info:
            client.generate([1], request_id="t1", timeout=0.2)
        assert info.value.request_id == "t1"
        assert server.next_message().request_id == "t1"
        assert server.next_message() == abort("t1")


def test_closing_a_stream_early_aborts_the_request(serve) -> None:
    server = serve(on_generate(three_outputs))
    with Client(server.url, timeout=WAIT) as client:
        outputs = client.stream([1, 2, 3], request_id="c1")
        assert next(outputs) == three_outputs("c1")[0]
        outputs.close()
        assert server.next_message().request_id == "c1"
        assert server.next_message() == abort("c1")
        # The rest of c1's outputs are dropped; the client goes on serving new requests.
        assert client.generate([1, 2, 3], request_id="c2") == three_outputs_folded("c2")


def test_undecodable_frames_are_logged_and_skipped(serve, monkeypatch) -> None:
    events: list[tuple[str, str]] = []

    class Recorder:
        def __getattr__(self, level: str) -> Callable[..., None]:
            return lambda event, **fields: events.append((level, event))

    monkeypatch.setattr(client_wire, "log", Recorder())
    future_version = msgspec.msgpack.encode({"type": "output", "version": 99, "request_id": "x"})

    def garbage_first(request_id: str) -> list[Message | bytes]:
        return [
            b"\xc1 not msgpack",
            future_version,
            ErrorReply(version=PROTOCOL_VERSION, message="could not decode"),
            output("someone-else", [9], finished=True, finish_reason="stop"),
            *three_outputs(request_id),
        ]

    server = serve(on_generate(garbage_first))
    with Client(server.url, timeout=WAIT) as client:
        assert client.generate([1, 2, 3], request_id="j1") == three_outputs_folded("j1")
    assert events[:3] == [
        ("warning", "client.frame.undecodable"),
        ("warning", "client.frame.undecodable"),
        ("warning", "client.server_error"),
    ]


# -- AsyncClient -------------------------------------------------------------------------------


@pytest.mark.parametrize("batched", [False, True], ids=["one per frame", "batched"])
def test_async_interleaved_outputs_reach_their_own_requests(serve, batched: bool) -> None:
    server = serve(Interleaved(2, batched))

    async def main() -> None:
        async with AsyncClient(server.url, timeout=WAIT) as client:
            first = await client.submit([1])
            second = await client.submit([2])
            assert await asyncio.gather(client.result(second), client.result(first)) == [
                echoed(second, 2),
                echoed(first, 1),
            ]

    asyncio.run(main())


def test_async_sixteen_concurrent_generates(serve) -> None:
    server = serve(Interleaved(16))

    async def main() -> None:
        async with AsyncClient(server.url, timeout=WAIT) as client:
            ids = [f"a{n}" for n in range(1, 17)]
            results = await asyncio.gather(
                *(client.generate([n], request_id=rid) for n, rid in enumerate(ids, start=1))
            )
            assert results == [echoed(rid, n) for n, rid in enumerate(ids, start=1)]

    asyncio.run(main())
    received = [server.next_message() for _ in range(16)]
    assert all(isinstance(msg, GenerateRequest) and not msg.stream for msg in received)


def test_async_stream_failures_timeout_and_early_close(serve) -> None:
    def script(msg: Message) -> Sequence[Message | bytes]:
        if not isinstance(msg, GenerateRequest):
            return []
        if msg.request_id.startswith("refuse"):
            return [ErrorReply(version=PROTOCOL_VERSION, message="too long", request_id="refuse")]
        return [] if msg.request_id.startswith("hang") else three_outputs(msg.request_id)

    server = serve(script)

    async def main() -> None:
        async with AsyncClient(server.url, timeout=WAIT) as client:
            assert [out async for out in client.stream([1, 2, 3], request_id="s")] == (
                three_outputs("s")
            )
            with pytest.raises(ValueError, match="temperature"):
                await client.generate([1], SamplingParams(temperature=-1))
            with pytest.raises(RequestFailed, match="too long"):
                await client.generate([1], request_id="refuse")
            with pytest.raises(RequestTimeout):
                await client.generate([1], request_id="hang", timeout=0.2)
            async with contextlib.aclosing(client.stream([1, 2, 3], request_id="c")) as outputs:
                async for out in outputs:
                    assert out == three_outputs("c")[0]
                    break

    asyncio.run(main())
    assert [server.next_message() for _ in range(6)] == [
        server_view("s", [1, 2, 3]),
        server_view("refuse", [1], stream=False),
        server_view("hang", [1], stream=False),
        abort("hang"),
        server_view("c", [1, 2, 3]),
        abort("c"),
    ]


def test_closing_an_async_client_fails_every_stream_in_flight_even_as_aborts_are_answered(
    serve,
) -> None:
    """Each abort the closing client sends is answered at once with its request's last output
    (finish_reason "abort"); none of them may end a stream as if it had finished."""

    def script(msg: Message) -> Sequence[Message | bytes]:
        if isinstance(msg, AbortRequest):
            return [output(msg.request_id, [], finished=True, finish_reason="abort")]
        return three_outputs(msg.request_id)[:1]

    server = serve(script)
    streams = 64

    async def first_then_rest(client: AsyncClient, request_id: str) -> BaseException:
        outputs = client.stream([1, 2, 3], request_id=request_id)
        assert await anext(outputs) == three_outputs(request_id)[0]
        waiting.append(request_id)
        try:
            async for out in outputs:
                return AssertionError(f"{request_id} went on after the close: {out}")
        except ServiceError as exc:
            return exc
        return AssertionError(f"{request_id} ended as if it had finished")

    async def main() -> list[BaseException]:
        client = AsyncClient(server.url, timeout=WAIT)
        tasks = [asyncio.ensure_future(first_then_rest(client, f"r{i}")) for i in range(streams)]
        while len(waiting) < streams:  # every stream holds its first output and waits for more
            await asyncio.sleep(0.01)
        await client.close()
        return await asyncio.gather(*tasks)

    waiting: list[str] = []
    ended = asyncio.run(main())
    assert [str(e) for e in ended] == ["the client is closed"] * streams
    received = [server.next_message() for _ in range(2 * streams)]
    aborted = [m.request_id for m in received if isinstance(m, AbortRequest)]
    assert sorted(aborted) == sorted(f"r{i}" for i in range(streams))


def test_an_async_stream_whose_outputs_stop_times_out_at_its_deadline_and_is_aborted(
    serve,
) -> None:
    """A stream's waits between outputs share one wake-up at the request's deadline."""
    server = serve(
        lambda msg: three_outputs(msg.request_id)[:1] if isinstance(msg, GenerateRequest) else []
    )

    async def main() -> float:
        async with AsyncClient(server.url, timeout=WAIT) as client:
            got = []
            started = time.monotonic()
            with pytest.raises(RequestTimeout, match="slow"):
                async for out in client.stream([1], request_id="slow", timeout=0.5):
                    got.append(out)
            assert got == three_outputs("slow")[:1]
            return time.monotonic() - started

    assert 0.5 <= asyncio.run(asyncio.wait_for(main(), 2 * WAIT)) < WAIT
    assert [server.next_message() for _ in range(2)] == [server_view("slow", [1]), abort("slow")]


def server_view(request_id: str, prompt: list[int], stream: bool = True) -> GenerateRequest:
    """The GenerateRequest the server receives for a request with default sampling."""
    return GenerateRequest(
        version=PROTOCOL_VERSION, request_id=request_id, prompt_token_ids=prompt, stream=stream
    )


# -- retrying an aborted request under the same id ---------------------------------------------


class AbortConfirming:
    """Script playing the control plane for retries: the first GenerateRequest of an id hangs
    (nothing comes back), an AbortRequest of a request it holds is answered with a late token and
    the final output (finish_reason "abort"), and every later GenerateRequest of the id gets
    `three_outputs`. With `answer_aborts=False` it acts as if it no longer held the request."""

    def __init__(self, answer_aborts: bool = True) -> None:
        self.answer_aborts = answer_aborts
        self.held: set[str] = set()
        self.seen: set[str] = set()

    def __call__(self, msg: Message) -> Sequence[Message | bytes]:
        if isinstance(msg, AbortRequest):
            if msg.request_id not in self.held or not self.answer_aborts:
                return []
            self.held.discard(msg.request_id)
            return [
                output(msg.request_id, [99], "?"),
                output(msg.request_id, [], finished=True, finish_reason="abort"),
            ]
        assert isinstance(msg, GenerateRequest)
        if msg.request_id in self.seen:
            return three_outputs(msg.request_id)
        self.seen.add(msg.request_id)
        self.held.add(msg.request_id)
        return []


def test_retry_after_a_timeout_gets_its_own_tokens(serve) -> None:
    server = serve(AbortConfirming())
    with Client(server.url, timeout=WAIT) as client:
        with pytest.raises(RequestTimeout):
            client.generate([1, 2, 3], request_id="job-1", timeout=0.2)
        # The old request's abort is confirmed only now; the retry must not take it for its own.
        assert client.generate([1, 2, 3], request_id="job-1", timeout=WAIT) == (
            three_outputs_folded("job-1")
        )
        assert list(client._tombstones) == []
    assert [server.next_message() for _ in range(3)] == [
        server_view("job-1", [1, 2, 3], stream=False),
        abort("job-1"),
        server_view("job-1", [1, 2, 3], stream=False),
    ]


def test_retry_after_an_early_closed_stream_gets_only_its_own_outputs(serve) -> None:
    attempts: list[int] = []

    def script(msg: Message) -> Sequence[Message | bytes]:
        if not isinstance(msg, GenerateRequest):
            return []  # the request has finished: an abort gets no answer
        attempts.append(len(attempts))
        return [output(msg.request_id, [len(attempts)], finished=n == 2) for n in range(3)]

    server = serve(script)
    with Client(server.url, timeout=WAIT) as client:
        outputs = client.stream([1], request_id="s1")
        assert next(outputs).token_ids == [1]
        outputs.close()
        again = list(client.stream([1], request_id="s1"))
        assert [out.token_ids for out in again] == [[2], [2], [2]]
        assert list(client._tombstones) == []
    assert [type(server.next_message()) for _ in range(3)] == [
        GenerateRequest,
        AbortRequest,
        GenerateRequest,
    ]


def test_unanswered_abort_expires_and_bounds_the_retry(serve, monkeypatch) -> None:
    monkeypatch.setattr(client_tombstones, "TOMBSTONE_TTL_S", 0.5)
    server = serve(AbortConfirming(answer_aborts=False))
    with Client(server.url, timeout=WAIT) as client:
        with pytest.raises(RequestTimeout):
            client.generate([1], request_id="x1", timeout=0.1)
        assert list(client._tombstones) == ["x1"]
        # A retry whose timeout ends first sends nothing.
        with pytest.raises(RequestTimeout, match="was not sent") as info:
            client.submit([1], request_id="x1", timeout=0.05)
        assert info.value.request_id == "x1"
        # Once the tombstone expires, the retry goes out and is served.
        start = time.monotonic()
        assert client.generate([1, 2, 3], request_id="x1") == three_outputs_folded("x1")
        assert 0.2 < time.monotonic() - start < WAIT
        assert list(client._tombstones) == []
    assert [server.next_message() for _ in range(3)] == [
        server_view("x1", [1], stream=False),
        abort("x1"),
        server_view("x1", [1, 2, 3], stream=False),
    ]
    with pytest.raises(queue.Empty):
        server.next_message(timeout=0.1)


def test_async_retry_after_a_timeout_gets_its_own_tokens(serve) -> None:
    server = serve(AbortConfirming())

    async def main() -> None:
        async with AsyncClient(server.url, timeout=WAIT) as client:
            with pytest.raises(RequestTimeout):
                await client.generate([1, 2, 3], request_id="job-1", timeout=0.2)
            assert await client.generate([1, 2, 3], request_id="job-1") == (
                three_outputs_folded("job-1")
            )
            # An early-closed stream is retried the same way.
            async with contextlib.aclosing(client.stream([1], request_id="job-2")) as outputs:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.2):
                        await anext(outputs)
            assert [out async for out in client.stream([1, 2, 3], request_id="job-2")] == (
                three_outputs("job-2")
            )
            assert list(client._tombstones) == []

    asyncio.run(main())
    assert [server.next_message() for _ in range(6)] == [
        server_view("job-1", [1, 2, 3], stream=False),
        abort("job-1"),
        server_view("job-1", [1, 2, 3], stream=False),
        server_view("job-2", [1]),
        abort("job-2"),
        server_view("job-2", [1, 2, 3]),
    ]


def test_async_unanswered_abort_expires(serve, monkeypatch) -> None:
    monkeypatch.setattr(client_tombstones, "TOMBSTONE_TTL_S", 0.5)
    server = serve(AbortConfirming(answer_aborts=False))

    async def main() -> None:
        async with AsyncClient(server.url, timeout=WAIT) as client:
            with pytest.raises(RequestTimeout):
                await client.generate([1], request_id="x1", timeout=0.1)
            with pytest.raises(RequestTimeout, match="was not sent"):
                await client.generate([1], request_id="x1", timeout=0.05)
            loop = asyncio.get_running_loop()
            start = loop.time()
            assert await client.generate([1, 2, 3], request_id="x1") == (three_outputs_folded("x1"))
            assert 0.2 < loop.time() - start < WAIT
            assert list(client._tombstones) == []

    asyncio.run(main())
    assert [server.next_message() for _ in range(3)] == [
        server_view("x1", [1], stream=False),
        abort("x1"),
        server_view("x1", [1, 2, 3], stream=False),
    ]
