"""The client-facing half of the control plane: turning requests into token ids, and tokens
back into the outputs a client receives (incremental text, first-output metadata)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    GenerateRequest,
    RequestOutput,
    SamplingParams,
    SpecStats,
    TokenLogprobs,
    check_token_ids,
)
from specserve.shared.tokenizer import DetokenizeOffsets, Tokenizer

MAX_REQUEST_ID_LEN = 256


@dataclass(eq=False)
class ClientRequest:
    """One accepted request as the control plane tracks it, across workers and resumptions
    (by identity: two requests are never equal)."""

    request_id: str
    client: bytes  # the ZeroMQ identity to answer
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stream: bool
    cache_salt: str | None
    priority: int
    eos_token_id: int | None
    arrival: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)  # delivered (or buffered) so far
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # kept only when not streaming
    text: list[str] = field(default_factory=list)  # kept only when not streaming
    worker_id: str | None = None
    num_cached_tokens: int | None = None
    announced_worker: str | None = None  # the worker id last sent to the client
    sent_first: bool = False
    offsets: DetokenizeOffsets | None = None
    last_token_time: float | None = None
    num_resumptions: int = 0


class Frontend:
    """Tokenization, validation and detokenization for one served model."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def prompt_token_ids(self, msg: GenerateRequest, vocab_size: int) -> list[int]:
        """The prompt as token ids; ValueError naming what is wrong with it."""
        if (msg.prompt is None) == (msg.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt (text) and prompt_token_ids")
        if msg.prompt_token_ids is not None:
            ids = list(msg.prompt_token_ids)
            check_token_ids(ids, vocab_size, "prompt token ids")
            if msg.chat:
                raise ValueError("chat applies to text prompts only")
        else:
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: send prompt_token_ids")
            assert msg.prompt is not None
            if msg.chat:
                text = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": msg.prompt}], add_generation_prompt=True
                )
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            else:
                ids = self.tokenizer.encode(msg.prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    @staticmethod
    def check_request_id(request_id: str) -> None:
        if not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
            raise ValueError(f"request_id must be 1-{MAX_REQUEST_ID_LEN} characters")

    @staticmethod
    def with_stop_ids(sampling: SamplingParams, eos_token_ids: tuple[int, ...]) -> SamplingParams:
        """Every EOS id of the model stops a request, not just the first one."""
        if sampling.ignore_eos or len(eos_token_ids) <= 1:
            return sampling
        extra = tuple(t for t in eos_token_ids[1:] if t not in sampling.stop_token_ids)
        return msgspec.structs.replace(sampling, stop_token_ids=sampling.stop_token_ids + extra)

    def text_delta(self, req: ClientRequest, final: bool) -> str | None:
        """Text completed by the newest tokens (held back while a character is incomplete)."""
        if self.tokenizer is None:
            return None
        if req.offsets is None:
            req.offsets = self.tokenizer.stream_offsets(req.prompt_token_ids)
        ids = req.prompt_token_ids + req.output_token_ids
        delta, req.offsets = self.tokenizer.decode_incremental(ids, req.offsets, final=final)
        return delta

    @staticmethod
    def output(
        req: ClientRequest,
        token_ids: list[int],
        text: str | None,
        *,
        finished: bool = False,
        finish_reason: str | None = None,
        error: str | None = None,
        logprobs: list[TokenLogprobs] | None = None,
        spec: SpecStats | None = None,
    ) -> RequestOutput:
        first = not req.sent_first
        req.sent_first = True
        worker = req.worker_id if req.worker_id != req.announced_worker else None
        req.announced_worker = req.worker_id
        return RequestOutput(
            PROTOCOL_VERSION,
            req.request_id,
            token_ids,
            text,
            finished=finished,
            finish_reason=finish_reason,
            error=error,
            logprobs=logprobs,
            prompt_token_ids=req.prompt_token_ids if first else None,
            num_cached_tokens=req.num_cached_tokens if first else None,
            worker_id=worker,
            spec=spec,
        )
