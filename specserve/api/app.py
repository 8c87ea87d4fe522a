"""The OpenAI-compatible HTTP front end: a stateless FastAPI app over the asyncio client SDK.

Any number of these can run beside one control plane. Each keeps one `AsyncClient` (one DEALER
socket, every request multiplexed on it) and polls the control plane's `ServiceStatus` for
`/health` and for refusing work fast (503) while no worker is live (its own or, through
forwarding, another control plane's).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.api.choices import plan_choices, run_choices
from specserve.api.responses import (
    ChatChunks,
    ChoiceState,
    Chunks,
    CompletionChunks,
    Formatter,
    now,
)
from specserve.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ParameterError,
    error_body,
)
from specserve.client import AsyncClient, RequestFailed, RequestTimeout, ServiceUnreachable
from specserve.client.core import DEFAULT_URL
from specserve.client.status import fetch_status
from specserve.shared.curve import DEFAULT_CLIENT_KEY
from specserve.shared.protocol import ChatMessage, RequestOutput, ServiceStatus
from specserve.shared.tokenizer import Tokenizer, load_tokenizer

log = structlog.get_logger(__name__)

DEFAULT_MAX_TOKENS = 4096  # when neither the request nor a live worker bounds it


@dataclass(frozen=True)
class ApiSettings:
    control: tuple[str, ...] = (DEFAULT_URL,)  # the client moves on to the next when one goes
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the control plane's model
    tokenizer: str | None = None  # a bundled model or checkpoint dir; default: the served model
    max_concurrent_requests: int = 256
    max_body_bytes: int = 32 << 20  # a larger request body is refused (413) while it arrives
    request_timeout_s: float = 600.0
    keys: str | os.PathLike | None = None
    key_name: str = DEFAULT_CLIENT_KEY
    status_interval_s: float = 1.0
    # Bearer keys that /v1/... requests must present (none: no HTTP authentication).
    api_keys: tuple[str, ...] = ()


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), self.kind, self.param, self.status), self.status)


def from_service_error(exc: Exception) -> ApiError:
    """What a failure of the SDK call means to an HTTP client."""
    if isinstance(exc, RequestFailed):
        if exc.code == "invalid":
            return ApiError(400, str(exc))
        if exc.code == "overloaded":
            return ApiError(429, str(exc), "rate_limit_error")
        return ApiError(500, str(exc), "internal_error")
    if isinstance(exc, ServiceUnreachable):
        return ApiError(503, str(exc), "service_unavailable")
    if isinstance(exc, RequestTimeout):
        return ApiError(504, str(exc), "timeout")
    if isinstance(exc, ParameterError):
        return ApiError(400, str(exc), param=exc.param)
    return ApiError(500, f"internal error ({type(exc).__name__}): {exc}", "internal_error")


class BodyLimit:
    """ASGI middleware: refuse (413) a request body over `max_bytes`, by its Content-Length or,
    for a chunked body, as soon as it grows past it, so no body is ever held whole beyond it."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def bounded() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, bounded, send)
        except _TooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Any, receive: Any, send: Any) -> None:
        message = f"the request body is over {self.max_bytes} bytes (--max-body-bytes)"
        await ApiError(413, message).response()(scope, receive, send)


