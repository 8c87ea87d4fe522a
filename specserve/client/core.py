"""The one client implementation: the public calls and the state of every request in flight.

`ClientCore` opens the client's DEALER socket but never uses it. Its calls are generators of
`Send`/`Wait` steps (see `steps.py`); `Client` and `AsyncClient` carry those out, and feed every
message they receive to `_file`. So request building, deadlines, tombstones and the folding of
outputs exist once, and the state of a request (what was asked, its deadline, what it delivered)
lives in one `RequestState`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Generic, TypeVar, Unpack

import structlog
import zmq

from specserve.client.errors import ServiceError, ServiceUnreachable, unreachable_message
from specserve.client.state import Completion, Deadline, RequestState, resolve_timeout
from specserve.client.steps import Send, Steps, Wait
from specserve.client.tombstones import Tombstones
from specserve.client.wire import (
    ConnectOptions,
    Options,
    Prompt,
    Reply,
    RequestArgs,
    abort_frame,
    check_reply,
    connect_dealer,
    ends_request,
    parse_replies,
    request_args,
)
from specserve.shared import protocol
from specserve.shared.connection import (
    HANDSHAKE_REFUSALS,
    next_url,
    pending_events,
    watch_connection,
)
from specserve.shared.protocol import GenerateRequest, RequestOutput, SamplingParams

log = structlog.get_logger(__name__)

DEFAULT_URL = "tcp://127.0.0.1:5555"
DEFAULT_TIMEOUT = 120.0
# On close, queued messages (the aborts of unfinished requests) get this long to leave.
CLOSE_LINGER_MS = 500
# A request is sent again at most this many times after losing its control plane.
MAX_RESUMPTIONS = 8
# With several control planes: how long one may stay unreachable before the client tries the next.
FAILOVER_S = 2.0

# What the public calls return: the values themselves (`Client`), or coroutines and an async
# iterator (`AsyncClient`).
CompletionT = TypeVar("CompletionT")
IdT = TypeVar("IdT")
OutputsT = TypeVar("OutputsT")


class ClientCore(ABC, Generic[CompletionT, IdT, OutputsT]):
    """The calls of both clients, written once over a socket that a subclass provides.

    A subclass supplies its clock (`_now`), runs a call's steps (`_run`, `_stream`) and files every
    message it receives with `_file`; an asyncio one also overrides `_wake` to rouse the task that
    waits on a request. Outputs of many requests share one socket, so they are demultiplexed by
    request id into each request's inbox until its caller takes them.
    """

    _context_type: type[zmq.Context] = zmq.Context  # the subclass's kind of socket

    def __init__(
        self,
        url: str | Sequence[str] = DEFAULT_URL,
        timeout: float | None = DEFAULT_TIMEOUT,
        *,
        resume: bool = True,
        **connect: Unpack[ConnectOptions],
    ) -> None:
        self.urls = [url] if isinstance(url, str) else list(url)
        if not self.urls:
            raise ValueError("give at least one control plane URL")
        self.url = self.urls[0]  # the control plane in use
        self.timeout = timeout
        self.resume = resume
        self._context = self._context_type()
        self._socket = self._context.socket(zmq.DEALER)
        # Watched before it connects, so that no change of the connection goes unseen.
        self._monitor = watch_connection(self._socket)
        connect_dealer(self._socket, self.url, **connect)
        # What `_file_waiting` and `_connection_news` read the socket and its monitor through.
        self._inbox: zmq.Socket = self._socket
        self._monitor_inbox: zmq.Socket = self._monitor
        self._lost_at: float | None = time.monotonic()  # None while a control plane answers
        self._unreachable = False  # the last send found no connection
        self._refusal: str | None = None  # why the control plane refused the last handshake
        self._early_events: list[int] = []  # read by a blocking send, for the receive loop
        self._heard = False  # whether anything at all came from the control plane
        self._requests: dict[str, RequestState] = {}
        self._tombstones = Tombstones(on_clear=self._wake)
        self._closed = False

    def generate(
        self, prompt: Prompt, sampling: SamplingParams | None = None, **options: Unpack[Options]
    ) -> CompletionT:
        """Run one request to the end. Not streamed: the control plane sends a single output.

        `timeout` bounds the whole call, including any wait for an earlier request with the same
        id to finish aborting (see the class docstring).
        """
        args, timeout = request_args(prompt, sampling, options, stream=False)
        return self._run(self._generate(args, timeout))

    def stream(
        self, prompt: Prompt, sampling: SamplingParams | None = None, **options: Unpack[Options]
    ) -> OutputsT:
        """Yield each output (its new tokens) as it arrives; closing the iterator early aborts.

        The arguments are checked at once; the request is sent when iteration starts. `timeout`
        bounds the whole request, including any wait for an earlier request with the same id to
        finish aborting (see the class docstring).
        """
        args, timeout = request_args(prompt, sampling, options, stream=True)
        request = args.build()
        return self._stream(request, resolve_timeout(timeout, self.timeout))

    def submit(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        stream: bool = True,
        **options: Unpack[Options],
    ) -> IdT:
        """Send a request and return its id; collect it with `result`.

        It returns at once, unless an earlier request with the same id is still being aborted:
        then it waits for that first, for up to `timeout` (see the class docstring).
        """
        args, timeout = request_args(prompt, sampling, options, stream)
        return self._run(self._submit(args, timeout))

    def result(self, request_id: str, timeout: float | None = None) -> CompletionT:
        """Wait for a submitted request to finish and return all of it."""
        return self._run(self._result(request_id, timeout))

    # -- what a subclass provides --

    @abstractmethod
    def _now(self) -> float:
        """The clock that deadlines and tombstones are kept on."""

    @abstractmethod
    def _run(self, steps: Steps[Any]) -> Any:
        """Carry out a call's steps; its value (or a coroutine that returns it)."""

    @abstractmethod
    def _stream(self, request: GenerateRequest, limit: float | None) -> OutputsT:
        """Send the request when iteration starts (`_open_stream`), then yield each `_next`
        output; leaving early must `_release` it."""

    def _wake(self, request_id: str) -> None:
        """News of a request: a reply was filed or its tombstone cleared. A caller that waits in
        another task overrides this to rouse it."""

    # -- the calls, as steps --

    def _generate(self, args: RequestArgs, timeout: float | None) -> Steps[Completion]:
        request = args.build()
        state = yield from self._send_request(request, self._deadline(timeout))
        try:
            return (yield from self._collect(state))
        except BaseException:  # e.g. interrupted or cancelled: nobody will collect it, so free it
            yield from self._release(request.request_id)
            raise

    def _submit(self, args: RequestArgs, timeout: float | None) -> Steps[str]:
        request = args.build()
        yield from self._send_request(request, self._deadline(timeout))
        return request.request_id

    def _result(self, request_id: str, timeout: float | None) -> Steps[Completion]:
        deadline = self._deadline(timeout)
        state = self._in_flight(request_id)
        state.deadline = deadline  # this call's own limit, not the one its `submit` had
        return (yield from self._collect(state))

    def _open_stream(self, request: GenerateRequest, limit: float | None) -> Steps[None]:
        yield from self._send_request(request, Deadline.after(limit, self._now()))

    def _collect(self, state: RequestState) -> Steps[Completion]:
        while True:
            output = yield from self._next(state.request_id)
            if output.finished:
                return state.delivered

    def _next(self, request_id: str) -> Steps[RequestOutput]:
        """The request's next output, waited for until its deadline (which aborts it)."""
        state = self._in_flight(request_id)
        while not state.inbox:
            if state.deadline.passed(self._now()):
                yield from self._abandon(request_id)
                raise state.deadline.timed_out(request_id, self._heard)
            yield Wait(request_id, state.deadline.at)
        return self._take(state)

    def _release(self, request_id: str) -> Steps[None]:
        """Free a request whose caller left before its end."""
        if request_id in self._requests:
            yield from self._abandon(request_id)

    # -- sending --

    def _send_request(self, request: GenerateRequest, deadline: Deadline) -> Steps[RequestState]:
        """Send the request once no earlier request with its id is being aborted."""
        request_id = request.request_id
        self._check_new(request_id)
        frame = protocol.encode(request)
        self._check_open()
        yield from self._await_tombstone(request_id, deadline)
        self._check_open()  # the client may have been closed meanwhile (by another task)
        self._check_new(request_id)  # or another task may have taken the id
        state = self._requests[request_id] = RequestState(request, deadline)
        yield Send(frame)
        return state

    def _await_tombstone(self, request_id: str, deadline: Deadline) -> Steps[None]:
        """Wait until an earlier, aborted request with this id is confirmed gone (or its
        tombstone expires); RequestTimeout, with nothing sent, at the deadline."""
        while True:
            now = self._now()
            expiry = self._tombstones.expiry(request_id, now)
            if expiry is None:
                return
            if deadline.passed(now):
                raise deadline.not_sent(request_id)
            yield Wait(request_id, deadline.cap(expiry))

    def _abandon(self, request_id: str) -> Steps[None]:
        """Stop waiting for a request and abort it, leaving a tombstone for its final output."""
        state = self._requests.pop(request_id, None)
        if self._closed:
            return
        if state is None or not state.ended:  # with its last reply here, nothing more will come
            self._tombstones.add(request_id, self._now())
        yield Send(abort_frame(request_id))

    # -- receiving --

    def _file_waiting(self) -> None:
        """File every message that has already arrived."""
        while True:
            try:
                self._file(self._inbox.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return

    def _connection_news(self) -> list[bytes]:
        """Act on the connection's waiting events (and any a blocking send read early): the
        frames to send because of them."""
        events = self._early_events + pending_events(self._monitor_inbox)
        self._early_events = []
        self._file_waiting()  # what arrived before the connection dropped comes first
        return self._on_connection_events(events)

    def _file(self, frames: list[bytes]) -> None:
        """File one message from the control plane under its requests (or drop it)."""
        self._heard = True
        for reply in parse_replies(frames):
            self._file_reply(reply)

    def _file_reply(self, reply: Reply) -> None:
        if self._tombstones.swallow(reply):
            return
        state = self._requests.get(reply.request_id)
        if state is None:  # e.g. the tail of an aborted request whose tombstone expired
            log.debug("client.reply.unclaimed", request_id=reply.request_id)
            return
        if self.resume and isinstance(reply, RequestOutput) and reply.resumable:
            # Its control plane is stopping: the request is sent again when the connection drops.
            log.info("client.request.interrupted", request_id=reply.request_id, url=self.url)
            return
        state.file(reply)
        self._wake(state.request_id)

    # -- losing a control plane --

    def _on_connection_events(self, events: list[int]) -> list[bytes]:
        """News of the connection (from its monitor; the replies that arrived before it must be
        filed first): the frames to send because of it."""
        lost = False
        self._note_handshakes(events)
        if self._refused_for_good():
            self._refuse_all()
        for event in events:
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._lost_at = None
                log.info("client.connected", url=self.url)
            elif event == zmq.EVENT_DISCONNECTED and self._lost_at is None:
                # (while down, a disconnect is a failed attempt, e.g. a refused handshake)
                lost = True
                self._lost_at = time.monotonic()
        return self._connection_lost() if lost else []

    def _note_handshakes(self, events: list[int]) -> None:
        """Keep why the latest handshake was refused (None once one succeeds); logged once per
        change, not at every one of ZeroMQ's retries."""
        for event in events:
            refusal = HANDSHAKE_REFUSALS.get(event)
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED or refusal is not None:
                if refusal is not None and refusal != self._refusal:
                    log.warning("client.handshake_refused", url=self.url, reason=refusal)
                self._refusal = refusal

    def _refuse_all(self) -> None:
        """Fail the requests in flight now, not at their timeouts: what they sent waits in the
        socket for a handshake that the only control plane keeps refusing."""
        for request_id, state in self._requests.items():
            if state.resumable:
                message = unreachable_message(self.url, None, self._refusal)
                state.file(ServiceUnreachable(message, request_id))
                self._wake(request_id)

    def _unreachable_error(self, waited_s: float | None) -> ServiceUnreachable:
        return ServiceUnreachable(unreachable_message(self.url, waited_s, self._refusal))

    def _refused_for_good(self) -> bool:
        """A send need not wait out its timeout: the only control plane refused the handshake,
        and it will until its keys or this client's change (with several, the next may not)."""
        return self._refusal is not None and len(self.urls) == 1

    def _connection_lost(self) -> list[bytes]:
        """The control plane went away, and with it every request it held: send each again,
        resumed from what arrived (they wait in the socket until a control plane answers: the
        same one restarted, or with several given, the next)."""
        log.warning("client.connection_lost", url=self.url, in_flight=len(self._requests))
        self._tombstones.clear_all()  # the aborts they await will never be confirmed
        if len(self.urls) > 1:
            self._switch_control_plane()
        return self._resume_all(count=True)

    def _failover_at(self) -> float | None:
        """When, on `time.monotonic()`, to try the next control plane (None: no need)."""
        if self._lost_at is None or len(self.urls) < 2 or self._closed:
            return None
        return self._lost_at + FAILOVER_S

    def _failover(self) -> list[bytes]:
        """With several control planes, once none answered for FAILOVER_S: try the next one,
        sending it every request in flight (what was sent to the last one is dropped)."""
        at = self._failover_at()
        if at is None or time.monotonic() < at:
            return []
        self._lost_at = time.monotonic()
        self._switch_control_plane()
        return self._resume_all(count=False)

    def _switch_control_plane(self) -> None:
        old = self.url
        self.url = next_url(self.urls, old)
        self._refusal = None  # that was the last plane's answer
        self._socket.disconnect(old)
        self._socket.connect(self.url)
        log.warning("client.failover", left=old, to=self.url)

    def _resume_all(self, count: bool) -> list[bytes]:
        """The frames that send every request in flight again (resumed), or, with resumption
        off or its limit reached, the failure of those requests. `count`: a new loss."""
        frames = []
        for request_id, state in self._requests.items():
            if not state.resumable:
                continue
            reason = None
            if not self.resume:
                reason = "resumption is off"
            elif count and state.resumptions >= MAX_RESUMPTIONS:
                reason = f"it was already resumed {MAX_RESUMPTIONS} times"
            if reason is not None:
                message = f"request {request_id} lost its control plane ({self.url}), and {reason}"
                state.file(ServiceError(message, request_id))
                self._wake(request_id)
                continue
            state.resumptions += count
            frames.append(protocol.encode(state.resume_request()))
        return frames

    def _take(self, state: RequestState) -> RequestOutput:
        """The request's oldest reply, checked, and folded into what it delivered."""
        item = state.inbox.popleft()
        if isinstance(item, ServiceError) or ends_request(item):
            self._requests.pop(state.request_id, None)
        if isinstance(item, ServiceError):
            raise item
        output = check_reply(item)
        state.delivered.add(output)
        return output

    def _fail_all(self, error: ServiceError) -> None:
        """Fail every request in flight: nothing more will arrive for them."""
        for request_id, state in self._requests.items():
            state.file(ServiceError(str(error), request_id))
            self._wake(request_id)

    # -- open and closed --

    def _aborts_on_close(self) -> list[bytes]:
        """The aborts that free the requests still in flight, taken before `_mark_closed`."""
        return [abort_frame(request_id) for request_id in self._requests]

    def _mark_closed(self) -> None:
        self._closed = True
        self._fail_all(ServiceError("the client is closed"))  # wakes their waiters
        self._requests.clear()
        self._tombstones.clear_all()  # wakes the requests waiting to reuse those ids

    def _close_sockets(self) -> None:
        """Last of all: queued messages get CLOSE_LINGER_MS to leave."""
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=CLOSE_LINGER_MS)
        self._context.term()

    def _check_open(self) -> None:
        if self._closed:
            raise ServiceError("the client is closed")

    def _check_new(self, request_id: str) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already in flight")

    def _in_flight(self, request_id: str) -> RequestState:
        self._check_open()
        state = self._requests.get(request_id)
        if state is None:
            raise KeyError(f"request {request_id} is not in flight on this client")
        return state

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline.after(resolve_timeout(timeout, self.timeout), self._now())
