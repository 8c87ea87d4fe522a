"""The OpenAI-compatible HTTP API, driven with the real `openai` package and raw HTTP against
`specserve up` serving the bundled SmolLM2-135M-Instruct, compared with the project's own SDK."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import msgspec
import openai
import pytest

from specserve.api.choices import plan_choices, run_choices
from specserve.api.run import GRACEFUL_SHUTDOWN_S
from specserve.client import AsyncClient, Client, SamplingParams, get_status
from specserve.launch.local_redis import free_port
from specserve.shared.tokenizer import load_tokenizer
from tests.service.service_harness import drop_model_keys, start_up, stop_up, up_ports, wait_healthy

MODEL = "smollm2-135m"
BLOCK = 16  # the worker's default block size


@dataclass
class Running:
    url: str  # the control plane (ZeroMQ)
    api: str  # http://host:port
    metrics: str  # the control plane's Prometheus endpoint
    keys: str


@pytest.fixture(scope="module")
def served(redis_url: str) -> Iterator[Running]:
    drop_model_keys(redis_url, MODEL)
    (port, api_port), metrics_port = up_ports(), free_port()
    argv = [
        "up", "--workers", "1", "--port", str(port), "--api-port", str(api_port),
        "--metrics-port", str(metrics_port), "--redis-url", redis_url, "--num-blocks", "512",
        "--max-model-len", "4096",
    ]  # fmt: skip
    up, _ = start_up(argv)
    try:
        api = f"http://127.0.0.1:{api_port}"
        wait_healthy(api)
        yield Running(
            f"tcp://127.0.0.1:{port}", api, f"http://127.0.0.1:{metrics_port}/metrics",
            os.environ["SPECSERVE_KEYS"],
        )  # fmt: skip
    finally:
        stop_up(up, redis_url, MODEL, timeout_s=30)


@pytest.fixture(scope="module")
def oai(served: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.api}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def sdk(served: Running) -> Iterator[Client]:
    with Client(served.url, keys=served.keys) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


GREEDY = SamplingParams(max_tokens=24, temperature=0)


def test_models_and_health(served: Running, oai: openai.OpenAI) -> None:
    assert [m.id for m in oai.models.list().data] == [MODEL]
    health = httpx.get(f"{served.api}/health").json()
    assert health == {"status": "ok", "live_workers": 1, "model": MODEL}
    metrics = httpx.get(f"{served.api}/metrics").text
    assert 'specserve_api_requests_total{endpoint="/health",status="200"}' in metrics


def test_greedy_completion_is_the_sdk_text(oai: openai.OpenAI, sdk: Client) -> None:
    prompt = "The three primary colors are"
    want = sdk.generate(prompt, GREEDY)
    got = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    # lists of prompts, as texts or as token ids: a choice each, in order
    for prompts in ([prompt, "Red, green and"], [want.prompt_token_ids, [1, 2, 3]]):
        both = oai.completions.create(model=MODEL, prompt=prompts, max_tokens=24, temperature=0)
        assert both.choices[0].text == want.text and both.choices[1].text != want.text
        assert [c.index for c in both.choices] == [0, 1]
    tokens = oai.completions.create(
        model=MODEL, prompt=want.prompt_token_ids, max_tokens=24, temperature=0, echo=True
    )
    assert tokens.choices[0].text == prompt + want.text


def test_penalties_are_the_sdks(oai: openai.OpenAI, sdk: Client) -> None:
    """presence/frequency (OpenAI's fields) and repetition_penalty (vLLM's extra field) give
    the SDK's text for the same parameters, and change greedy text."""
    prompt = "List the days of the week:"
    plain = sdk.generate(prompt, GREEDY)
    for fields in (
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.2},
        {"extra_body": {"repetition_penalty": 1.5}},
    ):
        extra = fields.pop("extra_body", {})
        params = msgspec.structs.replace(GREEDY, **fields, **extra)
        want = sdk.generate(prompt, params)
        got = oai.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body=extra, **fields
        )
        assert got.choices[0].text == want.text and want.text != plain.text, fields


