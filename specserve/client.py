"""The client SDK: send requests to a running specserve control plane over ZeroMQ.

The control plane listens on one ROUTER socket; a client connects a DEALER socket to it and speaks
the versioned msgspec messages of `specserve.shared.protocol`: `GenerateRequest`/`AbortRequest`
out, `RequestOutput`/`ErrorReply` back. Outputs of many requests share the socket, so both clients
demultiplex them by request id: `Client` in the calling thread, `AsyncClient` in one background
receive task feeding per-request queues.

A request the client gives up on (a timeout, a stream closed early, an interrupted `generate`) is
aborted, and its id is kept as a tombstone until the control plane's final output for it (finish
reason "abort") arrives: every output for a tombstoned id is dropped, and a new request that
reuses the id is held back until the tombstone clears, so a retry under the same id never
receives the old request's outputs. The control plane answers each abort of a request it still
holds with that final output and stays silent otherwise, so tombstones also expire after
`TOMBSTONE_TTL_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import structlog
import zmq
import zmq.asyncio

from specserve.shared import protocol
from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    ErrorReply,
    GenerateRequest,
    ProtocolError,
    RequestOutput,
    SamplingParams,
    SpecStats,
    TokenLogprobs,
)

log = structlog.get_logger(__name__)

Prompt = str | Sequence[int]
Reply = RequestOutput | ErrorReply

DEFAULT_URL = "tcp://127.0.0.1:5555"
DEFAULT_TIMEOUT = 120.0
# On close, queued messages (the aborts of unfinished requests) get this long to leave.
CLOSE_LINGER_MS = 500
# How long an aborted request's id waits for the control plane's final output before it is
# forgotten (the control plane sends none for a request it no longer holds).
TOMBSTONE_TTL_S = 30.0


class ServiceError(Exception):
    """The control plane could not serve a request (or the client can no longer talk to it)."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class RequestTimeout(ServiceError):
    """The request did not finish in time; the client has asked the control plane to abort it.

    Also raised, with nothing sent, when the call's timeout ran out while an earlier request with
    the same id was still being aborted (see `Client`).
    """


class RequestFailed(ServiceError):
    """The control plane refused the request (`ErrorReply`) or it finished with an error."""


@dataclass
class Completion:
    """The result of a whole request: every output of it folded together."""

    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None  # None when the control plane has no tokenizer
    finish_reason: str | None = None  # stop | length | abort
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int | None = None
    worker_id: str | None = None  # the worker that served the request last
    spec: SpecStats | None = None

    def add(self, output: RequestOutput) -> None:
        """Fold in one output: streamed outputs carry only their new tokens, so they append."""
        self.token_ids.extend(output.token_ids)
        if output.text is not None:
            self.text = (self.text or "") + output.text
        if output.logprobs is not None:
            self.logprobs.extend(output.logprobs)
        if output.prompt_token_ids is not None:
            self.prompt_token_ids = list(output.prompt_token_ids)
        if output.num_cached_tokens is not None and self.num_cached_tokens is None:
            self.num_cached_tokens = output.num_cached_tokens
        if output.worker_id is not None:  # a resumed request may move to another worker
            self.worker_id = output.worker_id
        if output.spec is not None:
            self.spec = output.spec
        if output.finished:
            self.finish_reason = output.finish_reason


def build_request(
    prompt: Prompt,
    sampling: SamplingParams | None,
    *,
    chat: bool,
    request_id: str | None,
    cache_salt: str | None,
    priority: int,
    stream: bool,
) -> GenerateRequest:
    """The `GenerateRequest` to send; raises ValueError (before anything is sent) on bad input."""
    sampling = sampling if sampling is not None else SamplingParams()
    sampling.validate()
    if request_id is None:
        request_id = uuid.uuid4().hex
    elif not request_id:
        raise ValueError("request_id must not be empty")
    text, token_ids = _split_prompt(prompt)
    return GenerateRequest(
        version=PROTOCOL_VERSION,
        request_id=request_id,
        prompt=text,
        prompt_token_ids=token_ids,
        sampling=sampling,
        chat=chat,
        stream=stream,
        cache_salt=cache_salt,
        priority=priority,
    )


