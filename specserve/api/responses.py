"""What the OpenAI-compatible endpoints send back: completions, chat completions, their
streamed chunks, usage and logprobs, from the SDK's `RequestOutput`s."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from specserve.shared.protocol import RequestOutput, SpecStats
from specserve.shared.tokenizer import Tokenizer

# (token id, its logprob, [(alternative id, its logprob), ...]); a prompt's first token has
# neither (None, None)
LogprobEntry = tuple[int, float | None, list[tuple[int, float]] | None]


@dataclass
class ChoiceState:
    """One choice as it accumulates: its text, tokens, logprobs and how it ended."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    spec: SpecStats | None = None
    logprob_entries: list[LogprobEntry] = field(default_factory=list)
    prompt_entries: list[LogprobEntry] = field(default_factory=list)  # when prompt logprobs came

    def add(self, output: RequestOutput) -> tuple[str, list[LogprobEntry]]:
        """Fold in one output; returns its new text and logprob entries."""
        if output.prompt_token_ids is not None:
            self.prompt_token_ids = list(output.prompt_token_ids)
        if output.prompt_logprobs is not None and self.prompt_token_ids:
            self.prompt_entries = _prompt_entries(self.prompt_token_ids, output)
        if output.num_cached_tokens is not None:
            self.num_cached_tokens = output.num_cached_tokens
        new_text = output.text or ""
        self.text += new_text
        entries = _logprob_entries(output)
        self.logprob_entries.extend(entries)
        self.token_ids.extend(output.token_ids)
        if output.finished:
            self.finish_reason = openai_finish_reason(output.finish_reason)
        if output.spec is not None:
            self.spec = output.spec
        return new_text, entries


def openai_finish_reason(reason: str | None) -> str | None:
    """OpenAI knows `stop` and `length`; an aborted request is reported as stopped."""
    return "length" if reason == "length" else ("stop" if reason is not None else None)


def _logprob_entries(output: RequestOutput) -> list[LogprobEntry]:
    """(token id, its logprob, [(alternative id, logprob)...]) for each new token."""
    if not output.logprobs:
        return []
    entries = []
    k = 0
    for step in output.logprobs:
        for j, chosen in enumerate(step.chosen):
            if k >= len(output.token_ids):
                break
            top = list(zip(step.top_ids[j], step.top_logprobs[j], strict=False))
            entries.append((output.token_ids[k], chosen, top))
            k += 1
    return entries


def _prompt_entries(prompt: list[int], output: RequestOutput) -> list[LogprobEntry]:
    """The prompt's tokens with their logprobs: none for the first, then one per later token."""
    lps = output.prompt_logprobs
    assert lps is not None
    entries: list[LogprobEntry] = [(prompt[0], None, None)]
    for token, chosen, ids, values in zip(
        prompt[1:], lps.chosen, lps.top_ids, lps.top_logprobs, strict=False
    ):
        entries.append((token, chosen, list(zip(ids, values, strict=False))))
    return entries


def usage(choices: list[ChoiceState]) -> dict[str, Any]:
    """Usage over every choice: each prompt counted once (its choices share its KV blocks)."""
    seen: set[tuple[int, ...]] = set()
    prompt_tokens = cached = 0
    for c in choices:
        key = tuple(c.prompt_token_ids)
        if key not in seen:
            seen.add(key)
            prompt_tokens += len(c.prompt_token_ids)
            cached += c.num_cached_tokens
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def spec_decoding(choices: list[ChoiceState]) -> dict[str, Any] | None:
    """The speculative decoding statistics, summed over the choices (an extension field)."""
    stats = [c.spec for c in choices if c.spec is not None]
    if not stats:
        return None
    drafts = sum(s.num_drafts for s in stats)
    draft_tokens = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
    }


