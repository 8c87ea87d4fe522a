"""The client-facing half of the control plane: turning requests into token ids, and tokens
back into the outputs a client receives (incremental text, finish reasons, first-output
metadata), for every request a client has in flight."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import jinja2
import msgspec
import structlog

from specserve.control.metrics import ServiceMetrics
from specserve.control.request import SpecDecodingStats
from specserve.control.scheduler import RequestUpdate
from specserve.shared.protocol import (
    CHAT_ROLES,
    PROTOCOL_VERSION,
    ChatMessage,
    ErrorReply,
    GenerateRequest,
    Message,
    OutputBatch,
    RequestOutput,
    SamplingParams,
    SpecStats,
    TokenLogprobs,
    check_token_ids,
)
from specserve.shared.tokenizer import DetokenizeOffsets, Tokenizer

log = structlog.get_logger(__name__)

MAX_REQUEST_ID_LEN = 256


class Overloaded(ValueError):
    """A valid request refused for now: the service is at one of its limits."""


class AlreadyResumed(Exception):
    """A resume of a request this same connection already resumed (a client resends what it
    could not know arrived): the request in flight is the one it asked for, so nothing is done."""


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
    prompt_logprobs: TokenLogprobs | None = None  # held until the next output carries them
    announced_worker: str | None = None  # the worker id last sent to the client
    sent_first: bool = False
    offsets: DetokenizeOffsets | None = None
    held_text: str = ""  # decoded but not sent: it could be the start of a stop string
    last_token_time: float | None = None
    num_resumptions: int = 0  # moves to another worker on this control plane
    resumed: bool = False  # its client resumed it here after losing another control plane
    # Served on this plane whatever the index says: another plane forwarded it here, or it
    # came back from the plane it was forwarded to (which refused it, stopped or died).
    stays: bool = False
    forwarded_to: str | None = None  # served by the control plane at this URL, relayed here
    sent_chars: int = 0  # characters of text its client has (streamed from here or relayed)
    hold_until: float | None = None  # waiting (resumed) for the worker that holds its KV
    client_key: str = ""  # the client's authenticated CURVE key ("" without authentication)
    # Forwarded here by another control plane: `client` is that plane's link and `client_key`
    # the key of the client it serves, who may resume the request here if that plane dies.
    via_plane: bool = False


Send = Callable[[bytes, Message], bool]  # False when the peer is gone


@dataclass(frozen=True)
class PromptLimit:
    """The most prompt tokens a request may have, and what sets that bound (for the error)."""

    tokens: int
    why: str


class Frontend:
    """Tokenization, validation and detokenization for one served model, and the requests that
    clients have in flight.

    `send` is the control plane's socket; `withdraw` stops a request on its worker (or wherever
    placement holds it) when its client goes away.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        metrics: ServiceMetrics,
        send: Send,
        withdraw: Callable[[ClientRequest], None],
        max_pending_per_client: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._send = send
        self._withdraw = withdraw
        self.max_pending_per_client = max_pending_per_client
        self.requests: dict[str, ClientRequest] = {}
        self.pending = Counter[bytes]()  # per client: its requests in `requests`
        # While a step's updates are delivered: each client's outputs, sent as one frame after.
        self._outbox: dict[bytes, list[RequestOutput]] | None = None

    # --- requests in ----------------------------------------------------------------------

    def accept(
        self,
        client: bytes,
        msg: GenerateRequest,
        vocab_size: int,
        worker_eos_token_ids: tuple[int, ...],
        prompt_limit: PromptLimit | None = None,
        client_key: str = "",
        via_plane: bool = False,
    ) -> ClientRequest:
        """Validate and tokenize a new request, the one time it is checked, and track it;
        ValueError naming what is wrong with it. `via_plane`: another control plane forwarded
        it for its client, whose key is `client_key`.

        Token ids (the prompt's and the stop ids) must lie below `vocab_size`, and the prompt
        within `prompt_limit`; placement and the scheduler take what is accepted here as valid.
        The cheap checks (ids, counts, lengths) come before the ones that cost per token.
        A resumed request goes on from the output its client already has (`_resume`).
        """
        request_id = msg.request_id
        self.check_request_id(request_id)
        old = self.requests.get(request_id)
        if old is not None:
            _check_take_over(old, client, client_key, msg)
        cap = self.max_pending_per_client
        if cap is not None and self.pending[client] >= cap:
            raise Overloaded(
                f"this client already has {self.pending[client]} requests in flight, the most "
                f"allowed (--max-pending-per-client {cap}); wait for one to finish"
            )
        msg.sampling.validate(vocab_size)
        prompt = self.prompt_token_ids(msg, vocab_size, prompt_limit)
        eos = self.tokenizer.eos_token_ids if self.tokenizer else worker_eos_token_ids
        req = ClientRequest(
            request_id=request_id,
            client=client,
            client_key=client_key,
            via_plane=via_plane,
            prompt_token_ids=prompt,
            sampling=self.with_stop_ids(msg.sampling, eos),
            stream=msg.stream,
            cache_salt=msg.cache_salt,
            priority=msg.priority,
            eos_token_id=eos[0] if eos else None,
            stays=msg.forwarded,
        )
        if msg.resume is not None:
            self._resume(req, msg, vocab_size, prompt_limit)
        if old is not None:  # checked and valid: it replaces the request its client lost
            log.info("request.taken_over", request_id=request_id, from_plane=old.via_plane)
            self._withdraw(old)
            if old.via_plane:  # its plane may live on: it hears that the request moved here
                self.finish(old, [], "abort", "its client resumed it on another connection")
            else:
                self._forget(old)
        self.requests[request_id] = req
        self.pending[client] += 1
        log.debug("request.accepted", request_id=request_id, prompt_tokens=len(prompt))
        return req

    def _resume(
        self,
        req: ClientRequest,
        msg: GenerateRequest,
        vocab_size: int,
        limit: PromptLimit | None = None,
    ) -> None:
        """Set `req` to go on from what its client already has: its output tokens (checked like
        a prompt's) and as much of their text as it was sent; the rest of that text, held back
        when the request moved, is sent before new text."""
        assert msg.resume is not None
        resume = msg.resume
        done = list(resume.output_token_ids)
        if done and not req.stream:
            raise ValueError("resume: a request that is not streamed has no output to resume from")
        if done and msg.prompt_token_ids is None:
            raise ValueError("resume: with output tokens, the prompt must be prompt_token_ids")
        check_token_ids(done, vocab_size, "resume output token ids")
        total = len(req.prompt_token_ids) + len(done)
        if done and limit is not None and total > limit.tokens:
            raise ValueError(
                f"resume: the prompt and its output tokens hold {total} tokens; at most "
                f"{limit.tokens} can be taken up again ({limit.why})"
            )
        max_tokens = req.sampling.max_tokens
        if len(done) >= max_tokens:
            raise ValueError(f"resume: {len(done)} output tokens already, max_tokens {max_tokens}")
        req.output_token_ids = done
        req.sent_first = True  # the client has the first output's metadata, or asked for none
        req.last_token_time = req.arrival
        self.continue_from(req, resume.num_text_chars)

    def continue_from(self, req: ClientRequest, num_text_chars: int) -> None:
        """Set `req`, whose client holds its output tokens and `num_text_chars` characters of
        their text, to go on from there (resumed by its client, or taken back from a control
        plane it was forwarded to): the text not yet sent is held and goes out first."""
        req.resumed = True
        req.sent_chars = max(num_text_chars, 0)
        self.metrics.resumed.inc()
        done = req.output_token_ids
        if self.tokenizer is None or not done:
            return
        # Decoded up to the last whole character (a character's bytes may span a few tokens);
        # the rest is decoded with the tokens that complete it, as on the plane it came from.
        ids = req.prompt_token_ids + done
        start = self.tokenizer.stream_offsets(req.prompt_token_ids)
        text, req.offsets = "", start
        for end in range(len(ids), max(len(ids) - 8, len(req.prompt_token_ids)), -1):
            text, req.offsets = self.tokenizer.decode_incremental(ids[:end], start)
            if text:
                break
        req.held_text = text[max(num_text_chars, 0) :]

    @staticmethod
    def start_over(req: ClientRequest) -> None:
        """Forget the output of `req`, which is not streamed (its client has none of it), so
        that it can be served again from its prompt."""
        assert not req.stream
        req.output_token_ids, req.logprobs, req.text = [], [], []
        req.offsets, req.held_text = None, ""

    def prompt_token_ids(
        self, msg: GenerateRequest, vocab_size: int, limit: PromptLimit | None = None
    ) -> list[int]:
        """The prompt as token ids; ValueError naming what is wrong with it.

        Its length is checked before its ids are range-checked; a text prompt too long for
        `limit` even at the longest token per position is refused before it is tokenized.
        """
        given = [
            f for f in ("prompt", "prompt_token_ids", "messages") if getattr(msg, f) is not None
        ]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt (text), prompt_token_ids and messages")
        if msg.prompt_token_ids is not None:
            if msg.chat:
                raise ValueError("chat applies to text prompts only")
            _check_prompt_length(len(msg.prompt_token_ids), limit)
            ids = list(msg.prompt_token_ids)
            check_token_ids(ids, vocab_size, "prompt token ids")
        else:
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: send prompt_token_ids")
            raw = msg.prompt if msg.messages is None else "".join(m.content for m in msg.messages)
            assert raw is not None
            longest = self.tokenizer.max_token_chars
            if limit is not None and len(raw) > limit.tokens * longest:
                raise ValueError(
                    f"the prompt has {len(raw)} characters, more than {limit.tokens} "
                    f"tokens can hold (the longest token has {longest}); at most "
                    f"{limit.tokens} prompt tokens are allowed ({limit.why})"
                )
            if msg.messages is not None:
                text, special = self._render_chat(msg.messages), False
            elif msg.chat:
                text, special = self._render_chat([ChatMessage("user", raw)]), False
            else:
                text, special = raw, True
            ids = self.tokenizer.encode(text, add_special_tokens=special)
            _check_prompt_length(len(ids), limit)
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def _render_chat(self, messages: list[ChatMessage]) -> str:
        """A conversation as prompt text, the assistant's turn opened (the template's text
        already holds its special tokens)."""
        assert self.tokenizer is not None
        if not messages:
            raise ValueError("messages must hold at least one message")
        for message in messages:
            if message.role not in CHAT_ROLES:
                raise ValueError(
                    f"message role {message.role[:32]!r} is not one of {', '.join(CHAT_ROLES)}"
                )
        turns = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(turns, add_generation_prompt=True)
        except jinja2.TemplateError as exc:  # e.g. the template wants roles to alternate
            raise ValueError(f"the model's chat template refused these messages: {exc}") from None

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

    # --- requests refused, aborted or abandoned --------------------------------------------

    def reject(
        self, client: bytes, request_id: str | None, reason: str, code: str = "invalid"
    ) -> None:
        """Answer a request that will not be served with an ErrorReply naming the reason."""
        self.metrics.rejected.inc()
        log.info("request.rejected", request_id=request_id, reason=reason)
        self._send(client, ErrorReply(PROTOCOL_VERSION, reason, request_id, code))

    def refuse(self, req: ClientRequest, reason: str) -> None:
        """Forget an accepted request that no worker can serve, and tell its client why."""
        self._forget(req)
        self.reject(req.client, req.request_id, reason)

    def _forget(self, req: ClientRequest) -> None:
        """Stop tracking `req` (once: a second call does nothing)."""
        if self.requests.get(req.request_id) is not req:
            return
        del self.requests[req.request_id]
        self.pending[req.client] -= 1
        if not self.pending[req.client]:
            del self.pending[req.client]

    def abort(self, client: bytes, request_id: str) -> None:
        """A client's abort: stop the request and send its final output."""
        req = self.requests.get(request_id)
        if req is None or req.client != client:
            return  # finished already, or not this client's: nothing to do
        self._withdraw(req)
        self.finish(req, [], "abort", None)

    def fail_all(self, error: str) -> None:
        """A final error output for every request in flight (the control plane is stopping)."""
        for req in list(self.requests.values()):
            self.finish(req, [], "error", error, resumable=True)

    def _client_gone(self, client: bytes) -> None:
        gone = [r for r in self.requests.values() if r.client == client]
        log.info("client.gone", requests=len(gone))
        for req in gone:
            self._withdraw(req)
            self._forget(req)
            self.metrics.requests.labels("abort").inc()

    # --- outputs ------------------------------------------------------------------------------

    def deliver(self, updates: list[RequestUpdate]) -> None:
        """Pass one step's updates on to their clients (buffered for non-streaming requests).
        A stop string in the new text ends its request there, on its worker too."""
        now = time.monotonic()
        self._outbox = {}
        try:
            self._deliver(updates, now)
        finally:
            outbox, self._outbox = self._outbox, None
            for client, outputs in outbox.items():
                batch = outputs[0] if len(outputs) == 1 else OutputBatch(PROTOCOL_VERSION, outputs)
                if not self._send(client, batch):
                    self._client_gone(client)

    def _deliver(self, updates: list[RequestUpdate], now: float) -> None:
        for update in updates:
            req = self.requests.get(update.request_id)
            if req is None:
                continue  # aborted, or its client is gone
            new = update.new_token_ids
            if not new and not update.finished:
                continue  # e.g. a prefill chunk: nothing to send, no text to decode
            if new:
                self._record_tokens(req, new, now)
            if update.prompt_logprobs is not None:
                req.prompt_logprobs = update.prompt_logprobs
            logprobs = [update.logprobs] if update.logprobs is not None else []
            text, stopped = self.text_delta(req, final=update.finished)
            if stopped and not update.finished:
                self._withdraw(req)
                self.finish(req, new, "stop", None, logprobs, update.spec_stats, text)
            elif update.finished:
                reason = "stop" if stopped else update.status.finish_reason
                self.finish(req, new, reason, update.error, logprobs, update.spec_stats, text)
            else:
                self._emit(req, new, text, logprobs)

    def relay(self, req: ClientRequest, out: RequestOutput) -> None:
        """Pass on an output of the control plane `req` was forwarded to, as it came, keeping
        what a resume here would need: the tokens and how much text the client got. (That
        plane counts the request in its metrics; this one counts it as forwarded.)"""
        if req.stream:
            req.output_token_ids.extend(out.token_ids)
            req.sent_chars += len(out.text or "")
        req.sent_first = True
        if out.finished:
            self._forget(req)
        if not self._send(req.client, out):
            self._client_gone(req.client)

    def _record_tokens(self, req: ClientRequest, new: list[int], now: float) -> None:
        if req.last_token_time is None:
            self.metrics.ttft.observe(now - req.arrival)
        else:
            gap = (now - req.last_token_time) / len(new)
            for _ in new:
                self.metrics.itl.observe(gap)
        req.last_token_time = now
        req.output_token_ids.extend(new)
        self.metrics.generated_tokens.inc(len(new))

    def _emit(
        self, req: ClientRequest, new: list[int], text: str | None, logprobs: list[TokenLogprobs]
    ) -> None:
        if not req.stream:
            if text:
                req.text.append(text)
            req.logprobs.extend(logprobs)
            return
        self._send_output(req.client, self.output(req, new, text, logprobs=logprobs or None))

    def finish(
        self,
        req: ClientRequest,
        new: list[int],
        reason: str | None,
        error: str | None,
        logprobs: list[TokenLogprobs] | None = None,
        stats: SpecDecodingStats | None = None,
        text: str | None = None,
        resumable: bool = False,
    ) -> None:
        """The request's last output: the rest of its text (all of it without streaming), the
        finish reason and its speculative decoding statistics. `text`: the last text delta
        when the caller has decoded it already (else it is decoded here). `resumable`: the
        error is the control plane's, and the client may resume the request elsewhere."""
        self._forget(req)
        self.metrics.requests.labels(reason or "unknown").inc()
        spec = None
        if stats is not None and stats.num_drafts:
            self.metrics.acceptance_length.observe(stats.mean_acceptance_length)
            spec = SpecStats(
                stats.num_drafts,
                stats.num_draft_tokens,
                stats.num_accepted_tokens,
                list(stats.accepted_counts),
            )
        if text is None:
            text, _ = self.text_delta(req, final=True)
        if req.stream:
            tokens, out_logprobs = new, logprobs
        else:
            tokens = req.output_token_ids
            out_logprobs = req.logprobs + (logprobs or [])
            text = "".join(req.text) + (text or "") if text is not None else None
        out = self.output(
            req, tokens, text, finished=True, finish_reason=reason, error=error,
            logprobs=out_logprobs or None, spec=spec, resumable=resumable,
        )  # fmt: skip
        self._send_output(req.client, out)
        log.debug("request.finished", request_id=req.request_id, reason=reason, error=error)

    def _send_output(self, client: bytes, out: RequestOutput) -> None:
        """Send an output now, or with the rest of its client's while a step is delivered."""
        if self._outbox is not None:
            self._outbox.setdefault(client, []).append(out)
        elif not self._send(client, out):
            self._client_gone(client)

    def text_delta(self, req: ClientRequest, final: bool) -> tuple[str | None, bool]:
        """Text completed by the newest tokens, and whether it holds a stop string.

        Held back while a character is incomplete, and while its end could still grow into one
        of the request's stop strings; with a stop string, the text up to it (`final` sends
        everything that is held).
        """
        if self.tokenizer is None:
            return None, False
        if req.offsets is None:
            req.offsets = self.tokenizer.stream_offsets(req.prompt_token_ids)
        ids = req.prompt_token_ids + req.output_token_ids
        delta, req.offsets = self.tokenizer.decode_incremental(ids, req.offsets, final=final)
        stops = req.sampling.stop
        if not stops:
            delta, req.held_text = req.held_text + delta, ""
            return delta, False
        return _cut_at_stop(req, req.held_text + delta, stops, final)

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
        resumable: bool = False,
    ) -> RequestOutput:
        first = not req.sent_first
        req.sent_first = True
        if req.stream:
            req.sent_chars += len(text or "")
        prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
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
            prompt_logprobs=prompt_logprobs,
            worker_id=worker,
            spec=spec,
            resumable=resumable,
        )


