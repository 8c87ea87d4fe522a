"""specserve's wire format: versioned msgspec MessagePack structs, one tagged union.

Three conversations share it, all through the control plane's one ROUTER socket:

- worker <-> control: `Register`/`Welcome`/`Heartbeat`/`Reregister`/`Rejected`, then `StepBatch`
  and `StepResult`. A step batch carries only what changed since the last step: new (or resumed)
  requests in full, running requests as small array-encoded deltas addressed by a per-worker
  integer handle. The worker keeps each request's tokens, block tables and drafts between steps.
- client <-> control: `GenerateRequest`/`AbortRequest` in, `RequestOutput`/`ErrorReply` out;
  `StatusRequest` in, `ServiceStatus` out (what an HTTP front end reports as health).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import msgspec

from specserve.shared.config import KVGroupSpec
from specserve.shared.msgpack_walk import (
    FrameLimitError,
    FrameShapeError,
    check_frame,
    leading_fields,
)

PROTOCOL_VERSION = 1
# The deepest legitimate message nests 7 containers (an OutputBatch's top logprob ids); a frame
# deeper than MAX_NESTING_DEPTH is refused before msgspec, whose recursion it could otherwise
# exhaust.
DEEPEST_MESSAGE = 7
MAX_NESTING_DEPTH = 32


WORKER_ID_CHARS = "A-Za-z0-9._-"
_WORKER_ID_RE = re.compile(f"[{WORKER_ID_CHARS}]{{1,64}}")


def check_worker_id(worker_id: str) -> str:
    """Worker ids are socket identities and appear in index keys and `<worker>@<epoch>`
    members, so they stay short and plain: no ':', '@' or '#'."""
    if not isinstance(worker_id, str) or not _WORKER_ID_RE.fullmatch(worker_id):
        shown = repr(worker_id)
        if len(shown) > 80:  # never echo a megabyte back
            shown = f"{shown[:64]}... ({len(worker_id)} characters)"
        raise ValueError(f"worker id {shown} must be 1-64 characters from [{WORKER_ID_CHARS}]")
    return worker_id


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    """Raise ValueError naming (up to five of) the ids outside [0, vocab_size)."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return  # two passes in C: this runs on every prompt as it enters
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} {bad[:5]} are outside the vocabulary (size {vocab_size})")


class ProtocolError(ValueError):
    """A frame that is not a valid specserve message of this protocol version.

    `request_id` is set when the frame still reads as a `generate` message with an id, so that
    the refusal can fail that request at its client instead of leaving it to time out.
    """

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


# float32's smallest normal number. A smaller temperature cannot scale float32 logits without
# overflow or division by (a flushed) zero, and its distribution is the argmax to float32
# precision anyway: such a temperature means greedy decoding.
MIN_TEMPERATURE = 2.0**-126


def is_greedy(temperature: float) -> bool:
    """True for temperature 0 and for any temperature below MIN_TEMPERATURE."""
    return temperature < MIN_TEMPERATURE


def validate_sampling(
    temperature: float, top_p: float, top_k: int, min_p: float, logprobs: int | None = None
) -> None:
    """Raise ValueError naming the first sampling value that cannot be honoured."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not (0.0 <= min_p <= 1.0):
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if logprobs is not None and logprobs < 0:
        raise ValueError(f"logprobs must be >= 0, got {logprobs}")


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Per-request sampling and stopping parameters."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; N: the chosen token's plus the top N
    # None: none; N: each prompt token's logprob (from the second on) plus the top N at its
    # position. Such a prompt is computed whole: prefix-cache hits are not used for it.
    prompt_logprobs: int | None = None
    # Text that ends the request where it first appears; the text sent stops before it (held
    # back while it could still be the start of one, so none of it ever reaches a stream).
    stop: tuple[str, ...] = ()
    # OpenAI's penalties on the logits of tokens already generated: presence subtracts its
    # value once per token that appeared, frequency once per appearance. vLLM's (and HF's)
    # repetition penalty divides the positive logits of every token of the prompt and output so
    # far by it, and multiplies the negative ones. Requests with a penalty are not speculated.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first impossible parameter."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        validate_sampling(self.temperature, self.top_p, self.top_k, self.min_p)
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (0 <= value <= 20):
                raise ValueError(f"{name} must be in [0, 20], got {value}")
        check_stop_strings(self.stop)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0):
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if vocab_size is not None:
            check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")


MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def check_stop_strings(stop: tuple[str, ...]) -> None:
    """Messages start with the parameter's name, as every sampling check's do."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for text in stop:
        if not 0 < len(text) <= MAX_STOP_CHARS:
            raise ValueError(f"stop strings must each have 1-{MAX_STOP_CHARS} characters")