def _split_prompt(prompt: Prompt) -> tuple[str | None, list[int] | None]:
    """Text goes as `prompt`, token ids as `prompt_token_ids`."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, bytes | bytearray):
        raise TypeError("prompt must be a str or a sequence of token ids, not bytes")
    token_ids = [int(t) for t in prompt]
    if not token_ids:
        raise ValueError("prompt_token_ids must not be empty")
    return None, token_ids


def parse_reply(frames: list[bytes]) -> Reply | None:
    """Decode one message from the control plane; None (logged) for anything no request awaits."""
    try:
        msg = protocol.decode(frames[-1])  # the payload is the last frame, delimiter or not
    except ProtocolError as exc:
        log.warning("client.frame.undecodable", error=str(exc), size=len(frames[-1]))
        return None
    if isinstance(msg, ErrorReply) and msg.request_id is None:
        # About a frame the control plane could not decode: no request of ours to fail.
        log.warning("client.server_error", message=msg.message)
        return None
    if not isinstance(msg, RequestOutput | ErrorReply):
        log.warning("client.frame.unexpected", type=type(msg).__name__)
        return None
    return msg


def check_reply(reply: Reply) -> RequestOutput:
    """The output itself, or RequestFailed when the request was refused or ended in an error."""
    if isinstance(reply, ErrorReply):
        raise RequestFailed(
            f"request {reply.request_id} refused: {reply.message}", reply.request_id
        )
    if reply.finished and reply.finish_reason == "error":
        error = reply.error or "unknown error"
        raise RequestFailed(f"request {reply.request_id} failed: {error}", reply.request_id)
    return reply


def _ends_request(reply: Reply) -> bool:
    return isinstance(reply, ErrorReply) or reply.finished


def _resolve_timeout(timeout: float | None, default: float | None) -> float | None:
    """A call's timeout in seconds: its own, else the client's; None or inf waits without limit."""
    chosen = default if timeout is None else timeout
    if chosen is None or math.isinf(chosen):
        return None
    if chosen < 0:
        raise ValueError(f"timeout must be >= 0, got {chosen}")
    return chosen


def _timeout_error(request_id: str, timeout: float) -> RequestTimeout:
    return RequestTimeout(f"request {request_id} did not finish within {timeout:g} s", request_id)


def _abort_message(request_id: str) -> bytes:
    return protocol.encode(AbortRequest(version=PROTOCOL_VERSION, request_id=request_id))


def _tombstoned_error(request_id: str, timeout: float) -> RequestTimeout:
    return RequestTimeout(
        f"request {request_id} was not sent: an earlier request with this id was still being "
        f"aborted after {timeout:g} s",
        request_id,
    )


class _Tombstones:
    """Ids of requests this client aborted whose final output has not arrived yet: id -> when to
    forget it. Every tombstone lives as long, so insertion order is expiry order and expiring
    visits only the dict's expired head. `on_clear` hears of every id that leaves."""

    def __init__(self, on_clear: Callable[[str], None] | None = None) -> None:
        self._expiry: dict[str, float] = {}
        self._on_clear = on_clear

    def __iter__(self) -> Iterator[str]:
        return iter(self._expiry)

    def expiry(self, request_id: str, now: float) -> float | None:
        """When the id's tombstone expires; None when it has none (expired ones are dropped)."""
        self.expire(now)
        return self._expiry.get(request_id)

    def add(self, request_id: str, now: float) -> None:
        self.expire(now)
        self._expiry.pop(request_id, None)  # re-inserted at the end: keeps expiry order
        self._expiry[request_id] = now + TOMBSTONE_TTL_S

    def expire(self, now: float) -> None:
        expired = []
        for request_id, expiry in self._expiry.items():
            if expiry > now:
                break
            expired.append(request_id)
        for request_id in expired:
            self._clear(request_id)

    def swallow(self, reply: Reply) -> bool:
        """True when the reply is the tail of a request we aborted (its final one clears it)."""
        if reply.request_id not in self._expiry:
            return False
        if _ends_request(reply):
            self._clear(reply.request_id)
        log.debug("client.reply.aborted", request_id=reply.request_id)
        return True

    def clear_all(self) -> None:
        for request_id in list(self._expiry):
            self._clear(request_id)

    def _clear(self, request_id: str) -> None:
        del self._expiry[request_id]
        if self._on_clear is not None:
            self._on_clear(request_id)


