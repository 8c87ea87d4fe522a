"""Control-plane failover under load: kill -9 of a control plane while streams run.

Usage: .venv/bin/python bench/service.py --failover [--streams 32] [--max-tokens 96]
    [--rounds 3] [--model smollm2-135m] [--kill-after 3] [--no-pin]

`specserve up --workers 2 --control-planes 2 --no-api --insecure` serves the bundled model (its
own private Redis). One round: --streams greedy streams (random 48-160 token prompts) start on
one `AsyncClient` given both planes, which sends them to the first plane; --kill-after seconds
later the first plane is killed with SIGKILL. `up` restarts it; the client resumes every stream
on the second plane, where the first plane's worker joins it (and later goes home again).

Per round: every stream must complete with exactly the tokens of an uninterrupted run of the same
prompts (measured first, on the same service); for each stream in flight at the kill, the time
from the kill to its first resumed token; output tokens per second in 0.5 s buckets, to show the
dip: the rate in the 2 s before the kill, the lowest bucket after it, and how long until a bucket
is back to 80% of the rate before. The summary pools the rounds: p50/p99 time to the first
resumed token (goal: p99 under 5 s), and whether every request resumed exactly.

No peer: vLLM's server holds its requests in its one process, so a crash there ends every
request in flight; there is nothing to time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from service import percentile

from specserve.client import AsyncClient, SamplingParams, get_status
from specserve.launch.local_redis import free_port

BUCKET_S = 0.5


@dataclass
class Round:
    kill_at: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # one per output token
    first_resumed_s: list[float] = field(default_factory=list)  # per stream in flight at kill
    exact: int = 0
    streams: int = 0


class Up:
    """`specserve up` as a child process; its stderr is read on a thread for the children's pids."""

    def __init__(self, model: str, port: int, extra: list[str]) -> None:
        argv = [
            sys.executable, "-m", "specserve.cli", "up", "--workers", "2", "--control-planes",
            "2", "--port", str(port), "--no-api", "--insecure", "--model", model, *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(300) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("specserve up did not start:\n" + "".join(self.lines[-40:]))

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if "specserve is serving" in line:
                self.ready.set()

    def pid(self, name: str) -> int:
        pids = re.findall(rf"started {re.escape(name)} \(pid (\d+)\)", "".join(self.lines))
        return int(pids[-1])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(48, 160))] for _ in range(n)]


async def stream_all(
    urls: list[str], batch: list[list[int]], params: SamplingParams, on_start=None
) -> tuple[list[list[int]], list[list[float]]]:
    """Every prompt streamed at once on one client: the tokens and each token's arrival time."""
    tokens: list[list[int]] = [[] for _ in batch]
    times: list[list[float]] = [[] for _ in batch]

    async def one(client: AsyncClient, i: int) -> None:
        async for out in client.stream(batch[i], params):
            now = time.monotonic()
            tokens[i].extend(out.token_ids)
            times[i].extend([now] * len(out.token_ids))

    async with AsyncClient(urls, timeout=300) as client:
        tasks = [asyncio.ensure_future(one(client, i)) for i in range(len(batch))]
        if on_start is not None:
            await on_start()
        await asyncio.gather(*tasks)
    return tokens, times


def run_round(up: Up, urls: list[str], batch, params, expected, kill_after: float) -> Round:
    result = Round(streams=len(batch))

    async def kill_later() -> None:
        await asyncio.sleep(kill_after)
        os.kill(up.pid("control"), signal.SIGKILL)
        result.kill_at = time.monotonic()

    tokens, times = asyncio.run(stream_all(urls, batch, params, kill_later))
    result.exact = sum(t == e for t, e in zip(tokens, expected, strict=True))
    for stamps in times:
        result.arrivals.extend(stamps)
        before = [t for t in stamps if t <= result.kill_at]
        after = [t for t in stamps if t > result.kill_at]
        if before and after:  # in flight at the kill
            result.first_resumed_s.append(after[0] - result.kill_at)
    return result


def dip(result: Round) -> tuple[float, float, float | None]:
    """Tokens/s in the 2 s before the kill, the lowest 0.5 s bucket after it, and the seconds
    until a bucket is back to 80% of the rate before (None if never, within the round)."""
    k = result.kill_at
    before = sum(1 for t in result.arrivals if k - 2.0 < t <= k) / 2.0
    end = max(result.arrivals)
    buckets = []
    start = k
    while start < end:
        count = sum(1 for t in result.arrivals if start < t <= start + BUCKET_S)
        buckets.append((start - k, count / BUCKET_S))
        start += BUCKET_S
    lowest = min((rate for _, rate in buckets), default=0.0)
    back = next((at + BUCKET_S for at, rate in buckets if rate >= 0.8 * before), None)
    return before, lowest, back


def wait_settled(urls: list[str], workers: int, timeout: float = 120.0) -> None:
    """Until the planes hold every worker again (the killed plane restarted, its worker home)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if [get_status(u).live_workers for u in urls] == [1] * workers:
                return
        except Exception:  # a plane still starting
            pass
        time.sleep(0.5)
    raise RuntimeError("the service did not settle after the kill")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kill-after", type=float, default=3.0, help="seconds into each round")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--no-pin", action="store_true", help="up --no-pin: workers share the cores")
    args = p.parse_args(argv)
    port = free_port()
    urls = [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 2}"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    up = Up(args.model, port, ["--no-pin"] if args.no_pin else [])
    try:
        wait_settled(urls, 2)
        rounds = []
        for r in range(args.rounds):
            batch = prompts(args.streams, seed=r)
            expected, _ = asyncio.run(stream_all(urls, batch, params))  # uninterrupted
            wait_settled(urls, 2)
            rounds.append(run_round(up, urls, batch, params, expected, args.kill_after))
            wait_settled(urls, 2)
    finally:
        up.stop()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.2f}; model {args.model}; up --workers 2 --control-planes 2"
        f"{' --no-pin' if args.no_pin else ''}; "
        f"{args.streams} greedy streams x {args.max_tokens} tokens; kill -9 of the first plane "
        f"{args.kill_after:g} s in; {args.rounds} rounds"
    )
    print(f"{'round':>5} {'in flight':>9} {'exact':>7} {'resume p50 s':>12} {'p99 s':>7} "
          f"{'tok/s before':>12} {'lowest':>7} {'back in s':>9}")  # fmt: skip
    for i, r in enumerate(rounds):
        before, lowest, back = dip(r)
        resumed = r.first_resumed_s
        print(
            f"{i + 1:>5} {len(resumed):>9} {r.exact:>3}/{r.streams:<3} "
            f"{percentile(resumed, 0.5):>12.2f} {percentile(resumed, 0.99):>7.2f} "
            f"{before:>12.1f} {lowest:>7.1f} {back if back is not None else float('nan'):>9.1f}"
        )
    pooled = [s for r in rounds for s in r.first_resumed_s]
    exact = sum(r.exact for r in rounds)
    total = sum(r.streams for r in rounds)
    if not pooled:
        print(f"no stream was in flight at a kill (raise --max-tokens); exact {exact}/{total}")
        return 0 if exact == total else 1
    print(
        f"pooled: {len(pooled)} streams in flight at a kill; first resumed token after "
        f"p50 {percentile(pooled, 0.5):.2f} s, p99 {percentile(pooled, 0.99):.2f} s, max "
        f"{max(pooled):.2f} s (goal: p99 < 5 s); exact {exact}/{total}; mean "
        f"{statistics.mean(pooled):.2f} s"
    )
    return 0 if exact == total else 1