def test_chat_second_turn_hits_the_cache_for_the_whole_first_turn(
    oai: openai.OpenAI, sdk: Client, tokenizer
) -> None:
    first = [
        {"role": "system", "content": "You are a concise assistant for a hardware store."},
        {"role": "user", "content": "Which screws should I use for a pine bookshelf?"},
    ]
    want = sdk.generate(first, GREEDY)
    turn1 = oai.chat.completions.create(model=MODEL, messages=first, max_tokens=24, temperature=0)
    answer = turn1.choices[0].message.content
    assert answer == want.text
    assert turn1.usage.prompt_tokens == len(want.prompt_token_ids)

    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    turn2 = oai.chat.completions.create(model=MODEL, messages=second, max_tokens=8, temperature=0)
    prompt2 = tokenizer.encode(
        tokenizer.apply_chat_template(second, add_generation_prompt=True), add_special_tokens=False
    )
    assert turn2.usage.prompt_tokens == len(prompt2)
    seen = want.prompt_token_ids + want.token_ids  # what turn 1 computed and cached
    common = next(
        (i for i, (a, b) in enumerate(zip(seen, prompt2, strict=False)) if a != b),
        min(len(seen), len(prompt2)),
    )
    cached = turn2.usage.prompt_tokens_details.cached_tokens
    assert cached == min(common, len(prompt2) - 1) // BLOCK * BLOCK
    assert cached >= len(want.prompt_token_ids) // BLOCK * BLOCK  # the whole first prompt


def test_async_streams_equal_whole_responses(oai: openai.OpenAI, served: Running) -> None:
    prompts = ["Write a haiku about rain.", "List three fruits.", "What is 7 times 6?"]

    async def run() -> list[tuple[str, str, object]]:
        aoai = openai.AsyncOpenAI(base_url=f"{served.api}/v1", api_key="none", max_retries=0)

        async def one(text: str) -> tuple[str, str, object]:
            messages = [{"role": "user", "content": text}]
            whole = await aoai.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=20, temperature=0
            )
            stream = await aoai.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            pieces, usage, reasons = [], None, []
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    pieces.append(choice.delta.content or "")
                    if choice.finish_reason:
                        reasons.append(choice.finish_reason)
            assert reasons == [whole.choices[0].finish_reason]
            assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
            return whole.choices[0].message.content, "".join(pieces), usage

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aoai.close()

    for whole, streamed, _ in asyncio.run(run()):
        assert streamed == whole and whole


def test_stop_strings_end_the_text_and_never_leak_into_a_stream(oai: openai.OpenAI) -> None:
    prompt = "Count from one to twenty in words: one, two, three,"
    full = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    text = full.choices[0].text
    stop = text[12:17]
    assert len(stop) == 5 and text.find(stop) >= 0
    want = text[: text.find(stop)]
    got = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "zzzz"]
    )
    assert got.choices[0].text == want
    assert got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens < full.usage.completion_tokens
    chunks = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True
    )
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == want
    assert not any(stop in "".join(pieces[: i + 1])[len(want) :] for i in range(len(pieces)))


def test_n_choices_are_the_single_requests_with_successive_seeds(oai: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.9)
    both = oai.completions.create(**kw, n=2, seed=7)
    singles = [oai.completions.create(**kw, seed=s).choices[0].text for s in (7, 8)]
    assert [c.text for c in both.choices] == singles
    assert both.usage.prompt_tokens == oai.completions.create(**kw, seed=7).usage.prompt_tokens
    greedy = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, n=3)
    assert len({c.text for c in greedy.choices}) == 1


def test_n_choices_share_the_prompts_kv_blocks(served: Running) -> None:
    """The second choice starts after the first has computed the prompt: its full blocks are a
    prefix-cache hit instead of a second prefill."""
    prompt = "Explain, in one paragraph, how a refrigerator moves heat out of its box. " * 3

    async def run() -> dict[int, int | None]:
        cached: dict[int, int | None] = {}
        async with AsyncClient(served.url, keys=served.keys) as client:
            groups = plan_choices("share", [prompt], 2, SamplingParams(max_tokens=4, seed=1))
            async for index, output in run_choices(client, groups, 60):
                if output.num_cached_tokens is not None:
                    cached[index] = output.num_cached_tokens
        return cached

    n_prompt = len(load_tokenizer(MODEL).encode(prompt))
    cached = asyncio.run(run())
    assert cached[1] == (n_prompt - 1) // BLOCK * BLOCK > 0
    assert cached[0] < cached[1]


