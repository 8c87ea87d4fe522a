"""The request bodies of the OpenAI-compatible endpoints, and their translation to
`SamplingParams`. Unknown fields are ignored, as OpenAI's own server does; values that specserve
cannot honour are refused with the parameter named."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.shared.protocol import SamplingParams

MAX_N = 16


class ParameterError(ValueError):
    """A request parameter that cannot be served; `param` names it for the error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 or 0: off
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    best_of: int | None = None
    user: str | None = None

    def sampling(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The request's `SamplingParams`; `ParameterError` for what cannot be served."""
        if not 1 <= self.n <= MAX_N:
            raise ParameterError(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if self.best_of is not None and self.best_of != self.n:
            raise ParameterError("best_of other than n is not supported", "best_of")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        top_k = self.top_k if self.top_k is not None else 0
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if top_k == -1 else top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            stop=stop,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
        )
        try:
            params.validate()
        except ValueError as exc:
            raise ParameterError(str(exc), _named_param(str(exc))) from None
        return params

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ParameterError("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ChatContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def chat_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ParameterError("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def _named_param(message: str) -> str | None:
    """The parameter a `SamplingParams.validate` message names: its first word."""
    first = message.split(" ", 1)[0]
    return first if first.isidentifier() else None


def error_body(message: str, kind: str, param: str | None, code: int) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