class NewRequest(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A request the worker has no state for: first admission, or resumption after preemption."""

    handle: int
    request_id: str
    token_ids: list[int]  # the prompt, plus tokens generated before a preemption
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[list[int]]  # one block table per KV group
    num_computed_tokens: int  # KV already present (prefix-cache hit)
    num_scheduled_tokens: int
    # Part of its blocks' hashes: a worker that moves to another control plane reports it with
    # the blocks it keeps (`KeptRequest`), so that plane can hash them as this one did.
    cache_salt: str | None = None


class RunningDelta(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What changed for a request the worker already holds. Array-encoded to stay small."""

    handle: int
    num_computed_tokens: int
    num_scheduled_tokens: int  # includes the draft tokens to verify
    new_block_ids: list[list[int]] | None = None  # appended to the per-group block tables
    # Verify the first this-many drafts the worker proposed for this request in the last step;
    # the worker holds the draft ids, so they need not travel back.
    num_spec_tokens: int = 0


class StepBatch(msgspec.Struct, frozen=True, tag="step", forbid_unknown_fields=True):
    version: int
    step_id: int
    new_requests: list[NewRequest] = []
    running: list[RunningDelta] = []
    preempted: list[int] = []  # drop state; the request comes back as a NewRequest
    finished: list[int] = []  # finished or aborted: drop state

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(
            r.num_scheduled_tokens for r in self.running
        )


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Logprobs of each sampled token and of the top-N alternatives at its position."""

    chosen: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class RequestResult(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    handle: int
    sampled_token_ids: list[int]  # empty for a prefill chunk that does not end the prompt
    draft_token_ids: list[int] | None = None  # proposals for the next step
    logprobs: TokenLogprobs | None = None
    error: str | None = None  # this request failed; the others in the step are unaffected
    # Logprobs of prompt tokens `prompt_logprobs_from ..` (indices into the prompt, >= 1), as
    # far as this step's rows reach (a request that asked for them)
    prompt_logprobs: TokenLogprobs | None = None
    prompt_logprobs_from: int = 0


class StepResult(msgspec.Struct, frozen=True, tag="result", forbid_unknown_fields=True):
    version: int
    step_id: int
    results: list[RequestResult] = []


class WorkerInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a worker brings; the control plane builds that worker's scheduler from it."""

    worker_id: str
    model: str
    device: str
    kv_groups: list[KVGroupSpec]
    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_prefix_caching: bool = True
    spec_method: str = "none"
    num_spec_tokens: int = 0
    drafter_max_model_len: int | None = None
    pid: int = 0


class KeptRequest(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """The KV a registering worker still holds for a request of its last control plane: the
    tokens whose KV is computed and, per KV group, the blocks holding their full blocks."""

    token_ids: list[int]
    block_ids: list[list[int]]
    cache_salt: str | None = None


class Register(msgspec.Struct, frozen=True, tag="register", forbid_unknown_fields=True):
    """Worker -> control: join (or rejoin) with these capabilities. Its requests are void, but
    the KV of `kept` ones may be adopted as cached prefixes (their resumptions then hit it)."""

    version: int
    info: WorkerInfo
    kept: list[KeptRequest] = []


class Welcome(msgspec.Struct, frozen=True, tag="welcome", forbid_unknown_fields=True):
    """Control -> worker: registered. `session` names this control-plane instance."""

    version: int
    worker_id: str
    session: str
    epoch: int  # the worker's epoch in the prefix index (-1 while Redis is unavailable)


class Rejected(msgspec.Struct, frozen=True, tag="rejected", forbid_unknown_fields=True):
    """Control -> worker: registration refused (e.g. a different model); the worker exits."""

    version: int
    reason: str


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat", forbid_unknown_fields=True):
    """Worker -> control, on its own socket and thread, so a long step never looks like death."""

    version: int
    worker_id: str
    session: str  # the control-plane session the worker registered with ("" before that)


class Reregister(msgspec.Struct, frozen=True, tag="reregister", forbid_unknown_fields=True):
    """Control -> worker: this control plane does not know you (e.g. it restarted)."""

    version: int
    reason: str


class Leaving(msgspec.Struct, frozen=True, tag="leaving", forbid_unknown_fields=True):
    """Worker -> control: I am stopping (SIGTERM): send me no new work and move my requests to
    other workers; answered with `Released` once they have moved."""

    version: int
    worker_id: str


class Released(msgspec.Struct, frozen=True, tag="released", forbid_unknown_fields=True):
    """Control -> worker: nothing of yours is left here; you may exit."""

    version: int


CHAT_ROLES = ("system", "user", "assistant")


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str  # one of CHAT_ROLES
    content: str


class Resume(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a client already holds of a request it sends again because the control plane that
    served it went away: the request goes on from there, at the same sampling positions, so the
    client's stream continues without a token lost or repeated."""

    output_token_ids: list[int]  # every output token the client received
    num_text_chars: int = 0  # how much of their text it received (the rest was held back)


class GenerateRequest(msgspec.Struct, frozen=True, tag="generate", forbid_unknown_fields=True):
    """Client -> control. Exactly one of `prompt` (text), `prompt_token_ids` and `messages` (a
    conversation, rendered through the model's chat template with the assistant's turn open).

    With `resume`, the request is one a client sent before to a control plane that went away:
    with output tokens to resume from, the prompt must be the `prompt_token_ids` the first output
    reported. A resume of an id still in flight replaces that request (its client lost it).
    """

    version: int
    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    sampling: SamplingParams = SamplingParams()
    chat: bool = False  # wrap a text prompt in the model's chat template
    stream: bool = True  # False: one RequestOutput when the request finishes
    cache_salt: str | None = None  # tenant isolation: prefixes are shared only within a salt
    priority: int = 0
    resume: Resume | None = None
    # Sent on by another control plane whose index lookup found this plane's worker holding
    # more of its prefix: served here, never forwarded again.
    forwarded: bool = False
    # Set by a forwarding control plane: the authenticated key of the client it serves, so
    # that this client may resume the request here if that plane dies (read only from a
    # control plane's connection).
    origin_key: str = ""


class AbortRequest(msgspec.Struct, frozen=True, tag="abort", forbid_unknown_fields=True):
    version: int
    request_id: str


class SpecStats(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_counts: list[int]  # [a]: draft rounds that accepted exactly `a` drafts


class RequestOutput(msgspec.Struct, frozen=True, tag="output", forbid_unknown_fields=True):
    """Control -> client: new tokens of one request (all of them when not streaming)."""

    version: int
    request_id: str
    token_ids: list[int]
    text: str | None = None  # the text of `token_ids` (None without a tokenizer)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_token_ids: list[int] | None = None  # on the first output only
    # Logprobs of prompt tokens 1.. (the first has none), on the first output, when asked for
    prompt_logprobs: TokenLogprobs | None = None
    num_cached_tokens: int | None = None  # prefix-cache hit at admission (first output only)
    worker_id: str | None = None  # the worker serving it (first output, and after a resume)
    spec: SpecStats | None = None  # on the last output, when speculation ran
    # The error is the control plane's, not the request's (it is shutting down): a client may
    # send the request again, with `resume`, to the plane that replaces it.
    resumable: bool = False


class OutputBatch(msgspec.Struct, frozen=True, tag="outputs", forbid_unknown_fields=True):
    """Control -> client: a step's outputs for one client's requests, in one frame. A client
    streaming many requests gets one frame (and one wake-up) per step instead of one per
    request; each output reads as if it had come alone, in order."""

    version: int
    outputs: list[RequestOutput]


class StatusRequest(msgspec.Struct, frozen=True, tag="status", forbid_unknown_fields=True):
    """Client -> control: how is the service? Answered with a `ServiceStatus`."""

    version: int


class ServiceStatus(msgspec.Struct, frozen=True, tag="service_status", forbid_unknown_fields=True):
    """Control -> client: the served model and what can serve it now."""

    version: int
    model: str
    live_workers: int
    max_model_len: int | None  # the smallest of the live workers' (None without workers)
    requests_in_flight: int
    # Other control planes' live workers this plane forwards requests to when none of its own
    # is live (forwarding on, their plane connected).
    peer_workers: int = 0


class ErrorReply(msgspec.Struct, frozen=True, tag="error", forbid_unknown_fields=True):
    """Control -> client: a message that could not be accepted. Nothing was started for it."""

    version: int
    message: str
    request_id: str | None = None
    # Why, for a program: "invalid" (the request itself; do not retry it as it is) or
    # "overloaded" (the service is at a limit now; retry later).
    code: str = "invalid"


Message = (
    StepBatch
    | StepResult
    | Register
    | Welcome
    | Rejected
    | Heartbeat
    | Reregister
    | Leaving
    | Released
    | GenerateRequest
    | AbortRequest
    | StatusRequest
    | RequestOutput
    | OutputBatch
    | ServiceStatus
    | ErrorReply
)
MESSAGE_TYPES = tuple(sorted(cls.__struct_config__.tag for cls in Message.__args__))


class _Header(msgspec.Struct):
    type: str = ""
    version: int = -1


# msgspec raises UnicodeDecodeError, not DecodeError, for a map key that is not UTF-8.
_DECODE_ERRORS = (msgspec.DecodeError, UnicodeDecodeError)
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_header_decoder = msgspec.msgpack.Decoder(_Header)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(
    data: bytes, max_depth: int = MAX_NESTING_DEPTH, max_items: int | None = None
) -> Message:
    """Decode one frame, raising ProtocolError with the reason when it is not a valid message.

    With an object budget (`max_items`, what a control plane sets for what it is sent) or a
    depth limit below `DEEPEST_MESSAGE`, the frame's shape is checked first (`check_frame`:
    nesting depth, object count, element counts its size can hold), so no decoding recurses
    without bound or allocates for elements the frame does not hold. Otherwise msgspec decodes
    the frame at once: against the message types it nests at most `DEEPEST_MESSAGE` deep and it
    refuses a length the frame cannot hold, so a bad frame fails there (a RecursionError at
    worst, skipping a deep field) and only then is its shape walked, to explain it; a good one
    costs a tenth of the walk (a 32-output batch: 20 us against 200).
    """
    if max_items is None and max_depth >= DEEPEST_MESSAGE:
        try:
            return _checked_version(_decoder.decode(data), data)
        except (*_DECODE_ERRORS, RecursionError):
            pass  # explained below, without recursion
    try:
        check_frame(data, max_depth, max_items)
    except FrameLimitError as exc:
        reason = f"frame refused ({len(data)} bytes): {exc}"
        raise ProtocolError(reason, _generate_id(data)) from None
    except FrameShapeError as exc:
        raise ProtocolError(_not_a_message(data, exc), _generate_id(data)) from None
    try:
        msg = _decoder.decode(data)
    except _DECODE_ERRORS as exc:
        raise ProtocolError(_diagnose(data, exc), _generate_id(data)) from exc
    return _checked_version(msg, data)


def _checked_version(msg: Message, data: bytes) -> Message:
    if msg.version != PROTOCOL_VERSION:
        raise ProtocolError(_version_error(msg.version), _generate_id(data))
    return msg


def _generate_id(data: bytes) -> str | None:
    """The request id of a refused frame that reads as a `generate` message, if it has one."""
    fields = leading_fields(data)
    request_id = fields.get("request_id")
    if fields.get("type") == "generate" and isinstance(request_id, str) and request_id:
        return request_id
    return None


def _not_a_message(data: bytes, exc: Exception) -> str:
    return f"malformed frame ({len(data)} bytes): not a specserve message ({exc})"


def _version_error(version: int) -> str:
    return f"unsupported protocol version {version}; this side speaks version {PROTOCOL_VERSION}"


def _diagnose(data: bytes, exc: Exception) -> str:
    try:
        header = _header_decoder.decode(data)
    except _DECODE_ERRORS:
        return _not_a_message(data, exc)
    if header.version not in (-1, PROTOCOL_VERSION):
        return _version_error(header.version)
    if header.type not in MESSAGE_TYPES:
        return f"unknown message type {header.type!r}; expected one of {', '.join(MESSAGE_TYPES)}"
    return f"malformed {header.type!r} message: {exc}"