class ApiKeyAuth:
    """ASGI middleware: every /v1/... request must carry `Authorization: Bearer <key>` with one
    of `keys` (compared in constant time), else 401 before its body is read. /health and
    /metrics stay open, for probes and scrapers."""

    def __init__(self, app: Any, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = [key.encode() for key in keys]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._ok(scope):
            error = ApiError(401, "a valid API key is required: Authorization: Bearer <key>",
                             "authentication_error")  # fmt: skip
            response = error.response()
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _ok(self, scope: Any) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        # every key compared, so the time taken does not tell which (or whether one) matched
        return sum(secrets.compare_digest(given.strip(), key) for key in self.keys) > 0


# Where `RequestCounter` (the outermost middleware) leaves the server's own `send` for an event
# stream's chunks (see `_ClosingStream.stream_response`).
SERVER_SEND = "specserve.server_send"


class RequestCounter:
    """ASGI middleware: counts each response by path and status
    (`specserve_api_requests_total`). Starlette's `@app.middleware("http")` would pass every
    chunk of a stream through a task and a memory stream of its own; this only notes the status
    as it goes by."""

    def __init__(self, app: Any, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client gets if the app fails before answering

        async def noting_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        scope[SERVER_SEND] = send
        try:
            await self.app(scope, receive, noting_status)
        finally:
            self.metrics.requests.labels(scope["path"], str(status)).inc()


class _TooLarge(BaseException):
    """Not an Exception: FastAPI turns any Exception raised while it reads a body into its
    own 400, and this one must reach `BodyLimit`."""


class ApiMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "specserve_api_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.in_flight = Gauge(
            "specserve_api_requests_in_flight", "Generation requests being served", registry=r
        )
        self.ttft = Histogram(
            "specserve_api_time_to_first_token_seconds",
            "From the HTTP request to its first generated text",
            registry=r,
        )
        self.duration = Histogram(
            "specserve_api_request_seconds", "From the HTTP request to its last byte", registry=r
        )


class ApiState:
    """What one API process holds: its client, the last status and its formatter."""

    def __init__(self, settings: ApiSettings) -> None:
        self.settings = settings
        self.client: AsyncClient | None = None
        self.status: ServiceStatus | None = None
        self.status_error: str | None = "no status from the control plane yet"
        self.formatter: Formatter | None = None
        self.active = 0
        self.metrics = ApiMetrics()
        self.stopping = False

    async def stop_generations(self) -> None:
        """The server is stopping: refuse new work and end every generation in flight (their
        requests aborted on the control plane, each stream closed with an error event), so that
        their connections close at once rather than when the shutdown timeout cuts them."""
        self.stopping = True
        if self.client is not None:
            await self.client.close()

    def error(self, exc: Exception) -> ApiError:
        """What a failure means to an HTTP client; while stopping, that the server stops."""
        return _shutting_down() if self.stopping else from_service_error(exc)

    async def refresh_status(self) -> None:
        s = self.settings
        url = s.control[0] if self.client is None else self.client.url  # the one in use
        try:
            self.status = await fetch_status(
                url, timeout=max(s.status_interval_s, 1.0), keys=s.keys, key_name=s.key_name
            )
            self.status_error = None
        except Exception as exc:  # unreachable, refused: /health says so
            self.status, self.status_error = None, str(exc)
            return
        if self.formatter is None:
            name = s.served_model_name or self.status.model
            self.formatter = Formatter(name, _tokenizer(s.tokenizer or self.status.model))

    async def poll_status(self) -> None:
        while True:
            await self.refresh_status()
            await asyncio.sleep(self.settings.status_interval_s)

    def model_names(self) -> set[str]:
        names = set()
        if self.formatter is not None:
            names.add(self.formatter.model)
        if self.status is not None:
            names.add(self.status.model)
        return names


def _tokenizer(model: str) -> Tokenizer | None:
    try:
        return load_tokenizer(model)
    except ValueError as exc:  # e.g. a checkpoint path on the control plane's machine only
        log.warning("api.no_tokenizer", model=model, reason=str(exc))
        return None


def create_app(settings: ApiSettings) -> FastAPI:
    state = ApiState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.client = AsyncClient(
            settings.control, timeout=settings.request_timeout_s,
            keys=settings.keys, key_name=settings.key_name,
        )  # fmt: skip
        poller = asyncio.ensure_future(state.poll_status())
        try:
            yield
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            await state.client.close()

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.api_keys:  # outside everything but the counter, which reads nothing
        app.add_middleware(ApiKeyAuth, keys=settings.api_keys)
    app.add_middleware(RequestCounter, metrics=state.metrics)  # counts 401s and 413s too
    app.state.api = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """FastAPI's own refusals (a body that is not JSON, an unknown path, a wrong method),
        in OpenAI's shape too."""
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":  # its loc is the offset the parser stopped at
            reason = first.get("ctx", {}).get("error", first.get("msg"))
            message = (
                f"the request body is not valid JSON ({reason} at character {first['loc'][-1]})"
            )
            return ApiError(400, message).response()
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else str(exc)
        return ApiError(400, message, param=param).response()

    @app.get("/health")
    async def health() -> JSONResponse:
        status = state.status
        if status is None:
            return JSONResponse({"status": "unavailable", "reason": state.status_error}, 503)
        body = {"status": "ok", "live_workers": status.live_workers, "model": status.model}
        if status.peer_workers:
            body["peer_workers"] = status.peer_workers
        if not _can_serve(status):
            return JSONResponse({**body, "status": "no live worker"}, 503)
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type="text/plain")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        formatter = _ready(state)
        status = state.status
        return {
            "object": "list",
            "data": [
                {
                    "id": formatter.model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "specserve",
                    "root": status.model if status else formatter.model,
                    "max_model_len": status.max_model_len if status else None,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        formatter = _admit(state, body.model)
        if body.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        try:
            echoed = body.logprobs if body.echo else None  # the prompt's logprobs, echoed too
            sampling = body.sampling(_max_tokens(state, body.max_tokens), body.logprobs, echoed)
            prompts = body.prompts()
        except ParameterError as exc:
            raise from_service_error(exc) from None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        groups = plan_choices(request_id, prompts, body.n, sampling)
        echo = [_prompt_text(formatter, p) for p in prompts] if body.echo else None
        stream = Generation(state, request, groups)
        if body.stream:
            chunks = CompletionChunks(
                formatter, request_id, stream.created, body.logprobs is not None, echo, body.n
            )
            return await stream.sse(chunks, body.include_usage)
        choices = await stream.collect()
        return JSONResponse(
            formatter.completion(
                request_id, stream.created, choices, echo, body.logprobs is not None, body.n
            )
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        formatter = _admit(state, body.model)
        try:
            param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            limit = body.max_completion_tokens or body.max_tokens
            sampling = body.sampling(_max_tokens(state, limit, param), body.chat_logprobs())
        except ParameterError as exc:
            raise from_service_error(exc) from None
        messages = [ChatMessage(m.role, m.text()) for m in body.messages]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        groups = plan_choices(request_id, [messages], body.n, sampling)
        stream = Generation(state, request, groups)
        if body.stream:
            chunks = ChatChunks(formatter, request_id, stream.created, body.logprobs)
            return await stream.sse(chunks, body.include_usage)
        choices = await stream.collect()
        return JSONResponse(formatter.chat(request_id, stream.created, choices, body.logprobs))

    return app


def _shutting_down() -> ApiError:
    return ApiError(503, "the API server is shutting down; retry", "service_unavailable")


def _ready(state: ApiState) -> Formatter:
    if state.formatter is None:
        raise ApiError(
            503, f"the service is not ready: {state.status_error}", "service_unavailable"
        )
    return state.formatter


def _admit(state: ApiState, model: str | None) -> Formatter:
    """The checks before any work: a known model, a live worker, room for one more request."""
    formatter = _ready(state)
    if state.stopping:
        raise _shutting_down()
    if model is not None and model not in state.model_names():
        raise ApiError(
            404, f"the model {model!r} does not exist; this server serves {formatter.model!r}",
            "not_found_error", "model",
        )  # fmt: skip
    status = state.status
    if status is None or not _can_serve(status):
        reason = state.status_error if status is None else "no worker is live"
        raise ApiError(503, f"the service cannot serve now: {reason}", "service_unavailable")
    limit = state.settings.max_concurrent_requests
    if state.active >= limit:
        raise ApiError(
            429, f"{state.active} requests are in flight, the most this server takes "
            f"(--max-concurrent-requests {limit}); retry later", "rate_limit_error",
        )  # fmt: skip
    return formatter


def _can_serve(status: ServiceStatus) -> bool:
    """A live worker of the control plane's own, or of another plane it forwards to."""
    return status.live_workers + status.peer_workers > 0


def _max_tokens(state: ApiState, requested: int | None, param: str = "max_tokens") -> int:
    """The request's output budget: as asked, refused when no prompt could leave room for it in
    the model's context (it would otherwise run until the context is full, minutes on a
    CPU), else the context when not asked."""
    status = state.status
    context = status.max_model_len if status and status.max_model_len else None
    if requested is None:
        return context or DEFAULT_MAX_TOKENS
    if context is not None and requested >= context:
        raise ApiError(
            400,
            f"{param} is too large: {requested}; this model's maximum context length is "
            f"{context} tokens, prompt included",
            param=param,
        )
    return requested


def _prompt_text(formatter: Formatter, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    if formatter.tokenizer is None:
        raise ApiError(400, "echo of token-id prompts needs a tokenizer", param="echo")
    return formatter.tokenizer.decode(prompt, skip_special_tokens=False)


class Generation:
    """The choices of one HTTP request in flight: counted against the concurrency limit,
    aborted when the HTTP client goes away, collected whole or streamed as SSE."""

    def __init__(self, state: ApiState, request: Request, groups: list) -> None:
        self.state = state
        self.request = request
        self.groups = groups
        self.created = now()
        self.started = time.monotonic()
        self.choices = {c.index: ChoiceState(c.index) for g in groups for c in g}
        self._first_seen = False
        self._finished = False

    def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        assert self.state.client is not None
        return run_choices(self.state.client, self.groups, self.state.settings.request_timeout_s)

    def _note_first(self) -> None:
        if not self._first_seen:
            self._first_seen = True
            self.state.metrics.ttft.observe(time.monotonic() - self.started)

    async def collect(self) -> list[ChoiceState]:
        """Every choice to its end; a client that disconnects meanwhile aborts them."""
        self._enter()
        try:
            work = asyncio.ensure_future(self._collect())
            gone = asyncio.ensure_future(_until_disconnected(self.request))
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work
                raise ApiError(499, "the client closed the request", "client_closed_request")
            gone.cancel()
            try:
                return work.result()
            except ApiError:
                raise
            except Exception as exc:
                raise self.state.error(exc) from None
        finally:
            self._leave()

    async def _collect(self) -> list[ChoiceState]:
        async with contextlib.aclosing(self._outputs()) as outputs:
            async for index, output in outputs:
                self._note_first()
                self.choices[index].add(output)
        return [self.choices[i] for i in sorted(self.choices)]

    async def sse(self, chunks: Chunks, include_usage: bool) -> StreamingResponse:
        """A `text/event-stream` response. The first output is awaited before answering, so a
        refused request gets its HTTP status instead of an error inside a 200 stream."""
        self._enter()
        outputs = self._outputs()
        try:
            first = await anext(outputs)
        except StopAsyncIteration:
            first = None
        except BaseException as exc:
            await self._finish(outputs)
            if isinstance(exc, ApiError | asyncio.CancelledError):
                raise
            raise self.state.error(exc) from None  # type: ignore[arg-type]

        async def events() -> AsyncIterator[bytes]:
            offsets = dict.fromkeys(self.choices, 0)
            try:
                for index in sorted(self.choices):
                    opening = chunks.opening(index)
                    if opening is not None:
                        yield _sse(opening)
                item = first
                async with contextlib.aclosing(outputs):
                    while item is not None:
                        index, output = item
                        self._note_first()
                        choice = self.choices[index]
                        text, entries = choice.add(output)
                        if text or entries or output.finished:
                            yield _sse(chunks.chunk(choice, text, entries, offsets[index]))
                            offsets[index] += len(text)
                        item = await anext(outputs, None)
                if include_usage:
                    yield _sse(chunks.usage([self.choices[i] for i in sorted(self.choices)]))
                yield b"data: [DONE]\n\n"
            except Exception as exc:  # after the 200: the error goes in the stream
                err = self.state.error(exc)
                yield _sse(error_body(str(err), err.kind, err.param, err.status))
                yield b"data: [DONE]\n\n"
            finally:
                await self._finish(outputs)

        return _ClosingStream(events(), lambda: self._finish(outputs))

    async def _finish(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> None:
        """Abort what still runs and free this request's place, once, however the response
        ended (finished, failed, or its client gone, even before it started)."""
        if self._finished:
            return
        self._finished = True
        await outputs.aclose()  # type: ignore[attr-defined]
        self._leave()
        self.state.metrics.duration.observe(time.monotonic() - self.started)

    def _enter(self) -> None:
        self.state.active += 1
        self.state.metrics.in_flight.set(self.state.active)

    def _leave(self) -> None:
        self.state.active -= 1
        self.state.metrics.in_flight.set(self.state.active)


class _ClosingStream(StreamingResponse):
    """A streaming response that always runs `on_close` when it is done with the client.

    Starlette leaves the body iterator suspended when the client goes away mid-stream (and
    never starts it when the client is gone before the first byte), so its cleanup would wait
    for garbage collection; here it runs at once: the choices are aborted and their KV freed.
    """

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self._server_send = scope.get(SERVER_SEND, send)
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._on_close()

    async def stream_response(self, send: Any) -> None:
        """Starlette's, except that the chunks go to the server's `send` itself. The ASGI
        layers in between (the error and exception middlewares' and the request counter's) act
        on the response's start only, which they see; each would add a coroutine call to
        every streamed token."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        body = self._server_send
        async for chunk in self.body_iterator:
            await body({"type": "http.response.body", "body": chunk, "more_body": True})
        await body({"type": "http.response.body", "body": b"", "more_body": False})


_json = msgspec.json.Encoder().encode  # several times json's speed; UTF-8 as is


def _sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + _json(payload) + b"\n\n"


async def _until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)