def _check_take_over(old: ClientRequest, client: bytes, key: str, msg: GenerateRequest) -> None:
    """A request id already in flight: only a resume from the same client on a new connection
    may replace it (that connection is gone, and nothing more it sends will be read), or from
    the client another plane forwarded it for (that plane is gone); anything else is refused,
    and a resend on the same connection changes nothing (AlreadyResumed)."""
    if msg.resume is None or old.client_key != key:
        raise ValueError(f"request id {msg.request_id!r} is already in flight")
    if old.client == client:
        raise AlreadyResumed(msg.request_id)


def _cut_at_stop(
    req: ClientRequest, text: str, stops: tuple[str, ...], final: bool
) -> tuple[str, bool]:
    """Split `text` (everything not sent yet) at the first stop string; without one, keep back
    the longest stop string's length less one character (unless `final`)."""
    hits = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    if hits:
        req.held_text = ""
        return text[: min(hits)], True
    keep = 0 if final else max(map(len, stops)) - 1
    cut = max(len(text) - keep, 0)
    req.held_text = text[cut:]
    return text[:cut], False


def _check_prompt_length(num_tokens: int, limit: PromptLimit | None) -> None:
    if limit is not None and num_tokens > limit.tokens:
        raise ValueError(
            f"the prompt has {num_tokens} tokens; at most {limit.tokens} prompt tokens are "
            f"allowed ({limit.why})"
        )
