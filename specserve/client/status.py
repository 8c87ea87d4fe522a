"""Ask a control plane how it is: the served model, its live workers, the requests in flight.

One short-lived DEALER per call, so a status probe never shares a socket (or a queue) with the
requests of a client; `ServiceUnreachable` when no answer comes within `timeout`.
"""

from __future__ import annotations

import os

import zmq
import zmq.asyncio

from specserve.client.core import DEFAULT_URL
from specserve.client.errors import RequestFailed, ServiceUnreachable, unreachable_message
from specserve.client.wire import connect_dealer
from specserve.shared import protocol
from specserve.shared.curve import DEFAULT_CLIENT_KEY, PeerKeys
from specserve.shared.protocol import PROTOCOL_VERSION, ErrorReply, ServiceStatus, StatusRequest

STATUS_MAX_MESSAGE_BYTES = 1 << 16  # a ServiceStatus is a few dozen bytes


async def fetch_status(
    url: str = DEFAULT_URL,
    timeout: float = 2.0,
    *,
    keys: PeerKeys | str | os.PathLike | None = None,
    key_name: str = DEFAULT_CLIENT_KEY,
) -> ServiceStatus:
    """The control plane's `ServiceStatus` (asyncio)."""
    context = zmq.asyncio.Context.instance()
    sock = context.socket(zmq.DEALER)
    try:
        connect_dealer(sock, url, STATUS_MAX_MESSAGE_BYTES, keys, key_name)
        if not await sock.poll(int(timeout * 1000), zmq.POLLOUT):
            raise ServiceUnreachable(unreachable_message(url, timeout))
        await sock.send(protocol.encode(StatusRequest(PROTOCOL_VERSION)), zmq.NOBLOCK)
        if not await sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise ServiceUnreachable(unreachable_message(url, timeout))
        return _parse(await sock.recv_multipart())
    finally:
        sock.close(linger=0)


def get_status(
    url: str = DEFAULT_URL,
    timeout: float = 2.0,
    *,
    keys: PeerKeys | str | os.PathLike | None = None,
    key_name: str = DEFAULT_CLIENT_KEY,
) -> ServiceStatus:
    """The control plane's `ServiceStatus` (blocking)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        connect_dealer(sock, url, STATUS_MAX_MESSAGE_BYTES, keys, key_name)
        if not sock.poll(int(timeout * 1000), zmq.POLLOUT):
            raise ServiceUnreachable(unreachable_message(url, timeout))
        sock.send(protocol.encode(StatusRequest(PROTOCOL_VERSION)), zmq.NOBLOCK)
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise ServiceUnreachable(unreachable_message(url, timeout))
        return _parse(sock.recv_multipart())
    finally:
        sock.close(linger=0)


def _parse(frames: list[bytes]) -> ServiceStatus:
    msg = protocol.decode(frames[-1])
    if isinstance(msg, ErrorReply):
        raise RequestFailed(f"status refused: {msg.message}")
    if not isinstance(msg, ServiceStatus):
        raise RequestFailed(f"expected a service_status reply, got {type(msg).__name__}")
    return msg
