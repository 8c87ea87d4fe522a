"""`Client`: the calls of `ClientCore`, carried out by polling a socket in the calling thread."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from types import TracebackType
from typing import TypeVar

import zmq

from specserve.client.core import ClientCore
from specserve.client.errors import ServiceUnreachable
from specserve.client.state import Completion
from specserve.client.steps import Run, Send, Step, Steps
from specserve.client.wire import abort_frame
from specserve.shared.connection import pending_events
from specserve.shared.protocol import GenerateRequest, RequestOutput

T = TypeVar("T")


class Client(ClientCore[Completion, str, Iterator[RequestOutput]]):
    """Synchronous client on one DEALER socket, for one thread (it is not thread-safe).

    While it waits for one request, outputs of the others it has submitted are buffered, so many
    requests can be submitted at once and collected one by one with `result`. A request that times
    out, or whose stream is closed early, is aborted so that the control plane frees it.

    Retrying such a request under the same `request_id` is safe: until the control plane has
    confirmed the abort with the old request's final output (or `TOMBSTONE_TTL_S` has passed), the
    new request is not sent; `generate`, `stream` and `submit` wait for that (receiving and
    buffering other requests' outputs meanwhile) within their timeout, and raise `RequestTimeout`,
    having sent nothing, if it does not come in time. The old request's outputs are dropped.

    An inbound message over `max_message_bytes` (default 256 MiB, room for a long non-streaming
    completion with logprobs) drops the connection rather than being buffered.

    `keys` (a `specserve keys generate` directory, or loaded `PeerKeys`) authenticates with
    CURVE as `clients/<key_name>`; a control plane started with `--keys` needs it.
    """

    _context_type = zmq.Context

    @functools.cached_property
    def _poller(self) -> zmq.Poller:
        """Replies and changes of the connection, waited for together."""
        return self._with_connection_changes(zmq.POLLIN)

    @functools.cached_property
    def _send_poller(self) -> zmq.Poller:
        """A connection to send on, and changes of the connection, waited for together."""
        return self._with_connection_changes(zmq.POLLOUT)

    def _with_connection_changes(self, socket_events: int) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self._socket, socket_events)
        poller.register(self._monitor, zmq.POLLIN)
        return poller

    def abort(self, request_id: str) -> None:
        """Ask the control plane to stop a request. A submitted request stays collectable: its
        last output (finish_reason "abort", unless it had already finished) ends `result`."""
        self._send(abort_frame(request_id))

    def close(self) -> None:
        """Abort the requests still in flight and release the socket."""
        if self._closed:
            return
        for frame in self._aborts_on_close():
            try:
                self._send(frame)
            except ServiceUnreachable:  # a control plane it cannot reach holds nothing to abort
                break
        self._mark_closed()
        self._close_sockets()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _now(self) -> float:
        return time.monotonic()

    def _run(self, steps: Steps[T]) -> T:
        run = Run(steps)
        for step in run:
            try:
                self._perform(step)
            except BaseException as exc:  # e.g. KeyboardInterrupt: the call frees its request
                run.fail(exc)
        return run.value

    def _stream(self, request: GenerateRequest, limit: float | None) -> Iterator[RequestOutput]:
        self._run(self._open_stream(request, limit))
        try:
            while True:
                output = self._run(self._next(request.request_id))
                yield output
                if output.finished:
                    return
        finally:  # left before the end: free it on the server
            self._run(self._release(request.request_id))

    def _perform(self, step: Step) -> None:
        if isinstance(step, Send):
            self._send(step.frame)
        else:
            self._receive(step.until)

    def _receive(self, until: float | None) -> None:
        """Wait until `until` at most for messages, of any request, and file them; act on
        every change of the connection (see `ClientCore._on_connection_events`)."""
        self._check_open()
        failover_at = self._failover_at()
        if failover_at is not None:
            until = failover_at if until is None else min(until, failover_at)
        timeout_ms = None if until is None else max(1, math.ceil((until - self._now()) * 1000))
        ready = dict(self._poller.poll(0 if self._early_events else timeout_ms))
        self._file_waiting()
        if self._monitor in ready or self._early_events:
            self._send_all(self._connection_news())
        self._send_all(self._failover())

    def _send_all(self, frames: list[bytes]) -> None:
        for frame in frames:
            self._send(frame)

    def _send(self, frame: bytes) -> None:
        self._check_open()
        # A DEALER blocks on send while it has no connection: wait only as long as the client's
        # timeout, and once that failed, not again until a send gets through.
        wait = 0.0 if self._unreachable else self.timeout
        if not self._wait_writable(wait):
            self._unreachable = True
            raise self._unreachable_error(wait)
        self._unreachable = False
        self._socket.send(frame, zmq.NOBLOCK)

    def _wait_writable(self, wait: float | None) -> bool:
        """Wait up to `wait` seconds for a connection to send on; False if none came, or if the
        only control plane refused the handshake. The connection events read meanwhile are
        kept for `_receive`, which acts on them."""
        deadline = None if wait is None else self._now() + wait
        self._read_connection_events()  # a refusal, or a handshake that succeeded since
        while not self._refused_for_good():
            left_ms = None if deadline is None else max(0, int((deadline - self._now()) * 1000))
            ready = dict(self._send_poller.poll(left_ms))
            if ready.get(self._socket, 0) & zmq.POLLOUT:
                return True
            self._read_connection_events()
            if deadline is not None and self._now() >= deadline:
                return False
        return False

    def _read_connection_events(self) -> None:
        events = pending_events(self._monitor)
        self._early_events += events
        self._note_handshakes(events)