def test_logprobs_follow_the_tokens(oai: openai.OpenAI) -> None:
    got = oai.completions.create(
        model=MODEL, prompt="Water boils at", max_tokens=10, temperature=0, logprobs=3
    )
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == got.usage.completion_tokens
    assert "".join(lp.tokens) == got.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and chosen <= 0
        assert max(top.values()) == pytest.approx(chosen) and top[token] == pytest.approx(chosen)
    chat = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert bytes(entry.bytes) == entry.token.encode()


def test_echo_with_logprobs_gives_the_prompts_logprobs(oai: openai.OpenAI, sdk: Client) -> None:
    """echo + logprobs: the prompt's tokens lead the logprobs (the first without one), with the
    values the SDK gets from `prompt_logprobs`; streamed, the echo and the prompt's logprobs come
    with the first chunk, and the stream adds up to the whole response."""
    prompt = "Water boils at"
    params = msgspec.structs.replace(GREEDY, max_tokens=6, logprobs=2, prompt_logprobs=2)
    want = sdk.generate(prompt, params)
    n_prompt = len(want.prompt_token_ids)
    assert want.prompt_logprobs is not None and len(want.prompt_logprobs.chosen) == n_prompt - 1
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2, echo=True)
    got = oai.completions.create(**kwargs)
    choice = got.choices[0]
    lp = choice.logprobs
    assert choice.text == prompt + want.text
    assert len(lp.tokens) == n_prompt + len(want.token_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n_prompt] == pytest.approx(want.prompt_logprobs.chosen)
    for top, ids in zip(lp.top_logprobs[1:n_prompt], want.prompt_logprobs.top_ids, strict=True):
        assert len(top) == len(ids) == 2
    generated = [c for step in want.logprobs for c in step.chosen]
    assert lp.token_logprobs[n_prompt:] == pytest.approx(generated)
    assert "".join(lp.tokens[n_prompt:]) == want.text
    assert lp.text_offset[n_prompt] == len(prompt)
    chunks = list(oai.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [t for s in streamed for t in s.token_logprobs] == lp.token_logprobs
    assert [t for s in streamed for t in s.text_offset] == lp.text_offset


# --- errors, over raw HTTP ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens"),  # beyond the context
        ({"prompt": "hi", "n": 1000}, 400, "n"),
        ({"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"prompt": "hi", "stop": ["x"] * 100}, 400, "stop"),
        ({"prompt": "hi", "stop": [""]}, 400, "stop"),
        ({"prompt": []}, 400, "prompt"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": [10**9]}, 400, None),  # outside the vocabulary: refused by the service
        ({"prompt": "hi", "model": "gpt-17"}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors(served: Running, body, status, param) -> None:
    response = httpx.post(f"{served.api}/v1/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"]


def test_bad_chat_and_malformed_json(served: Running) -> None:
    bad_role = {"messages": [{"role": "wizard", "content": "hi"}]}
    response = httpx.post(f"{served.api}/v1/chat/completions", json=bad_role, timeout=30)
    assert response.status_code == 400 and "wizard" in response.json()["error"]["message"]
    response = httpx.post(
        f"{served.api}/v1/chat/completions", content=b"{not json", timeout=30,
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] is None
    assert error["message"].startswith("the request body is not valid JSON (")
    assert error["message"].endswith(" at character 1)")
    nested = b'{"prompt": ' + b"[" * 20000  # neither JSON nor a stack overflow
    response = httpx.post(
        f"{served.api}/v1/completions", content=nested, timeout=30,
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert response.status_code == 400 and response.json()["error"]["code"] == 400
    unknown = httpx.get(f"{served.api}/v1/engines", timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    huge = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**12}
    response = httpx.post(f"{served.api}/v1/chat/completions", json=huge, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_completion_tokens"
    assert "maximum context length" in response.json()["error"]["message"]
    empty = httpx.post(f"{served.api}/v1/chat/completions", json={"messages": []}, timeout=30)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"


def _metric(served: Running, name: str) -> float:
    for line in httpx.get(served.metrics, timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in the control plane's metrics")


def test_a_dropped_stream_aborts_its_request_and_frees_its_blocks(served: Running) -> None:
    body = {
        "prompt": "Tell me everything about the history of bridges.", "max_tokens": 3000,
        "ignore_eos": True, "temperature": 0, "stream": True,
    }  # fmt: skip
    with httpx.stream("POST", f"{served.api}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(8):
            next(lines)
        assert get_status(served.url, keys=served.keys).requests_in_flight == 1
    # closed after a few tokens: the request must be gone in well under its 3000 tokens' time
    deadline = time.monotonic() + 15
    while get_status(served.url, keys=served.keys).requests_in_flight:
        assert time.monotonic() < deadline, "the dropped stream's request is still running"
        time.sleep(0.1)
    while _metric(served, "specserve_running_requests") or _metric(served, "specserve_kv_usage"):
        assert time.monotonic() < deadline, "the dropped stream's blocks were not freed"
        time.sleep(0.2)
    # and the API no longer counts it against --max-concurrent-requests
    api_metrics = httpx.get(f"{served.api}/metrics", timeout=5).text
    assert "specserve_api_requests_in_flight 0.0" in api_metrics


@contextlib.contextmanager
def api_process(control: str, *extra: str) -> Iterator[str]:
    port = free_port()
    argv = ["api", "--control", control, "--port", str(port), *extra]
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", *argv])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_body_over_the_limit_gets_413_before_it_is_read_whole(served: Running) -> None:
    with api_process(served.url, "--keys", served.keys, "--max-body-bytes", "4096") as api:
        wait_healthy(api)
        big = {"prompt": "x" * 8192}
        declared = httpx.post(f"{api}/v1/completions", json=big, timeout=30)
        assert declared.status_code == 413, declared.text
        assert "--max-body-bytes" in declared.json()["error"]["message"]

        def chunked():  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(64):
                yield b"y" * 1024
            yield b'"}'

        streamed = httpx.post(
            f"{api}/v1/completions", content=chunked(), timeout=30,
            headers={"content-type": "application/json"},
        )  # fmt: skip
        assert streamed.status_code == 413, streamed.text
        small = httpx.post(f"{api}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert small.status_code == 200, small.text


def test_overload_gets_429_and_no_service_gets_503(served: Running) -> None:
    keys = ["--keys", served.keys]
    with api_process(served.url, *keys, "--max-concurrent-requests", "1") as api:
        wait_healthy(api)
        long = {"prompt": "Go on:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{api}/v1/completions", json=long, timeout=30) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept: a dropped iterator closes the connection
            opening = next(lines)
            assert '"finish_reason":null' in opening, opening
            second = httpx.post(f"{api}/v1/completions", json={"prompt": "hi"}, timeout=30)
            assert second.status_code == 429, second.text
            assert second.json()["error"]["type"] == "rate_limit_error"
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    with api_process(nowhere, *keys) as api:
        health = wait_healthy(api, want=503)
        assert health.json()["status"] == "unavailable"
        response = httpx.post(f"{api}/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert response.status_code == 503, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_control_plane_without_workers_gets_503(served: Running) -> None:
    port = free_port()
    control = subprocess.Popen(
        [sys.executable, "-m", "specserve.cli", "control", "--bind", f"tcp://127.0.0.1:{port}",
         "--model", MODEL],
    )  # fmt: skip
    try:
        with api_process(f"tcp://127.0.0.1:{port}") as api:
            deadline = time.monotonic() + 60
            while (health := wait_healthy(api, want=503).json())["status"] != "no live worker":
                assert time.monotonic() < deadline, health  # until the first status arrived
                time.sleep(0.2)
            assert health["live_workers"] == 0
            response = httpx.post(f"{api}/v1/completions", json={"prompt": "hi"}, timeout=30)
            assert response.status_code == 503, response.text
            assert "no worker is live" in response.json()["error"]["message"]
    finally:
        control.terminate()
        control.wait(30)


def test_api_keys_guard_v1_and_leave_probes_open(served: Running, tmp_path) -> None:
    """--api-key-file: the openai client with a listed key is served; a missing or wrong key
    gets 401 in OpenAI's shape before its body is read; /health and /metrics stay open."""
    key_file = tmp_path / "api-keys"
    key_file.write_text("# keys of the HTTP API\nsk-first\n\nsk-second\n")
    with api_process(served.url, "--keys", served.keys, "--api-key-file", str(key_file)) as api:
        wait_healthy(api)  # /health needs no key
        assert httpx.get(f"{api}/metrics", timeout=5).status_code == 200
        for key in ("sk-first", "sk-second"):
            client = openai.OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0)
            out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert out.usage.completion_tokens == 2
        for key in ("sk-third", "sk-firs", "sk-first2"):
            client = openai.OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        for headers in ({}, {"authorization": "Basic sk-first"}, {"authorization": "sk-first"}):
            reply = httpx.post(
                f"{api}/v1/completions", json={"prompt": "x" * (1 << 20)}, headers=headers
            )
            assert reply.status_code == 401, reply.text
            assert reply.headers["www-authenticate"] == "Bearer"
            assert reply.json()["error"]["type"] == "authentication_error"
        client = openai.OpenAI(base_url=f"{api}/v1", api_key="sk-first", max_retries=0)
        streamed = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices)
        # every response is counted by path and status, refusals and streams included
        metrics = httpx.get(f"{api}/metrics", timeout=5).text
        for endpoint, status, count in [
            ("/v1/completions", 200, 3), ("/v1/completions", 401, 3), ("/v1/models", 401, 3)
        ]:  # fmt: skip
            line = f'specserve_api_requests_total{{endpoint="{endpoint}",status="{status}"}}'
            assert f"{line} {count}.0" in metrics, metrics
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    failed = subprocess.run(
        [sys.executable, "-m", "specserve.cli", "api", "--api-key-file", str(empty)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert failed.returncode != 0 and "holds no key" in failed.stderr


def test_stopping_the_api_ends_its_generations_at_once_and_aborts_their_requests(
    served: Running,
) -> None:
    port = free_port()
    argv = ["api", "--control", served.url, "--port", str(port), "--keys", served.keys]
    proc = subprocess.Popen(
        [sys.executable, "-m", "specserve.cli", *argv], stderr=subprocess.PIPE, text=True
    )
    try:
        api = f"http://127.0.0.1:{port}"
        wait_healthy(api)
        body = {"prompt": "Go on:", "max_tokens": 3000, "ignore_eos": True}
        with (
            concurrent.futures.ThreadPoolExecutor(1) as pool,
            httpx.stream(
                "POST", f"{api}/v1/completions", json={**body, "stream": True}, timeout=30
            ) as response,
        ):
            whole = pool.submit(httpx.post, f"{api}/v1/completions", json=body, timeout=30)
            lines = (line for line in response.iter_lines() if line)
            for _ in range(4):
                assert '"finish_reason":null' in next(lines)
            while get_status(served.url, keys=served.keys).requests_in_flight < 2:
                assert not whole.done(), whole.result().text
                time.sleep(0.05)
            stopped_at = time.monotonic()
            proc.terminate()
            rest = list(lines)
            refused = whole.result()
        # the stream ends with the reason and its end marker, not cut mid-token
        error = msgspec.json.decode(rest[-2].removeprefix("data: "))["error"]
        assert (error["code"], error["type"]) == (503, "service_unavailable"), rest[-2]
        assert rest[-1] == "data: [DONE]"
        # a whole (non-streamed) completion in flight gets the same answer as its status
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
        # well before uvicorn's graceful timeout would have cut the stream
        assert time.monotonic() - stopped_at < GRACEFUL_SHUTDOWN_S
        assert "Traceback" not in proc.stderr.read()
        deadline = time.monotonic() + 15  # and its request was aborted on the control plane
        while get_status(served.url, keys=served.keys).requests_in_flight:
            assert time.monotonic() < deadline, "the stopped API's request is still running"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait(30)