class Formatter:
    """Builds the response bodies for one served model name."""

    def __init__(self, model: str, tokenizer: Tokenizer | None) -> None:
        self.model = model
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # --- completions ------------------------------------------------------------------------

    def completion_logprobs(
        self, entries: list[LogprobEntry], offset: int, prompt: list[LogprobEntry] | None = None
    ) -> dict[str, Any]:
        """OpenAI's legacy logprobs object; with `prompt` (echo), the prompt's tokens come first,
        their text offsets from 0, and the generated ones from `offset`."""
        tokens, offsets = [], []
        spans = [(prompt, 0)] if prompt is not None else []
        for part, start in [*spans, (entries, offset)]:
            for token_id, _, _ in part:
                text = self.token_text(token_id)
                tokens.append(text)
                offsets.append(start)
                start += len(text)
        every = [*(prompt or []), *entries]
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in every],
            "top_logprobs": [
                None if top is None else {self.token_text(t): lp for t, lp in top}
                for _, _, top in every
            ],
            "text_offset": offsets,
        }

    def completion(
        self, request_id: str, created: int, choices: list[ChoiceState], echo: list[str] | None,
        logprobs: bool, n: int,
    ) -> dict[str, Any]:  # fmt: skip
        body_choices = []
        for c in choices:
            prefix = echo[c.index // n] if echo is not None else ""
            entries = None
            if logprobs:
                prompt = c.prompt_entries if echo is not None else None
                entries = self.completion_logprobs(c.logprob_entries, len(prefix), prompt)
            body_choices.append({
                "index": c.index,
                "text": prefix + c.text,
                "logprobs": entries,
                "finish_reason": c.finish_reason,
            })  # fmt: skip
        return self.body(request_id, created, "text_completion", body_choices, choices)

    def completion_chunk(
        self, request_id: str, created: int, index: int, text: str,
        logprobs: dict[str, Any] | None, finish_reason: str | None,
    ) -> dict[str, Any]:  # fmt: skip
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        return self.body(request_id, created, "text_completion", [choice])

    # --- chat ---------------------------------------------------------------------------------

    def chat_logprobs(self, entries: list[LogprobEntry]) -> dict[str, Any]:
        content = []
        for token_id, lp, top in entries:
            text = self.token_text(token_id)
            content.append({
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (t := self.token_text(i)), "logprob": v, "bytes": list(t.encode())}
                    for i, v in top
                ],
            })  # fmt: skip
        return {"content": content}

    def chat(
        self, request_id: str, created: int, choices: list[ChoiceState], logprobs: bool
    ) -> dict[str, Any]:
        body_choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self.chat_logprobs(c.logprob_entries) if logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        return self.body(request_id, created, "chat.completion", body_choices, choices)

    def chat_chunk(
        self, request_id: str, created: int, index: int, delta: dict[str, Any],
        logprobs: dict[str, Any] | None, finish_reason: str | None,
    ) -> dict[str, Any]:  # fmt: skip
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        return self.body(request_id, created, "chat.completion.chunk", [choice])

    def usage_chunk(
        self, request_id: str, created: int, kind: str, choices: list[ChoiceState]
    ) -> dict[str, Any]:
        return self.body(request_id, created, kind, [], choices)

    def body(
        self, request_id: str, created: int, kind: str, body_choices: list[dict[str, Any]],
        totals: list[ChoiceState] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Every response and chunk: the envelope around its choices; with `totals`, the usage
        (and speculation statistics) of those choices."""
        body = {
            "id": request_id,
            "object": kind,
            "created": created,
            "model": self.model,
            "choices": body_choices,
        }
        if totals is not None:
            body["usage"] = usage(totals)
            spec = spec_decoding(totals)
            if spec is not None:
                body["spec_decoding"] = spec
        return body


class Chunks(Protocol):
    """The streamed chunks of one kind of response."""

    def opening(self, index: int) -> dict[str, Any] | None: ...

    def chunk(
        self, choice: ChoiceState, text: str, entries: list[LogprobEntry], offset: int
    ) -> dict[str, Any]: ...

    def usage(self, choices: list[ChoiceState]) -> dict[str, Any]: ...


@dataclass(frozen=True)
class CompletionChunks:
    formatter: Formatter
    request_id: str
    created: int
    logprobs: bool
    echo: list[str] | None  # per prompt
    n: int

    echoed: set[int] = field(default_factory=set)  # choices whose echo went with a chunk

    def opening(self, index: int) -> dict[str, Any] | None:
        """The echoed prompt, first; with logprobs it waits for the first chunk instead, since
        the prompt's logprobs arrive with the first tokens."""
        if self.echo is None or self.logprobs:
            return None
        text = self.echo[index // self.n]
        return self.formatter.completion_chunk(
            self.request_id, self.created, index, text, None, None
        )

    def chunk(
        self, choice: ChoiceState, text: str, entries: list[LogprobEntry], offset: int
    ) -> dict[str, Any]:
        logprobs = None
        if self.logprobs:
            prompt = None
            if self.echo is not None:  # text offsets count the echoed prompt
                prefix = self.echo[choice.index // self.n]
                offset += len(prefix)
                if choice.index not in self.echoed:
                    self.echoed.add(choice.index)
                    prompt, text = choice.prompt_entries, prefix + text
            logprobs = self.formatter.completion_logprobs(entries, offset, prompt)
        return self.formatter.completion_chunk(
            self.request_id, self.created, choice.index, text, logprobs, choice.finish_reason
        )

    def usage(self, choices: list[ChoiceState]) -> dict[str, Any]:
        return self.formatter.usage_chunk(self.request_id, self.created, "text_completion", choices)


@dataclass(frozen=True)
class ChatChunks:
    formatter: Formatter
    request_id: str
    created: int
    logprobs: bool

    def opening(self, index: int) -> dict[str, Any] | None:
        delta = {"role": "assistant", "content": ""}
        return self.formatter.chat_chunk(self.request_id, self.created, index, delta, None, None)

    def chunk(
        self, choice: ChoiceState, text: str, entries: list[LogprobEntry], offset: int
    ) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        logprobs = self.formatter.chat_logprobs(entries) if self.logprobs else None
        return self.formatter.chat_chunk(
            self.request_id, self.created, choice.index, delta, logprobs, choice.finish_reason
        )

    def usage(self, choices: list[ChoiceState]) -> dict[str, Any]:
        kind = "chat.completion.chunk"
        return self.formatter.usage_chunk(self.request_id, self.created, kind, choices)


def now() -> int:
    return int(time.time())
