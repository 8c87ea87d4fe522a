"""The client SDK: send requests to a running specserve control plane over ZeroMQ.

The control plane listens on one ROUTER socket; a client connects a DEALER socket to it and speaks
the versioned msgspec messages of `specserve.shared.protocol`: `GenerateRequest`/`AbortRequest`
out, `RequestOutput`/`ErrorReply` back (`get_status`/`fetch_status`: `StatusRequest` out,
`ServiceStatus` back). Outputs of many requests share the socket, so the client
demultiplexes them by request id.

One implementation serves both clients (`core.ClientCore`): `Client` (`sync.py`) waits on its
socket in the calling thread, `AsyncClient` (`aio.py`) in one background receive task. A request
the client gives up on is aborted and its id kept as a tombstone, so that its late outputs are
dropped and a retry under the same id never receives them (`tombstones.py`).
"""

from specserve.client.aio import AsyncClient
from specserve.client.core import CLOSE_LINGER_MS, DEFAULT_TIMEOUT, DEFAULT_URL
from specserve.client.errors import (
    RequestFailed,
    RequestTimeout,
    ServiceError,
    ServiceUnreachable,
)
from specserve.client.state import Completion
from specserve.client.status import fetch_status, get_status
from specserve.client.sync import Client
from specserve.client.tombstones import TOMBSTONE_TTL_S
from specserve.client.wire import Prompt, Reply, build_request, check_reply, parse_replies
from specserve.shared.protocol import ChatMessage, SamplingParams, ServiceStatus

__all__ = [
    "CLOSE_LINGER_MS",
    "DEFAULT_TIMEOUT",
    "DEFAULT_URL",
    "TOMBSTONE_TTL_S",
    "AsyncClient",
    "ChatMessage",
    "Client",
    "Completion",
    "Prompt",
    "Reply",
    "RequestFailed",
    "RequestTimeout",
    "SamplingParams",
    "ServiceError",
    "ServiceStatus",
    "ServiceUnreachable",
    "build_request",
    "check_reply",
    "fetch_status",
    "get_status",
    "parse_replies",
]
