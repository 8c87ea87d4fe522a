"""`AsyncClient`: the calls of `ClientCore`, carried out in asyncio over one receive task."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from types import TracebackType
from typing import Any, TypeVar, Unpack

import structlog
import zmq
import zmq.asyncio

from specserve.client.core import DEFAULT_TIMEOUT, DEFAULT_URL, ClientCore
from specserve.client.errors import ServiceError, ServiceUnreachable
from specserve.client.state import Completion
from specserve.client.steps import Run, Send, Step, Steps, Wait
from specserve.client.wire import ConnectOptions, abort_frame
from specserve.shared.protocol import GenerateRequest, RequestOutput

log = structlog.get_logger(__name__)

T = TypeVar("T")
REFUSAL_CHECK_S = 0.05  # how often a send waiting for a connection looks for a refused handshake


class AsyncClient(
    ClientCore[
        Coroutine[Any, Any, Completion], Coroutine[Any, Any, str], AsyncIterator[RequestOutput]
    ]
):
    """asyncio client: many concurrent requests on one DEALER socket.

    `generate`, `submit`, `result` and `abort` return coroutines, and nothing happens until they
    are awaited. One background task receives every message and files it under its request. Close
    a `stream` that is left early with `contextlib.aclosing` (or `aclose()`) so that its abort is
    sent at once rather than when the iterator is garbage-collected.

    As with `Client`, reusing the id of a request this client aborted is safe: the new request is
    held back (within its call's timeout, else `RequestTimeout` with nothing sent) until the
    control plane has confirmed the abort with the old request's final output, or until
    `TOMBSTONE_TTL_S` has passed; the old request's outputs are dropped.

    An inbound message over `max_message_bytes` (default 256 MiB, room for a long non-streaming
    completion with logprobs) drops the connection rather than being buffered.

    `keys` (a `specserve keys generate` directory, or loaded `PeerKeys`) authenticates with
    CURVE as `clients/<key_name>`; a control plane started with `--keys` needs it.
    """

    _context_type = zmq.asyncio.Context

    def __init__(
        self,
        url: str | Sequence[str] = DEFAULT_URL,
        timeout: float | None = DEFAULT_TIMEOUT,
        *,
        resume: bool = True,
        **connect: Unpack[ConnectOptions],
    ) -> None:
        super().__init__(url, timeout, resume=resume, **connect)
        # The futures of the tasks waiting for news of an id (see `_wake`), dropped once set.
        self._news: dict[str, list[asyncio.Future[None]]] = {}
        self._receiver: asyncio.Task[None] | None = None
        # The same sockets without asyncio's wrapping, to drain what has already arrived: the
        # asyncio socket makes a future of each message, a large share of a streamed token's cost.
        self._inbox = zmq.Socket.shadow(self._socket.underlying)
        self._monitor_inbox = zmq.Socket.shadow(self._monitor.underlying)

    async def abort(self, request_id: str) -> None:
        """Ask the control plane to stop a request. A submitted request stays collectable: its
        last output (finish_reason "abort", unless it had already finished) ends `result`."""
        await self._send(abort_frame(request_id))

    async def close(self) -> None:
        """Fail the waiters of the requests still in flight, abort those requests and release
        the socket. The waiters fail first: the reply to one abort (its last output) may arrive
        while the next is sent, and must not end that request as if it had finished."""
        if self._closed:
            return
        aborts = self._aborts_on_close()
        self._mark_closed()
        for frame in aborts:
            try:
                await self._put(frame)
            except ServiceUnreachable:  # a control plane it cannot reach holds nothing to abort
                break
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        self._close_sockets()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    async def _run(self, steps: Steps[T]) -> T:
        run = Run(steps)
        for step in run:
            try:
                await self._perform(step)
            except BaseException as exc:  # e.g. cancelled: the call frees its request
                run.fail(exc)
        return run.value

    async def _stream(
        self, request: GenerateRequest, limit: float | None
    ) -> AsyncIterator[RequestOutput]:
        await self._run(self._open_stream(request, limit))
        request_id = request.request_id
        alarm = self._alarm(request_id)
        try:
            while True:
                output = await self._next_output(request_id)
                yield output
                if output.finished:
                    return
        finally:  # left before the end: free it on the server, even if cancelled again meanwhile
            if alarm is not None:
                alarm.cancel()
            await asyncio.shield(self._run(self._release(request.request_id)))

    def _alarm(self, request_id: str) -> asyncio.TimerHandle | None:
        """News of a stream's request at its deadline, set once for the whole stream, so that
        the waits between its outputs need no timer each."""
        state = self._requests.get(request_id)
        if state is None or state.deadline.at is None:
            return None
        return asyncio.get_running_loop().call_at(state.deadline.at, self._wake, request_id)

    async def _next_output(self, request_id: str) -> RequestOutput:
        """`_next` for a stream (whose `_alarm` marks the deadline), with its common case taken
        directly: one wait for news, then the output that came (a streamed token costs a few
        microseconds less than through `_run`). Where that finds none (the deadline, a closed
        client) `_next` itself decides."""
        state = self._requests.get(request_id)
        if state is not None and not self._closed:
            if not state.inbox:
                await self._perform(Wait(request_id, None))
            if state.inbox and not self._closed and self._requests.get(request_id) is state:
                return self._take(state)
        return await self._run(self._next(request_id))

    async def _perform(self, step: Step) -> None:
        self._ensure_receiver()
        if isinstance(step, Send):
            await self._send(step.frame)
        else:
            await self._wait(step)

    async def _wait(self, step: Wait) -> None:
        """Sleep until the receive task brings news of the request, or until `step.until` (a
        timer that wakes it the same way). A future of its own per waiting task: an Event
        costs twice as much per streamed token, and a shared future would be cancelled for
        every waiter when one of them is."""
        loop = asyncio.get_running_loop()
        news = loop.create_future()
        waiters = self._news.setdefault(step.request_id, [])
        waiters.append(news)
        timer = None
        if step.until is not None:
            timer = loop.call_at(step.until, self._wake, step.request_id)
        try:
            await news
        finally:
            if timer is not None:
                timer.cancel()
            if not news.done() or news.cancelled():  # not woken: no longer waiting either
                with contextlib.suppress(ValueError):
                    waiters.remove(news)
                if not waiters and self._news.get(step.request_id) is waiters:
                    del self._news[step.request_id]

    def _wake(self, request_id: str) -> None:
        for news in self._news.pop(request_id, ()):
            if not news.done():
                news.set_result(None)

    def _ensure_receiver(self) -> None:
        if self._receiver is None or self._receiver.done():
            self._receiver = asyncio.get_running_loop().create_task(self._receive_loop())

    async def _receive_loop(self) -> None:
        """File every message under its request, and act on every change of the connection
        (see `ClientCore._on_connection_events`), for as long as the client is open."""
        poller = zmq.asyncio.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while True:
                failover_at = self._failover_at()
                wait_ms = None if failover_at is None else (failover_at - time.monotonic()) * 1e3
                ready = dict(await poller.poll(None if wait_ms is None else max(wait_ms, 1)))
                self._file_waiting()
                if self._monitor in ready:
                    await self._send_all(self._connection_news())
                await self._send_all(self._failover())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the socket is unusable: nothing more will arrive
            log.error("client.receive.failed", error=repr(exc))
            self._fail_all(ServiceError(f"receiving from {self.url} failed: {exc!r}"))

    async def _wait_writable(self, wait: float | None) -> bool:
        """Wait up to `wait` seconds for a connection to send on; False if none came, or as
        soon as the only control plane refused the handshake (the receiving task reads the
        connection's events; this looks at what it found every REFUSAL_CHECK_S)."""
        deadline = None if wait is None else time.monotonic() + wait
        while not self._refused_for_good():
            left = REFUSAL_CHECK_S if deadline is None else deadline - time.monotonic()
            if await self._socket.poll(int(min(max(left, 0), REFUSAL_CHECK_S) * 1000), zmq.POLLOUT):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return False

    async def _send_all(self, frames: list[bytes]) -> None:
        for frame in frames:
            await self._send(frame)

    async def _send(self, frame: bytes) -> None:
        self._check_open()
        await self._put(frame)

    async def _put(self, frame: bytes) -> None:
        # A DEALER blocks on send while it has no connection: wait only as long as the client's
        # timeout, and once that failed, not again until a send gets through.
        wait = 0.0 if self._unreachable else self.timeout
        if not await self._wait_writable(wait):
            self._unreachable = True
            raise self._unreachable_error(wait)
        self._unreachable = False
        await self._socket.send(frame, zmq.NOBLOCK)
