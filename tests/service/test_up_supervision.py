"""`specserve up` keeps the service running: a worker killed with -9 under load loses no request
and is started again; so is the HTTP API."""

from __future__ import annotations

import asyncio
import os
import re
import signal

import httpx
import pytest
from service_harness import start_up, stop_up, up_ports, wait_for, wait_healthy

from specserve.client import AsyncClient, SamplingParams, get_status
from specserve.shared.cpus import SPIN_COUNT, usable_cpus

PROMPTS = [[1 + i, 7, 3 + (i * 5) % 50, 11, 2 + i % 9] for i in range(20)]
PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(llama_ckpt) -> list[list[int]]:
    from specserve.llm import LLM

    llm = LLM(str(llama_ckpt.path), num_blocks=256, block_size=4, max_model_len=256)
    return [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]


def child_pids(lines: list[str]) -> dict[str, int]:
    """The newest pid `up` reported for each child."""
    return {n: int(p) for n, p in re.findall(r"started (\S+) \(pid (\d+)\)", "".join(lines))}


def streams_with_a_kill(urls: str | list[str], keys: str, pid: int) -> list[list[int]]:
    """Every prompt streamed at once, `pid` killed with -9 once the streams are under way:
    what each stream delivered."""

    async def run() -> list[list[int]]:
        async with AsyncClient(urls, timeout=120, keys=keys) as client:
            started = asyncio.Event()
            outputs: list[list[int]] = [[] for _ in PROMPTS]

            async def one(i: int) -> None:
                async for out in client.stream(PROMPTS[i], PARAMS):
                    outputs[i].extend(out.token_ids)
                    if len(outputs[i]) >= 4:
                        started.set()

            tasks = [asyncio.ensure_future(one(i)) for i in range(len(PROMPTS))]
            await started.wait()
            os.kill(pid, signal.SIGKILL)  # mid-stream
            await asyncio.gather(*tasks)
            return outputs

    return asyncio.run(run())


def assert_the_api_serves(api_port: int, expected: list[list[int]]) -> None:
    api = f"http://127.0.0.1:{api_port}"
    wait_healthy(api, 60)
    body = {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{api}/v1/completions", json=body, timeout=60).json()
    assert reply["usage"]["completion_tokens"] == len(expected[0])


def test_a_killed_worker_loses_no_request_and_comes_back(llama_ckpt, redis_url, expected):
    port, api_port = up_ports()
    url = f"tcp://127.0.0.1:{port}"
    argv = [
        "up", "--workers", "2", "--port", str(port), "--api-port", str(api_port),
        "--model", str(llama_ckpt.path), "--redis-url", redis_url, "--num-blocks", "256",
        "--block-size", "4", "--max-model-len", "256",
    ]  # fmt: skip
    keys = os.environ["SPECSERVE_KEYS"]
    up, lines = start_up(argv)
    try:
        first = child_pids(lines)
        assert streams_with_a_kill(url, keys, first["worker-0"]) == expected
        # `up` started worker-0 again, and the control plane took it back
        wait_for(lambda: child_pids(lines)["worker-0"] != first["worker-0"], 30, "no restart")
        status = lambda: get_status(url, keys=keys)  # noqa: E731
        wait_for(lambda: status().live_workers == 2, 90, "worker-0 never came back")
        assert any("worker-0 exited with status -9; restarting it" in line for line in lines)

        # the HTTP API too
        api = f"http://127.0.0.1:{api_port}"
        wait_healthy(api, 60)
        os.kill(child_pids(lines)["api"], signal.SIGKILL)
        wait_for(lambda: child_pids(lines)["api"] != first["api"], 30, "the API was not restarted")
        assert_the_api_serves(api_port, expected)  # the restarted API
        assert up.poll() is None  # still serving
    finally:
        stop_up(up, redis_url, str(llama_ckpt.path))


def test_up_with_two_control_planes_survives_kill_9_of_one(llama_ckpt, redis_url, expected):
    """`up --control-planes 2`: kill -9 of the first plane mid-stream; the SDK's streams resume
    on the second (every one exact), the first plane's worker moves there, `up` restarts the
    dead plane, the worker goes back home to it, and the HTTP API still answers."""
    port, api_port = up_ports(control_planes=2)
    urls = [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 2}"]
    argv = [
        "up", "--workers", "2", "--control-planes", "2", "--port", str(port),
        "--api-port", str(api_port), "--model", str(llama_ckpt.path), "--redis-url", redis_url,
        "--num-blocks", "256", "--block-size", "4", "--max-model-len", "256",
    ]  # fmt: skip
    keys = os.environ["SPECSERVE_KEYS"]
    up, lines = start_up(argv)
    try:
        first = child_pids(lines)
        assert {"control", "control-1", "worker-0", "worker-1", "api"} <= set(first)
        # each worker pinned to its own share of the cores, one thread per core, brief spins
        shares = [os.sched_getaffinity(first[w]) for w in ("worker-0", "worker-1")]
        cores = usable_cpus()
        if len(cores) >= 2:
            assert not shares[0] & shares[1] and shares[0] | shares[1] == set(cores)
        pattern = r"\[(worker-\d)\].*worker.threads +cpus=\[([\d, ]+)\] spin=(\d+) threads=(\d+)"
        logged = {
            w: (set(map(int, c.split(","))), spin, int(n))
            for w, c, spin, n in re.findall(pattern, "".join(lines))
        }
        names = ("worker-0", "worker-1")
        assert logged == {w: (s, SPIN_COUNT, len(s)) for w, s in zip(names, shares, strict=True)}
        assert streams_with_a_kill(urls, keys, first["control"]) == expected
        wait_for(lambda: child_pids(lines)["control"] != first["control"], 30, "no restart")

        def live() -> list[int]:
            return [get_status(url, keys=keys).live_workers for url in urls]

        # worker-0 went to the second plane, then back home to the restarted first one
        wait_for(lambda: live() == [1, 1], 60, "the workers did not settle on their planes")
        assert any("control exited with status -9; restarting it" in line for line in lines)
        assert_the_api_serves(api_port, expected)
        assert up.poll() is None
    finally:
        stop_up(up, redis_url, str(llama_ckpt.path))
