"""Ask a control plane how it is: the served model, its live workers, the requests in flight.

One short-lived DEALER per call, so a status probe never shares a socket (or a queue) with the
requests of a client; `ServiceUnreachable` when no answer comes within `timeout`, or at once,
with the reason, when the control plane refuses the handshake (keys).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Unpack

import zmq
import zmq.asyncio

from specserve.client.core import DEFAULT_URL
from specserve.client.errors import RequestFailed, ServiceUnreachable, unreachable_message
from specserve.client.wire import ConnectOptions, connect_dealer
from specserve.shared import protocol
from specserve.shared.connection import (
    HANDSHAKE_REFUSALS,
    connection_event,
    pending_events,
    watch_connection,
)
from specserve.shared.protocol import PROTOCOL_VERSION, ErrorReply, ServiceStatus, StatusRequest

STATUS_MAX_MESSAGE_BYTES = 1 << 16  # a ServiceStatus is a few dozen bytes
_REQUEST = protocol.encode(StatusRequest(PROTOCOL_VERSION))


async def fetch_status(
    url: str = DEFAULT_URL, timeout: float = 2.0, **connect: Unpack[ConnectOptions]
) -> ServiceStatus:
    """The control plane's `ServiceStatus` (asyncio)."""
    sock, monitor = _dealer(zmq.asyncio.Context.instance(), url, connect)
    poller = zmq.asyncio.Poller()
    try:
        deadline = time.monotonic() + timeout
        for event in (zmq.POLLOUT, zmq.POLLIN):
            poller.register(sock, event)
            poller.register(monitor, zmq.POLLIN)
            while True:
                ready = dict(await poller.poll(_left_ms(deadline)))
                if sock in ready:
                    if event == zmq.POLLIN:
                        break
                    with contextlib.suppress(zmq.Again):  # the connection went meanwhile
                        await sock.send(_REQUEST, zmq.NOBLOCK)
                        break
                events = []
                if monitor in ready:
                    events = [connection_event(await monitor.recv_multipart())]
                _check_refused(url, events, deadline, timeout)
        return _parse(await sock.recv_multipart())
    finally:
        _close(sock, monitor)


def get_status(
    url: str = DEFAULT_URL, timeout: float = 2.0, **connect: Unpack[ConnectOptions]
) -> ServiceStatus:
    """The control plane's `ServiceStatus` (blocking)."""
    sock, monitor = _dealer(zmq.Context.instance(), url, connect)
    poller = zmq.Poller()
    try:
        deadline = time.monotonic() + timeout
        for event in (zmq.POLLOUT, zmq.POLLIN):
            poller.register(sock, event)
            poller.register(monitor, zmq.POLLIN)
            while True:
                ready = dict(poller.poll(_left_ms(deadline)))
                if sock in ready:
                    if event == zmq.POLLIN:
                        break
                    with contextlib.suppress(zmq.Again):  # the connection went meanwhile
                        sock.send(_REQUEST, zmq.NOBLOCK)
                        break
                events = pending_events(monitor) if monitor in ready else []
                _check_refused(url, events, deadline, timeout)
        return _parse(sock.recv_multipart())
    finally:
        _close(sock, monitor)


def _dealer(context: zmq.Context, url: str, connect: ConnectOptions) -> tuple[Any, Any]:
    """The probe's DEALER, and its connection monitor (made before it connects)."""
    sock = context.socket(zmq.DEALER)
    monitor = watch_connection(sock)
    connect_dealer(sock, url, **{"max_message_bytes": STATUS_MAX_MESSAGE_BYTES, **connect})
    return sock, monitor


def _left_ms(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))


def _check_refused(url: str, events: list[int], deadline: float, timeout: float) -> None:
    """Raise at a refused handshake (with why), or once the timeout has run out."""
    for event in events:
        if event in HANDSHAKE_REFUSALS:
            raise ServiceUnreachable(unreachable_message(url, None, HANDSHAKE_REFUSALS[event]))
    if time.monotonic() >= deadline:
        raise ServiceUnreachable(unreachable_message(url, timeout))


def _close(sock: Any, monitor: Any) -> None:
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)


def _parse(frames: list[bytes]) -> ServiceStatus:
    msg = protocol.decode(frames[-1])
    if isinstance(msg, ErrorReply):
        raise RequestFailed(f"status refused: {msg.message}")
    if not isinstance(msg, ServiceStatus):
        raise RequestFailed(f"expected a service_status reply, got {type(msg).__name__}")
    return msg
