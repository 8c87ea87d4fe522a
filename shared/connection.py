"""Watching a DEALER's connection to a control plane, for the peers that must move on when it
goes: the client SDK (its requests resume elsewhere) and workers (they register elsewhere).

ZeroMQ heartbeats make a control plane that stops answering (hung, or its host gone without a
word) drop the connection within HEARTBEAT_TIMEOUT_MS; a killed process's connection drops at
once. A monitor socket says when a connection comes up (the handshake succeeded) or drops.
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq
from zmq.utils.monitor import parse_monitor_message

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
# Why a control plane refused a handshake, by monitor event. ZeroMQ retries a refused handshake
# for ever, so without these a peer with the wrong keys only ever saw its own timeout. Which of
# the first two a missing key gives varies (a keyless peer has been seen to get either).
_KEYS_MISMATCH = (
    "the CURVE handshake failed: it requires keys that were not given here (keys=..., --keys), "
    "or the keys given are not this service's (its public key, or this peer's pair)"
)
HANDSHAKE_REFUSALS = {
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: _KEYS_MISMATCH,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: _KEYS_MISMATCH,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "it does not accept this key (not among its authorised keys)",
}
CONNECTION_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
for _event in HANDSHAKE_REFUSALS:
    CONNECTION_EVENTS |= _event


def heartbeat(sock: zmq.Socket) -> None:
    """Heartbeat `sock`'s connections (set before it connects)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def watch_connection(sock: zmq.Socket) -> zmq.Socket:
    """A socket that receives `sock`'s CONNECTION_EVENTS; made before `sock` connects, so no
    event is missed. Its kind (blocking or asyncio) is that of `sock`'s context."""
    return sock.get_monitor_socket(CONNECTION_EVENTS)


def connection_event(frames: list[bytes]) -> int:
    """The event (a `zmq.EVENT_*` value) in one message from a `watch_connection` socket."""
    return parse_monitor_message(frames)["event"]


def pending_events(monitor: zmq.Socket) -> list[int]:
    """Every event waiting on a (blocking) `watch_connection` socket, oldest first."""
    events = []
    while True:
        try:
            events.append(connection_event(monitor.recv_multipart(zmq.NOBLOCK)))
        except zmq.Again:
            return events


def next_url(urls: Sequence[str], current: str) -> str:
    """The control plane to try after `current`, in the order given (round and round)."""
    return urls[(list(urls).index(current) + 1) % len(urls)]
