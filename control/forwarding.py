"""Prefix routing across control planes: a request goes to the plane whose worker holds more of
its prefix, and the plane it came to relays that plane's outputs to its client.

Every plane writes its client URL (`control_url`) into its workers' index records, so the index's
answer for a prompt (which workers hold how much of it) also says which plane owns each worker.
When another plane's worker holds at least `min_tokens` more of a prompt than any worker here,
the request goes to that plane over a DEALER socket this plane keeps per peer, as a client
would send it (with CURVE, under the control plane's own key, which every plane admits on its
client port), marked `forwarded` so that the peer serves it itself and never forwards it again.
A plane with no live worker of its own (all of them restarting, say) forwards every new request
it can to a connected plane that has one, rather than holding it until one of its own returns.

The peer's outputs reach the client unchanged, and the frontend records the tokens and text they
carry. If the peer dies (its connection drops, or it misses ZeroMQ heartbeats), shuts down, or
refuses the request, this plane serves the request itself, resumed from what the client already
has, exactly as the client's own resume would. Each worker still has exactly one scheduler: a
forwarded request is scheduled by the plane that owns the worker.
"""

from __future__ import annotations

import socket
from collections import Counter
from dataclasses import dataclass, field

import structlog
import zmq

from specserve.shared import protocol
from specserve.shared.connection import heartbeat, pending_events, watch_connection
from specserve.shared.curve import PeerKeys
from specserve.shared.socket_limits import CLIENT_MAX_MESSAGE_BYTES, bound_socket

log = structlog.get_logger(__name__)

FORWARD_MIN_TOKENS = 32  # how many more cached tokens elsewhere make a request worth forwarding
OWNERS_REFRESH_S = 1.0  # how often the other planes' workers are read from the index


def advertised_url(endpoint: str) -> str:
    """The URL other planes reach this one's client port at: the bound endpoint, with a
    wildcard host replaced by this host's address."""
    head, sep, port = endpoint.rpartition(":")
    host = head.removeprefix("tcp://").strip("[]")
    if not endpoint.startswith("tcp://") or host not in ("*", "0.0.0.0", "::"):
        return endpoint
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = "127.0.0.1"
    return f"tcp://{address}{sep}{port}"


@dataclass
class PeerLink:
    """The connection to another control plane's client port, and what was forwarded there."""

    url: str
    sock: zmq.Socket
    monitor: zmq.Socket
    connected: bool = False
    requests: set[str] = field(default_factory=set)  # forwarded, not finished


@dataclass(frozen=True)
class Target:
    url: str
    worker_id: str
    cached_tokens: int


class PeerLinks:
    """The links to the other control planes, made as the index names them."""

    def __init__(
        self, ctx: zmq.Context, poller: zmq.Poller, keys: PeerKeys | None, min_tokens: int
    ) -> None:
        self.ctx = ctx
        self.poller = poller
        self.keys = keys
        self.min_tokens = min_tokens
        self.links: dict[str, PeerLink] = {}
        self.owners: dict[str, str] = {}  # another plane's worker id -> its plane's client URL

    def set_owners(self, owners: dict[str, str]) -> None:
        """The other planes' live workers, as the index lists them: a link is made to each
        plane named, and one no longer named is closed once it is down and nothing forwarded
        waits on it (a plane missing from one reading is not cut off)."""
        self.owners = owners
        for url in set(owners.values()) - set(self.links):
            self._connect(url)
        for url, link in list(self.links.items()):
            if url not in owners.values() and not link.requests and not link.connected:
                self._close(link)

    def target(self, away: dict[str, int], here: int) -> Target | None:
        """Where to forward a request: the other plane's worker that holds the most of its
        tokens (`away`: per worker not registered here), when that is at least `min_tokens`
        more than any worker here holds (`here`) and its plane is connected."""
        best: Target | None = None
        for worker_id, tokens in away.items():
            link = self.links.get(self.owners.get(worker_id, ""))
            if link is None or not link.connected or tokens - here < self.min_tokens:
                continue
            if best is None or tokens > best.cached_tokens:
                best = Target(link.url, worker_id, tokens)
        return best

    def any_target(self) -> Target | None:
        """Where to forward a request that no worker here can take (this plane has none live):
        a worker of a connected plane, on the plane with the fewest forwarded requests
        outstanding per worker."""
        per_plane = Counter(self.owners.values())
        best: tuple[float, Target] | None = None
        for worker_id, url in sorted(self.owners.items()):
            link = self.links.get(url)
            if link is None or not link.connected:
                continue
            load = len(link.requests) / per_plane[url]
            if best is None or load < best[0]:
                best = (load, Target(url, worker_id, 0))
        return None if best is None else best[1]

    def reachable_workers(self) -> int:
        """The other planes' workers on connected planes: what requests can be forwarded to."""
        connected = {url for url, link in self.links.items() if link.connected}
        return sum(1 for url in self.owners.values() if url in connected)

    def done(self, url: str, request_id: str) -> None:
        """`request_id`, forwarded over `url`'s link, no longer waits on it (finished, aborted
        or taken back)."""
        link = self.links.get(url)
        if link is not None:
            link.requests.discard(request_id)

    def send(self, url: str, msg: protocol.Message) -> bool:
        """False when the peer cannot take it now (IMMEDIATE: nothing queues for a peer whose
        connection is down)."""
        link = self.links.get(url)
        if link is None:
            return False
        try:
            link.sock.send(protocol.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def lost(self) -> list[PeerLink]:
        """Links whose connection dropped since the last call (the peer died, or stopped
        answering heartbeats); each still holds the requests forwarded over it."""
        lost = []
        for link in self.links.values():
            for event in pending_events(link.monitor):
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    link.connected = True
                    log.info("peer.connected", url=link.url)
                elif event == zmq.EVENT_DISCONNECTED and link.connected:
                    link.connected = False
                    lost.append(link)
                    log.warning("peer.lost", url=link.url, requests=len(link.requests))
        return lost

    def close(self) -> None:
        for link in list(self.links.values()):
            self._close(link)

    def _connect(self, url: str) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        bound_socket(sock, CLIENT_MAX_MESSAGE_BYTES)
        heartbeat(sock)
        if self.keys is not None:
            self.keys.apply(sock)
        monitor = watch_connection(sock)
        sock.connect(url)
        self.poller.register(sock, zmq.POLLIN)
        self.links[url] = PeerLink(url, sock, monitor)
        log.info("peer.linked", url=url)

    def _close(self, link: PeerLink) -> None:
        self.poller.unregister(link.sock)
        link.sock.disable_monitor()
        link.sock.close(linger=0)
        link.monitor.close(linger=0)
        del self.links[link.url]
