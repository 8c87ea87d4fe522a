"""The client's side of the wire: the messages it sends and what it makes of those it receives."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict, Unpack

import structlog
import zmq

from specserve.client.errors import RequestFailed
from specserve.shared import protocol
from specserve.shared.connection import heartbeat
from specserve.shared.curve import CLIENTS, DEFAULT_CLIENT_KEY, PeerKeys, peer_keys
from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    ChatMessage,
    ErrorReply,
    GenerateRequest,
    OutputBatch,
    ProtocolError,
    RequestOutput,
    SamplingParams,
)
from specserve.shared.socket_limits import CLIENT_MAX_MESSAGE_BYTES, bound_socket

log = structlog.get_logger(__name__)


class ConnectOptions(TypedDict, total=False):
    """How a client connects: `max_message_bytes` bounds an inbound message (default 256 MiB);
    `keys` (a `specserve keys generate` directory, or loaded `PeerKeys`) with `key_name`
    (default "client") authenticate with CURVE as `clients/<key_name>`."""

    max_message_bytes: int
    keys: PeerKeys | str | os.PathLike | None
    key_name: str


def connect_dealer(sock: zmq.Socket, url: str, **options: Unpack[ConnectOptions]) -> None:
    """Bound the client's DEALER (see socket_limits), heartbeat its connection, make it a CURVE
    client when keys are given, then connect it to `url`."""
    bound_socket(sock, options.get("max_message_bytes", CLIENT_MAX_MESSAGE_BYTES))
    heartbeat(sock)  # a control plane that stops answering drops the connection
    keys, key_name = options.get("keys"), options.get("key_name", DEFAULT_CLIENT_KEY)
    curve = peer_keys(keys, CLIENTS, key_name)
    if curve is not None:
        curve.apply(sock)
    sock.connect(url)


# A text, token ids, or a conversation: `ChatMessage`s or {"role": ..., "content": ...} dicts.
Prompt = str | Sequence[int] | Sequence[ChatMessage] | Sequence[Mapping[str, str]]
Reply = RequestOutput | ErrorReply


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
    text, token_ids, messages = _split_prompt(prompt)
    return GenerateRequest(
        version=PROTOCOL_VERSION,
        request_id=request_id,
        prompt=text,
        prompt_token_ids=token_ids,
        messages=messages,
        sampling=sampling,
        chat=chat,
        stream=stream,
        cache_salt=cache_salt,
        priority=priority,
    )


class Options(TypedDict, total=False):
    """The keyword options of `generate`, `stream` and `submit`.

    chat: apply the model's chat template to a text prompt. request_id: your id (default: a
    fresh one). cache_salt: a tenant's prefix-cache namespace. priority: lower runs first.
    timeout: seconds for the whole call (default: the client's).
    """

    chat: bool
    request_id: str | None
    cache_salt: str | None
    priority: int
    timeout: float | None


def request_args(
    prompt: Prompt, sampling: SamplingParams | None, options: Options, stream: bool
) -> tuple[RequestArgs, float | None]:
    """A call's `RequestArgs` and timeout; an unknown option is a TypeError, as for any call."""
    unknown = sorted(set(options) - set(Options.__annotations__))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
    args = RequestArgs(
        prompt,
        sampling,
        options.get("chat", False),
        options.get("request_id"),
        options.get("cache_salt"),
        options.get("priority", 0),
        stream,
    )
    return args, options.get("timeout")


@dataclass(frozen=True, slots=True)
class RequestArgs:
    """A call's request arguments as given. `build` checks them when the call runs, so an asyncio
    call raises where it is awaited, as an `async def` would."""

    prompt: Prompt
    sampling: SamplingParams | None
    chat: bool
    request_id: str | None
    cache_salt: str | None
    priority: int
    stream: bool

    def build(self) -> GenerateRequest:
        return build_request(
            self.prompt,
            self.sampling,
            chat=self.chat,
            request_id=self.request_id,
            cache_salt=self.cache_salt,
            priority=self.priority,
            stream=self.stream,
        )


def _split_prompt(
    prompt: Prompt,
) -> tuple[str | None, list[int] | None, list[ChatMessage] | None]:
    """Text goes as `prompt`, token ids as `prompt_token_ids`, a conversation as `messages`."""
    if isinstance(prompt, str):
        return prompt, None, None
    if isinstance(prompt, bytes | bytearray):
        raise TypeError("prompt must be a str, token ids or chat messages, not bytes")
    items = list(prompt)
    if items and all(isinstance(m, ChatMessage | Mapping) for m in items):
        return None, None, [_chat_message(m) for m in items]
    token_ids = [int(t) for t in items]  # type: ignore[arg-type]
    if not token_ids:
        raise ValueError("prompt_token_ids must not be empty")
    return None, token_ids, None


def _chat_message(message: ChatMessage | Mapping[str, str]) -> ChatMessage:
    if isinstance(message, ChatMessage):
        return message
    if set(message) != {"role", "content"}:
        raise ValueError(f"a chat message has a role and a content, got keys {sorted(message)}")
    return ChatMessage(str(message["role"]), str(message["content"]))


def abort_frame(request_id: str) -> bytes:
    return protocol.encode(AbortRequest(version=PROTOCOL_VERSION, request_id=request_id))


def parse_replies(frames: list[bytes]) -> list[Reply]:
    """Decode one message from the control plane into the replies it carries (a step's outputs
    come batched); none (logged) for anything no request awaits."""
    try:
        msg = protocol.decode(frames[-1])  # the payload is the last frame, delimiter or not
    except ProtocolError as exc:
        log.warning("client.frame.undecodable", error=str(exc), size=len(frames[-1]))
        return []
    if isinstance(msg, OutputBatch):
        return list(msg.outputs)
    if isinstance(msg, ErrorReply) and msg.request_id is None:
        # About a frame the control plane could not decode: no request of ours to fail.
        log.warning("client.server_error", message=msg.message)
        return []
    if not isinstance(msg, RequestOutput | ErrorReply):
        log.warning("client.frame.unexpected", type=type(msg).__name__)
        return []
    return [msg]


def check_reply(reply: Reply) -> RequestOutput:
    """The output itself, or RequestFailed when the request was refused or ended in an error."""
    if isinstance(reply, ErrorReply):
        raise RequestFailed(
            f"request {reply.request_id} refused: {reply.message}", reply.request_id, reply.code
        )
    if reply.finished and reply.finish_reason == "error":
        error = reply.error or "unknown error"
        raise RequestFailed(f"request {reply.request_id} failed: {error}", reply.request_id)
    return reply


def ends_request(reply: Reply) -> bool:
    """Whether nothing more will come for the reply's request."""
    return isinstance(reply, ErrorReply) or reply.finished
