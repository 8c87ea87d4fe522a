"""What the client holds for a request in flight, and what it hands back for a finished one."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import msgspec

from specserve.client.errors import UNREACHABLE_HINT, RequestTimeout, ServiceError
from specserve.client.wire import Reply, ends_request
from specserve.shared.protocol import (
    GenerateRequest,
    RequestOutput,
    Resume,
    SpecStats,
    TokenLogprobs,
)


@dataclass
class Completion:
    """The result of a whole request: every output of it folded together."""

    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None  # None when the control plane has no tokenizer
    finish_reason: str | None = None  # stop | length | abort
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Prompt tokens 1.. (the first has none), when `SamplingParams.prompt_logprobs` asked
    prompt_logprobs: TokenLogprobs | None = None
    num_cached_tokens: int | None = None
    worker_id: str | None = None  # the worker that served the request last
    spec: SpecStats | None = None

    def add(self, output: RequestOutput) -> None:
        """Fold in one output: streamed outputs carry only their new tokens, so they append."""
        self.token_ids.extend(output.token_ids)
        if output.text is not None:
            self.text = (self.text or "") + output.text
        if output.logprobs is not None:
            self.logprobs.extend(output.logprobs)
        if output.prompt_token_ids is not None:
            self.prompt_token_ids = list(output.prompt_token_ids)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.num_cached_tokens is not None and self.num_cached_tokens is None:
            self.num_cached_tokens = output.num_cached_tokens
        if output.worker_id is not None:  # a resumed request may move to another worker
            self.worker_id = output.worker_id
        if output.spec is not None:
            self.spec = output.spec
        if output.finished:
            self.finish_reason = output.finish_reason


def resolve_timeout(timeout: float | None, default: float | None) -> float | None:
    """A call's timeout in seconds: its own, else the client's; None or inf waits without limit."""
    chosen = default if timeout is None else timeout
    if chosen is None or math.isinf(chosen):
        return None
    if chosen < 0:
        raise ValueError(f"timeout must be >= 0, got {chosen}")
    return chosen


@dataclass(frozen=True, slots=True)
class Deadline:
    """When a call stops waiting, on the client's clock: `limit` seconds after it began (`at`);
    both None when it waits without limit. The limit is kept for the error messages."""

    limit: float | None
    at: float | None

    @classmethod
    def after(cls, limit: float | None, now: float) -> Deadline:
        return cls(limit, None if limit is None else now + limit)

    def passed(self, now: float) -> bool:
        return self.at is not None and now >= self.at

    def cap(self, when: float) -> float:
        """`when`, or the deadline if that comes first."""
        return when if self.at is None else min(when, self.at)

    def timed_out(self, request_id: str, heard: bool = True) -> RequestTimeout:
        """`heard`: whether the control plane ever answered this client; if not, the likelier
        trouble is the connection, and the message says so."""
        hint = "" if heard else f", and the control plane never answered: {UNREACHABLE_HINT}"
        return RequestTimeout(
            f"request {request_id} did not finish within {self.limit or 0.0:g} s{hint}", request_id
        )

    def not_sent(self, request_id: str) -> RequestTimeout:
        return RequestTimeout(
            f"request {request_id} was not sent: an earlier request with this id was still being "
            f"aborted after {self.limit or 0.0:g} s",
            request_id,
        )


@dataclass(slots=True)
class RequestState:
    """All the client holds for one request in flight: what was asked (prompt and sampling
    params, enough to send it again), until when its caller waits, the replies that arrived but
    are not taken yet, and every output taken so far (where a resumed stream would go on from)."""

    request: GenerateRequest
    deadline: Deadline
    # Replies in arrival order; a ServiceError wakes the waiter with an error instead.
    inbox: deque[Reply | ServiceError] = field(default_factory=deque)
    ended: bool = False  # its last reply has arrived (it may still be in the inbox)
    delivered: Completion = field(init=False)
    resumptions: int = 0  # times it was sent again after losing its control plane

    def __post_init__(self) -> None:
        self.delivered = Completion(self.request.request_id)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def file(self, item: Reply | ServiceError) -> None:
        self.inbox.append(item)
        if not isinstance(item, ServiceError) and ends_request(item):
            self.ended = True

    @property
    def resumable(self) -> bool:
        """Whether it can be sent again: it has not ended, and has not failed on this side."""
        return not self.ended and not any(isinstance(i, ServiceError) for i in self.inbox)

    def resume_request(self) -> GenerateRequest:
        """The request to send again after its control plane went away, going on from every
        output that arrived (taken or not): the prompt as the token ids the first output
        reported, and the tokens and text received since. With nothing received yet, the
        request as it was first sent."""
        outputs = [i for i in self.inbox if isinstance(i, RequestOutput)]
        tokens = list(self.delivered.token_ids)
        num_chars = len(self.delivered.text or "")
        prompt = self.delivered.prompt_token_ids or None
        for output in outputs:
            tokens.extend(output.token_ids)
            num_chars += len(output.text or "")
            prompt = prompt or output.prompt_token_ids
        resume = Resume(tokens, num_chars)
        if prompt is None:
            return msgspec.structs.replace(self.request, resume=resume)
        return msgspec.structs.replace(
            self.request,
            prompt=None,
            messages=None,
            chat=False,
            prompt_token_ids=list(prompt),
            resume=resume,
        )
