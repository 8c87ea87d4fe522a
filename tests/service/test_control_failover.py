"""Streams that outlive their control plane: kill -9 of a control plane process while 64 streams
run, then a restarted plane on the same port, or a second live plane the client was given. Every
stream must complete exactly as an uninterrupted run would (half greedy, half seeded sampling),
with no token lost or repeated. Real processes, sockets and Redis throughout.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Callable

import pytest
from service_harness import WORKER_ENGINE

from specserve.cache_index import Namespace, connect, list_workers
from specserve.cache_index.schema import key_model_name
from specserve.client import AsyncClient, Client, RequestFailed
from specserve.llm import LLM
from specserve.shared.protocol import SamplingParams

NUM_STREAMS = 64
MAX_TOKENS = 40


def prompts_and_params() -> tuple[list[list[int]], list[SamplingParams]]:
    """Distinct prompts; even requests greedy, odd ones seeded sampling."""
    prompts = [[(37 * i + 11 * j) % 250 + 1 for j in range(6 + i % 7)] for i in range(NUM_STREAMS)]
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(max_tokens=MAX_TOKENS, seed=1000 + i, ignore_eos=True)
        for i in range(NUM_STREAMS)
    ]
    return prompts, params


async def stream_all(
    urls: list[str], prompts: list[list[int]], params: list[SamplingParams], on_tokens
) -> dict[int, list[int]]:
    """Every prompt streamed on one client; `on_tokens(total)` after each output."""
    streamed: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    total = [0]

    async def consume(client: AsyncClient, i: int) -> None:
        async for out in client.stream(prompts[i], params[i]):
            streamed[i].extend(out.token_ids)
            total[0] += len(out.token_ids)
            on_tokens(total[0])

    async with AsyncClient(urls, timeout=120) as client:
        await asyncio.gather(*(consume(client, i) for i in range(len(prompts))))
    return streamed


def uninterrupted(llama_ckpt, prompts, params) -> list[list[int]]:
    outs = LLM(str(llama_ckpt.path), **WORKER_ENGINE).generate(prompts, params)
    return [out.token_ids for out in outs]


def streams_survive(llama_ckpt, urls: list[str], fail: Callable[[], None]) -> float:
    """The 64 streams of `prompts_and_params` on one client given `urls`, with `fail()` run once
    300 tokens have arrived. Every stream must equal an uninterrupted run; returns the seconds
    from the failure to the last stream's end."""
    prompts, params = prompts_and_params()
    failed_at: list[float] = []

    def on_tokens(total: int) -> None:
        if not failed_at and total >= 300:
            fail()
            failed_at.append(time.monotonic())

    streamed = asyncio.run(stream_all(urls, prompts, params, on_tokens))
    assert failed_at, "the streams ended before the failure"
    took = time.monotonic() - failed_at[0]
    expected = uninterrupted(llama_ckpt, prompts, params)
    for i in range(NUM_STREAMS):
        assert streamed[i] == expected[i], i
    return took


def test_kill_9_of_the_control_plane_resumes_every_stream_on_its_restart(planes, llama_ckpt):
    plane = planes("control", "w0", "w1")

    def kill_and_restart() -> None:
        plane.kill()
        plane.start()  # same ports: the workers and the client reconnect to it

    streams_survive(llama_ckpt, [plane.url], kill_and_restart)
    plane.wait_workers(2)  # both workers came back to the restarted plane


def test_kill_9_of_the_control_plane_resumes_on_the_next_one_given(planes, llama_ckpt):
    first = planes("first", "a0")
    second = planes("second", "b0")
    streams_survive(llama_ckpt, [first.url, second.url], first.kill)