class Client:
    """Synchronous client on one DEALER socket, for one thread (it is not thread-safe).

    While it waits for one request, outputs of the others it has submitted are buffered, so many
    requests can be submitted at once and collected one by one with `result`. A request that times
    out, or whose stream is closed early, is aborted so that the control plane frees it.

    Retrying such a request under the same `request_id` is safe: until the control plane has
    confirmed the abort with the old request's final output (or `TOMBSTONE_TTL_S` has passed), the
    new request is not sent; `generate`, `stream` and `submit` wait for that (receiving and
    buffering other requests' outputs meanwhile) within their timeout, and raise `RequestTimeout`,
    having sent nothing, if it does not come in time. The old request's outputs are dropped.
    """

    def __init__(self, url: str = DEFAULT_URL, timeout: float | None = DEFAULT_TIMEOUT) -> None:
        self.url = url
        self.timeout = timeout
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.connect(url)
        # Replies of each unfinished request, in arrival order, until the caller takes them.
        self._pending: dict[str, deque[Reply]] = {}
        self._tombstones = _Tombstones()
        self._closed = False

    def generate(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        chat: bool = False,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
    ) -> Completion:
        """Run one request to the end. Not streamed: the control plane sends a single output.

        `timeout` bounds the whole call, including any wait for an earlier request with the same
        id to finish aborting (see the class docstring).
        """
        request = build_request(
            prompt,
            sampling,
            chat=chat,
            request_id=request_id,
            cache_salt=cache_salt,
            priority=priority,
            stream=False,
        )
        limit = _resolve_timeout(timeout, self.timeout)
        deadline = None if limit is None else time.monotonic() + limit
        self._send_request(request, deadline, limit)
        try:
            return self._collect(request.request_id, deadline, limit)
        except BaseException:  # e.g. KeyboardInterrupt: nobody will collect it, so free it
            if request.request_id in self._pending:
                self._forget_and_abort(request.request_id)
            raise

    def stream(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        chat: bool = False,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield each output (its new tokens) as it arrives; closing the iterator early aborts.

        The arguments are checked at once; the request is sent when iteration starts. `timeout`
        bounds the whole request, including any wait for an earlier request with the same id to
        finish aborting (see the class docstring).
        """
        request = build_request(
            prompt,
            sampling,
            chat=chat,
            request_id=request_id,
            cache_salt=cache_salt,
            priority=priority,
            stream=True,
        )
        return self._stream(request, _resolve_timeout(timeout, self.timeout))

    def submit(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        chat: bool = False,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        stream: bool = True,
        timeout: float | None = None,
    ) -> str:
        """Send a request and return its id; collect it with `result`.

        It returns at once, unless an earlier request with the same id is still being aborted:
        then it waits for that first, for up to `timeout` (see the class docstring).
        """
        request = build_request(
            prompt,
            sampling,
            chat=chat,
            request_id=request_id,
            cache_salt=cache_salt,
            priority=priority,
            stream=stream,
        )
        limit = _resolve_timeout(timeout, self.timeout)
        deadline = None if limit is None else time.monotonic() + limit
        self._send_request(request, deadline, limit)
        return request.request_id

    def result(self, request_id: str, timeout: float | None = None) -> Completion:
        """Wait for a submitted request to finish and return all of it."""
        limit = _resolve_timeout(timeout, self.timeout)
        deadline = None if limit is None else time.monotonic() + limit
        return self._collect(request_id, deadline, limit)

    def _collect(self, request_id: str, deadline: float | None, limit: float | None) -> Completion:
        completion = Completion(request_id)
        while True:
            output = self._next(request_id, deadline, limit)
            completion.add(output)
            if output.finished:
                return completion

    def abort(self, request_id: str) -> None:
        """Ask the control plane to stop a request. A submitted request stays collectable: its
        last output (finish_reason "abort", unless it had already finished) ends `result`."""
        self._send(_abort_message(request_id))

    def close(self) -> None:
        """Abort the requests still in flight and release the socket."""
        if self._closed:
            return
        for request_id in self._pending:
            self._send(_abort_message(request_id))
        self._pending.clear()
        self._tombstones.clear_all()
        self._closed = True
        self._socket.close(linger=CLOSE_LINGER_MS)
        self._context.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _stream(self, request: GenerateRequest, limit: float | None) -> Iterator[RequestOutput]:
        request_id = request.request_id
        deadline = None if limit is None else time.monotonic() + limit
        self._send_request(request, deadline, limit)
        try:
            while True:
                output = self._next(request_id, deadline, limit)
                yield output
                if output.finished:
                    return
        finally:
            if request_id in self._pending:  # left before the end: free it on the server
                self._forget_and_abort(request_id)

    def _send_request(
        self, request: GenerateRequest, deadline: float | None, limit: float | None
    ) -> None:
        if request.request_id in self._pending:
            raise ValueError(f"request {request.request_id} is already in flight")
        frame = protocol.encode(request)
        self._check_open()
        self._await_tombstone(request.request_id, deadline, limit)
        self._pending[request.request_id] = deque()
        self._send(frame)

    def _await_tombstone(
        self, request_id: str, deadline: float | None, limit: float | None
    ) -> None:
        """Receive until an earlier, aborted request with this id is confirmed gone (or its
        tombstone expires); RequestTimeout at `deadline`."""
        while True:
            now = time.monotonic()
            expiry = self._tombstones.expiry(request_id, now)
            if expiry is None:
                return
            if deadline is not None and now >= deadline:
                raise _tombstoned_error(request_id, limit or 0.0)
            self._receive((expiry if deadline is None else min(expiry, deadline)) - now)

    def _next(self, request_id: str, deadline: float | None, limit: float | None) -> RequestOutput:
        """The request's next output, receiving (and buffering others' replies) until it comes."""
        self._check_open()
        buffer = self._pending.get(request_id)
        if buffer is None:
            raise KeyError(f"request {request_id} is not in flight on this client")
        while not buffer:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                self._forget_and_abort(request_id)
                raise _timeout_error(request_id, limit or 0.0)
            self._receive(remaining)
        reply = buffer.popleft()
        if _ends_request(reply):
            del self._pending[request_id]
        return check_reply(reply)

    def _receive(self, timeout: float | None) -> None:
        """Wait up to `timeout` seconds for one message and file it under its request."""
        self._check_open()
        timeout_ms = None if timeout is None else max(1, math.ceil(timeout * 1000))
        if not self._socket.poll(timeout_ms, zmq.POLLIN):
            return
        reply = parse_reply(self._socket.recv_multipart())
        if reply is None:
            return
        if self._tombstones.swallow(reply):
            return
        buffer = self._pending.get(reply.request_id)
        if buffer is None:  # e.g. the tail of an aborted request whose tombstone expired
            log.debug("client.reply.unclaimed", request_id=reply.request_id)
            return
        buffer.append(reply)

    def _forget_and_abort(self, request_id: str) -> None:
        """Stop waiting for a request and abort it, leaving a tombstone for its final output."""
        buffer = self._pending.pop(request_id, None)
        if self._closed:
            return
        # A request whose last reply is already here has finished: nothing more will come.
        if buffer is None or not any(_ends_request(reply) for reply in buffer):
            self._tombstones.add(request_id, time.monotonic())
        self._send(_abort_message(request_id))

    def _send(self, frame: bytes) -> None:
        self._check_open()
        self._socket.send(frame)

    def _check_open(self) -> None:
        if self._closed:
            raise ServiceError("the client is closed")


class AsyncClient:
    """asyncio client: many concurrent requests on one DEALER socket.

    One background task receives every message and puts it on its request's queue. Close a
    `stream` that is left early with `contextlib.aclosing` (or `aclose()`) so that its abort is
    sent at once rather than when the iterator is garbage-collected.

    As with `Client`, reusing the id of a request this client aborted is safe: the new request is
    held back (within its call's timeout, else `RequestTimeout` with nothing sent) until the
    control plane has confirmed the abort with the old request's final output, or until
    `TOMBSTONE_TTL_S` has passed; the old request's outputs are dropped.
    """

    def __init__(self, url: str = DEFAULT_URL, timeout: float | None = DEFAULT_TIMEOUT) -> None:
        self.url = url
        self.timeout = timeout
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.connect(url)
        # Replies of each unfinished request; a ServiceError item wakes its waiter with an error.
        self._queues: dict[str, asyncio.Queue[Reply | ServiceError]] = {}
        # Ids whose last reply sits in their queue, not yet taken: an abort of one gets no answer.
        self._ended: set[str] = set()
        # Aborted ids (in loop time), and the events that wake a new request waiting to reuse one.
        self._tombstone_cleared: dict[str, asyncio.Event] = {}
        self._tombstones = _Tombstones(on_clear=self._wake_reuser)
        self._receiver: asyncio.Task[None] | None = None
        self._closed = False

    async def generate(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        chat: bool = False,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
    ) -> Completion:
        """Run one request to the end. Not streamed: the control plane sends a single output.

        `timeout` bounds the whole call, including any wait for an earlier request with the same
        id to finish aborting (see the class docstring).
        """
        request = build_request(
            prompt,
            sampling,
            chat=chat,
            request_id=request_id,
            cache_salt=cache_salt,
            priority=priority,
            stream=False,
        )
        limit = _resolve_timeout(timeout, self.timeout)
        deadline = None if limit is None else asyncio.get_running_loop().time() + limit
        await self._send_request(request, deadline, limit)
        try:
            return await self._collect(request.request_id, deadline, limit)
        except BaseException:  # e.g. cancelled: nobody will collect it, so free it
            if request.request_id in self._queues:
                await self._forget_and_abort(request.request_id)
            raise

    def stream(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        chat: bool = False,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield each output (its new tokens) as it arrives; closing the iterator early aborts.

        The arguments are checked at once; the request is sent when iteration starts. `timeout`
        bounds the whole request, including any wait for an earlier request with the same id to
        finish aborting (see the class docstring).
        """
        request = build_request(
            prompt,
            sampling,
            chat=chat,
            request_id=request_id,
            cache_salt=cache_salt,
            priority=priority,
            stream=True,
        )
        return self._stream(request, _resolve_timeout(timeout, self.timeout))

    async def submit(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        chat: bool = False,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        stream: bool = True,
        timeout: float | None = None,
    ) -> str:
        """Send a request and return its id; collect it with `result`.

        It returns at once, unless an earlier request with the same id is still being aborted:
        then it waits for that first, for up to `timeout` (see the class docstring).
        """
        request = build_request(
            prompt,
            sampling,
            chat=chat,
            request_id=request_id,
            cache_salt=cache_salt,
            priority=priority,
            stream=stream,
        )
        limit = _resolve_timeout(timeout, self.timeout)
        deadline = None if limit is None else asyncio.get_running_loop().time() + limit
        await self._send_request(request, deadline, limit)
        return request.request_id

    async def result(self, request_id: str, timeout: float | None = None) -> Completion:
        """Wait for a submitted request to finish and return all of it."""
        limit = _resolve_timeout(timeout, self.timeout)
        deadline = None if limit is None else asyncio.get_running_loop().time() + limit
        return await self._collect(request_id, deadline, limit)

    async def _collect(
        self, request_id: str, deadline: float | None, limit: float | None
    ) -> Completion:
        completion = Completion(request_id)
        while True:
            output = await self._next(request_id, deadline, limit)
            completion.add(output)
            if output.finished:
                return completion

    async def abort(self, request_id: str) -> None:
        """Ask the control plane to stop a request. A submitted request stays collectable: its
        last output (finish_reason "abort", unless it had already finished) ends `result`."""
        await self._send(_abort_message(request_id))

    async def close(self) -> None:
        """Abort the requests still in flight, fail their waiters and release the socket."""
        if self._closed:
            return
        for request_id in list(self._queues):
            await self._send(_abort_message(request_id))
        self._closed = True
        self._fail_all(ServiceError("the client is closed"))
        self._ended.clear()
        self._tombstones.clear_all()  # wakes the requests waiting to reuse those ids
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        self._socket.close(linger=CLOSE_LINGER_MS)
        self._context.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _stream(
        self, request: GenerateRequest, limit: float | None
    ) -> AsyncIterator[RequestOutput]:
        request_id = request.request_id
        deadline = None if limit is None else asyncio.get_running_loop().time() + limit
        await self._send_request(request, deadline, limit)
        try:
            while True:
                output = await self._next(request_id, deadline, limit)
                yield output
                if output.finished:
                    return
        finally:
            if request_id in self._queues:  # left before the end: free it on the server
                await self._forget_and_abort(request_id)

    async def _send_request(
        self, request: GenerateRequest, deadline: float | None, limit: float | None
    ) -> None:
        request_id = request.request_id
        if request_id in self._queues:
            raise ValueError(f"request {request_id} is already in flight")
        frame = protocol.encode(request)
        self._check_open()
        self._ensure_receiver()
        await self._await_tombstone(request_id, deadline, limit)
        self._check_open()  # the client may have been closed meanwhile
        self._ensure_receiver()
        if request_id in self._queues:  # another task took the id meanwhile
            raise ValueError(f"request {request_id} is already in flight")
        self._queues[request_id] = asyncio.Queue()
        await self._send(frame)

    async def _await_tombstone(
        self, request_id: str, deadline: float | None, limit: float | None
    ) -> None:
        """Wait until an earlier, aborted request with this id is confirmed gone (or its
        tombstone expires); RequestTimeout at `deadline`."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            expiry = self._tombstones.expiry(request_id, now)
            if expiry is None:
                return
            if deadline is not None and now >= deadline:
                raise _tombstoned_error(request_id, limit or 0.0)
            cleared = self._tombstone_cleared.setdefault(request_id, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(
                    expiry if deadline is None else min(expiry, deadline)
                ):
                    await cleared.wait()

    def _wake_reuser(self, request_id: str) -> None:
        event = self._tombstone_cleared.pop(request_id, None)
        if event is not None:
            event.set()

    async def _next(
        self, request_id: str, deadline: float | None, limit: float | None
    ) -> RequestOutput:
        self._check_open()
        queue = self._queues.get(request_id)
        if queue is None:
            raise KeyError(f"request {request_id} is not in flight on this client")
        try:
            async with asyncio.timeout_at(deadline):
                item = await queue.get()
        except TimeoutError:
            await self._forget_and_abort(request_id)
            raise _timeout_error(request_id, limit or 0.0) from None
        if isinstance(item, ServiceError):
            self._queues.pop(request_id, None)
            raise item
        if _ends_request(item):
            self._queues.pop(request_id, None)
            self._ended.discard(request_id)
        return check_reply(item)

    def _ensure_receiver(self) -> None:
        if self._receiver is None or self._receiver.done():
            self._receiver = asyncio.get_running_loop().create_task(self._receive_loop())

    async def _receive_loop(self) -> None:
        """Route every message to its request's queue, for as long as the client is open."""
        try:
            while True:
                reply = parse_reply(await self._socket.recv_multipart())
                if reply is None:
                    continue
                if self._tombstones.swallow(reply):
                    continue
                queue = self._queues.get(reply.request_id)
                if queue is None:  # e.g. the tail of an aborted request whose tombstone expired
                    log.debug("client.reply.unclaimed", request_id=reply.request_id)
                    continue
                if _ends_request(reply):
                    self._ended.add(reply.request_id)
                queue.put_nowait(reply)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the socket is unusable: nothing more will arrive
            log.error("client.receive.failed", error=repr(exc))
            self._fail_all(ServiceError(f"receiving from {self.url} failed: {exc!r}"))

    def _fail_all(self, error: ServiceError) -> None:
        for request_id, queue in self._queues.items():
            queue.put_nowait(ServiceError(str(error), request_id))

    async def _forget_and_abort(self, request_id: str) -> None:
        """Stop waiting for a request and abort it, leaving a tombstone for its final output."""
        self._queues.pop(request_id, None)
        finished = request_id in self._ended  # its last reply is here: nothing more will come
        self._ended.discard(request_id)
        if self._closed:
            return
        if not finished:
            self._tombstones.add(request_id, asyncio.get_running_loop().time())
        await self._send(_abort_message(request_id))

    async def _send(self, frame: bytes) -> None:
        self._check_open()
        await self._socket.send(frame)

    def _check_open(self) -> None:
        if self._closed:
            raise ServiceError("the client is closed")
