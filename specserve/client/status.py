"""Ask a control plane how it is: the served model, its live workers, the requests in flight.

One short-lived DEALER per call, so a status probe never shares a socket (or a queue) with the
requests of a client; `ServiceUnreachable` when no answer comes within `timeout`.
"""

from __future__ import annotations

from typing import Unpack

import zmq
import zmq.asyncio

from specserve.client.core import DEFAULT_URL
from specserve.client.errors import RequestFailed, ServiceUnreachable, unreachable_message
from specserve.client.wire import ConnectOptions, connect_dealer
from specserve.shared import protocol
from specserve.shared.protocol import PROTOCOL_VERSION, ErrorReply, ServiceStatus, StatusRequest

STATUS_MAX_MESSAGE_BYTES = 1 << 16  # a ServiceStatus is a few dozen bytes
_REQUEST = protocol.encode(StatusRequest(PROTOCOL_VERSION))


async def fetch_status(
    url: str = DEFAULT_URL, timeout: float = 2.0, **connect: Unpack[ConnectOptions]
) -> ServiceStatus:
    """The control plane's `ServiceStatus` (asyncio)."""
    sock = _dealer(zmq.asyncio.Context.instance(), url, connect)
    try:
        _check(await sock.poll(int(timeout * 1000), zmq.POLLOUT), url, timeout)
        await sock.send(_REQUEST, zmq.NOBLOCK)
        _check(await sock.poll(int(timeout * 1000), zmq.POLLIN), url, timeout)
        return _parse(await sock.recv_multipart())
    finally:
        sock.close(linger=0)


def get_status(
    url: str = DEFAULT_URL, timeout: float = 2.0, **connect: Unpack[ConnectOptions]
) -> ServiceStatus:
    """The control plane's `ServiceStatus` (blocking)."""
    sock = _dealer(zmq.Context.instance(), url, connect)
    try:
        _check(sock.poll(int(timeout * 1000), zmq.POLLOUT), url, timeout)
        sock.send(_REQUEST, zmq.NOBLOCK)
        _check(sock.poll(int(timeout * 1000), zmq.POLLIN), url, timeout)
        return _parse(sock.recv_multipart())
    finally:
        sock.close(linger=0)


def _dealer(context: zmq.Context, url: str, connect: ConnectOptions) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    connect_dealer(sock, url, **{"max_message_bytes": STATUS_MAX_MESSAGE_BYTES, **connect})
    return sock


def _check(ready: int, url: str, timeout: float) -> None:
    if not ready:
        raise ServiceUnreachable(unreachable_message(url, timeout))


def _parse(frames: list[bytes]) -> ServiceStatus:
    msg = protocol.decode(frames[-1])
    if isinstance(msg, ErrorReply):
        raise RequestFailed(f"status refused: {msg.message}")
    if not isinstance(msg, ServiceStatus):
        raise RequestFailed(f"expected a service_status reply, got {type(msg).__name__}")
    return msg