def test_a_stopping_control_plane_hands_its_streams_over_or_fails_them(planes, llama_ckpt):
    """SIGTERM: the plane tells its clients it is stopping. A resuming client (the default)
    goes on with the plane that replaces it; one that does not resume fails at once."""
    plane = planes("control", "w0")
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    with Client(plane.url, timeout=60) as client:
        stream = client.stream(prompt, params)
        tokens = list(next(stream).token_ids)
        assert plane.proc is not None
        plane.proc.send_signal(signal.SIGTERM)
        assert plane.proc.wait(timeout=15) == 0
        plane.start()
        for out in stream:
            tokens.extend(out.token_ids)
    assert tokens == uninterrupted(llama_ckpt, [prompt], [params])[0]

    plane.wait_workers(1)
    with Client(plane.url, timeout=60, resume=False) as client:
        stream = client.stream(prompt, params)
        next(stream)
        started = time.monotonic()
        plane.proc.send_signal(signal.SIGTERM)
        with pytest.raises(RequestFailed, match="the control plane is shutting down"):
            list(stream)
        assert time.monotonic() - started < 15


def test_a_control_plane_that_stops_answering_is_left_within_seconds(planes, llama_ckpt):
    """SIGSTOP: the connection stays open but nothing answers; missed heartbeats drop it after
    3 s, and the client resumes on the next plane long before its 120 s request timeout."""
    first = planes("first", "a0")
    second = planes("second", "b0")
    assert first.proc is not None
    try:
        took = streams_survive(
            llama_ckpt, [first.url, second.url], lambda: first.proc.send_signal(signal.SIGSTOP)
        )
        assert took < 30
    finally:
        first.proc.send_signal(signal.SIGCONT)


def test_a_live_plane_adopts_the_workers_of_a_dead_one(planes, llama_ckpt, redis_url):
    """Active-active: two planes on one Redis index, the first plane's workers told of both.
    kill -9 of the first during 64 streams: its workers move to the second, which serves the
    resumed streams with all three workers, each stream exactly as uninterrupted; in the index
    every live worker is owned by the second plane."""
    first = planes("first")
    second = planes("second", "y0")
    planes.workers([first, second], "x0", "x1")
    first.wait_workers(2)
    streams_survive(llama_ckpt, [first.url, second.url], first.kill)
    second.wait_workers(3)
    client = connect(redis_url)
    ns = Namespace(key_model_name(str(llama_ckpt.path)), WORKER_ENGINE["block_size"])
    owners = {r.worker_id: r.info.get("session") for r in list_workers(client, ns) if r.live}
    mine = {w: owners.get(w) for w in ("x0", "x1", "y0")}
    assert None not in mine.values() and len(set(mine.values())) == 1, owners


def test_a_moving_worker_keeps_its_kv_and_resumed_streams_wait_for_it(planes, llama_ckpt):
    """kill -9 of a plane whose worker moves to a live plane that has a worker of its own. The
    moving worker offers the KV it holds in its Register, the live plane adopts it as cached
    prefixes, and every resumed stream waits for that worker (the index says it holds the
    stream's tokens) instead of starting over on the idle one: it resumes there with its prompt
    and delivered output cached, exactly as an uninterrupted run."""
    first = planes("first")
    # A long hold: a loaded machine must not make the moving worker arrive after it.
    second = planes("second", "y0", extra=("--resume-hold", "20"))
    planes.workers([first, second], "x0")
    first.wait_workers(1)
    prompts = [[(13 * i + 7 * j) % 250 + 1 for j in range(40)] for i in range(4)]
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)] * 4
    killed = []

    def on_tokens(total: int) -> None:
        if not killed and total >= 40:
            first.kill()
            killed.append(total)

    streamed = asyncio.run(stream_all([first.url, second.url], prompts, params, on_tokens))
    assert killed
    expected = uninterrupted(llama_ckpt, prompts, params)
    assert [streamed[i] for i in range(4)] == expected
    log = second.log.read_text()
    adopted = re.findall(r"worker.registered\s+adopted_blocks=(\d+) .*worker=x0", log)
    assert adopted and int(adopted[0]) >= 4 * 10, log[-3000:]  # 40-token prompts: 10 blocks
    routed = re.findall(r"request.routed\s+cached_tokens=(\d+) \S+ \S+ worker=(\S+)", log)
    assert len(routed) == 4, log[-3000:]
    assert all(worker == "x0" and int(cached) >= 40 for cached, worker in routed), routed
