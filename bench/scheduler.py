"""Control-plane step cost of the specserve scheduler, and block-hashing throughput.

Usage: .venv/bin/python bench/scheduler.py [--quick] [--profile]

Part 1 times one scheduler step with every request decoding: `Scheduler.schedule()`, the msgpack
encode of the step batch (`shared.protocol.encode`) and `Scheduler.update_from_output()`. A fake
worker answers each step (1 + a sampled tokens, a uniform in 0..K accepted drafts, K new drafts);
building its `StepResult` is not timed. The workload: block size 16, prompts of 512 tokens that
share a 256-token system prompt, max_model_len 4096, and a token budget of 2 x requests x (1 + 2K)
that schedules every request in every step (DFlash also charges K drafter query slots per request
against the budget). Variants are interleaved in rounds so that load from other processes hits
them alike; wall time (perf_counter_ns) is the measure, this thread's CPU time is shown beside it.

Part 2 measures `BlockHasher` + `extend_block_hashes` throughput for sha256 and xxh3_128.

A scheduler has no stand-alone peer to run in the same process, so the in-run reference
is the same workload with speculative decoding off and prefix caching off; every configuration
is printed as a ratio to it.

`--profile` adds a cProfile of 50 steps (schedule + update only) at 256 requests with DFlash K=4
and prefix caching on.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import platform
import pstats
import random
import statistics
import sys
import time
from dataclasses import dataclass

from machine import cpu_model

from specserve.control.request import Request
from specserve.control.scheduler import ScheduledStep, Scheduler
from specserve.shared.config import CacheConfig, KVGroupSpec, SchedulerConfig, SpecConfig
from specserve.shared.hashing import BlockHasher, extend_block_hashes
from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    RequestResult,
    RunningDelta,
    SamplingParams,
    StepResult,
    encode,
)

BLOCK_SIZE = 16
PROMPT_LEN = 512
SHARED_PREFIX_LEN = 256
MAX_MODEL_LEN = 4096
VOCAB_SIZE = 32_000
NUM_SPEC_TOKENS = 4
GOAL_NS = 2_000_000  # schedule + update per step at 256 requests
GOAL_NUM_REQUESTS = 256
SEED = 1234
MAX_WARMUP_DECODE_STEPS = 100  # the pool is sized for this many decode steps before timing


@dataclass(frozen=True)
class Variant:
    name: str
    spec: SpecConfig
    prefix_caching: bool


TARGET = Variant("DFlash K=4, prefix cache", SpecConfig("dflash", NUM_SPEC_TOKENS), True)
BASELINE = Variant("no spec, no prefix cache (baseline)", SpecConfig(), False)
VARIANTS = (
    TARGET,
    Variant("DFlash K=4, no prefix cache", SpecConfig("dflash", NUM_SPEC_TOKENS), False),
    Variant("no spec, prefix cache", SpecConfig(), True),
    BASELINE,
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- part 1: scheduler step cost ------------------------------------------------------------


def token_budget(num_requests: int) -> int:
    """Twice what one decode step of every request needs, so warm-up prefills are not starved.

    DFlash charges each scheduled request K drafter query slots against the input budget on top of
    its 1 + K tokens, so one decode step of N requests needs N * (1 + 2K), not N * (1 + K). With
    exactly that budget, admission slows to a crawl as the running set grows; the budget does not
    change the cost of a decode step once every request is scheduled.
    """
    return 2 * num_requests * (1 + 2 * NUM_SPEC_TOKENS)


def make_scheduler(variant: Variant, num_requests: int, num_steps: int) -> Scheduler:
    # Room for every token a request can reach: warm-up, settling and timed steps all decode.
    max_steps = num_steps + MAX_WARMUP_DECODE_STEPS
    tokens_per_request = PROMPT_LEN + max_steps * (1 + NUM_SPEC_TOKENS) + 2 * NUM_SPEC_TOKENS + 2
    if tokens_per_request > MAX_MODEL_LEN:
        raise ValueError(f"{num_steps} steps would run requests past max_model_len")
    num_blocks = num_requests * (cdiv(tokens_per_request, BLOCK_SIZE) + 1) + 1
    config = SchedulerConfig(
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=token_budget(num_requests),
        max_num_seqs=num_requests,
        spec=variant.spec,
    )
    cache = CacheConfig(
        num_blocks=num_blocks,
        kv_groups=(KVGroupSpec("full", BLOCK_SIZE),),
        enable_prefix_caching=variant.prefix_caching,
    )
    return Scheduler(config, cache)


def make_requests(num_requests: int, rng: random.Random) -> list[Request]:
    system = [rng.randrange(VOCAB_SIZE) for _ in range(SHARED_PREFIX_LEN)]
    sampling = SamplingParams(max_tokens=MAX_MODEL_LEN, temperature=0.0, ignore_eos=True)
    return [
        Request(
            f"req-{i}",
            system + [rng.randrange(VOCAB_SIZE) for _ in range(PROMPT_LEN - SHARED_PREFIX_LEN)],
            sampling,
        )
        for i in range(num_requests)
    ]


def _num_drafts(delta: RunningDelta) -> int:
    """Drafts to verify in a delta: a count (`num_spec_tokens`) or the ids (`spec_token_ids`)."""
    count = getattr(delta, "num_spec_tokens", None)
    if count is not None:
        return count
    return len(getattr(delta, "spec_token_ids", None) or ())


class FakeWorker:
    """Answers step batches the way a worker would, without a model: random tokens and drafts."""

    def __init__(self, num_spec_tokens: int, rng: random.Random) -> None:
        self.k = num_spec_tokens
        self.rng = rng
        self.num_tokens: dict[int, int] = {}  # tokens the worker knows per handle

    def _sample(self, handle: int, num_accepted: int) -> RequestResult:
        rand = self.rng.randrange
        sampled = [rand(VOCAB_SIZE) for _ in range(1 + num_accepted)]
        drafts = [rand(VOCAB_SIZE) for _ in range(self.k)] if self.k else None
        self.num_tokens[handle] += len(sampled)
        return RequestResult(handle, sampled, drafts)

    def respond(self, step: ScheduledStep) -> StepResult:
        batch = step.batch
        for handle in (*batch.preempted, *batch.finished):
            self.num_tokens.pop(handle, None)
        results: list[RequestResult] = []
        for new in batch.new_requests:
            self.num_tokens[new.handle] = len(new.token_ids)
            if new.num_computed_tokens + new.num_scheduled_tokens >= len(new.token_ids):
                results.append(self._sample(new.handle, 0))
            else:
                results.append(RequestResult(new.handle, []))
        for delta in batch.running:
            num_drafts = _num_drafts(delta)
            end = delta.num_computed_tokens + delta.num_scheduled_tokens - num_drafts
            if end >= self.num_tokens[delta.handle]:
                accepted = self.rng.randint(0, num_drafts)
                results.append(self._sample(delta.handle, accepted))
            else:
                results.append(RequestResult(delta.handle, []))
        return StepResult(PROTOCOL_VERSION, batch.step_id, results)


def warm_up(sched: Scheduler, worker: FakeWorker, num_requests: int) -> int:
    """Run prefills until every request is running and decoding; returns the steps it took."""
    steps = 0
    while True:
        running = sched.running
        if len(running) == num_requests and all(r.num_output_tokens > 0 for r in running):
            break
        step = sched.schedule()
        sched.update_from_output(step, worker.respond(step))
        steps += 1
        if steps > MAX_WARMUP_DECODE_STEPS - 3:
            raise RuntimeError(f"warm-up did not converge in {steps} steps")
    for _ in range(3):  # settle: every request now carries drafts from a decode step
        step = sched.schedule()
        sched.update_from_output(step, worker.respond(step))
    return steps


@dataclass
class StepTimes:
    schedule: list[int]
    update: list[int]
    encode: list[int]
    total: list[int]  # schedule + update
    cpu: list[int]  # schedule + update, this thread's CPU time (robust to other processes)
    nbytes: list[int]
    tokens: list[int]  # output tokens the step's update emitted


def run_steps(
    sched: Scheduler,
    worker: FakeWorker,
    num_requests: int,
    num_steps: int,
    profiler: cProfile.Profile | None = None,
) -> StepTimes:
    clock = time.perf_counter_ns
    cpu_clock = time.thread_time_ns
    times = StepTimes([], [], [], [], [], [], [])
    for _ in range(num_steps):
        if profiler is not None:
            profiler.enable()
        c0 = cpu_clock()
        t0 = clock()
        step = sched.schedule()
        t1 = clock()
        c1 = cpu_clock()
        if profiler is not None:
            profiler.disable()
        data = encode(step.batch)
        t2 = clock()
        batch = step.batch
        if len(batch.running) != num_requests or batch.new_requests or batch.preempted:
            raise RuntimeError(
                f"step {batch.step_id} scheduled {len(batch.running)} running, "
                f"{len(batch.new_requests)} new, {len(batch.preempted)} preempted; "
                f"expected all {num_requests} running"
            )
        result = worker.respond(step)  # not timed
        if profiler is not None:
            profiler.enable()
        c3 = cpu_clock()
        t3 = clock()
        updates = sched.update_from_output(step, result)
        t4 = clock()
        c4 = cpu_clock()
        if profiler is not None:
            profiler.disable()
        if len(updates) != num_requests or any(u.finished for u in updates):
            raise RuntimeError(f"step {batch.step_id}: a request stopped decoding")
        times.schedule.append(t1 - t0)
        times.encode.append(t2 - t1)
        times.update.append(t4 - t3)
        times.total.append(t1 - t0 + t4 - t3)
        times.cpu.append(c1 - c0 + c4 - c3)
        times.nbytes.append(len(data))
        times.tokens.append(sum(len(u.new_token_ids) for u in updates))
    return times


def measure_all(num_requests: int, num_steps: int, rounds: int) -> dict[str, StepTimes]:
    """Time every variant at one size, interleaved in `rounds` chunks of steps.

    Interleaving spreads bursts of load from other processes over all variants, so the ratios to
    the baseline stay fair on a shared machine.
    """
    states = []
    for variant in VARIANTS:
        rng = random.Random(SEED)
        sched = make_scheduler(variant, num_requests, num_steps)
        worker = FakeWorker(variant.spec.num_spec_tokens, rng)
        t = time.perf_counter()
        for request in make_requests(num_requests, rng):
            sched.add_request(request)
        warm_steps = warm_up(sched, worker, num_requests)
        log(
            f"  {variant.name}, {num_requests} requests: warm-up {warm_steps} steps "
            f"in {time.perf_counter() - t:.1f}s"
        )
        states.append((variant, sched, worker))
    gc.collect()
    times = {v.name: StepTimes([], [], [], [], [], [], []) for v in VARIANTS}
    done = 0
    for r in range(rounds):
        chunk = num_steps * (r + 1) // rounds - done
        done += chunk
        log(f"  {num_requests} requests: round {r + 1}/{rounds}, {chunk} steps per variant")
        for variant, sched, worker in states:
            t = run_steps(sched, worker, num_requests, chunk)
            acc = times[variant.name]
            for name in StepTimes.__dataclass_fields__:
                getattr(acc, name).extend(getattr(t, name))
    return times


def median(xs: list[int]) -> float:
    return statistics.median(xs)


def p90(xs: list[int]) -> float:
    return statistics.quantiles(xs, n=10, method="inclusive")[-1]


def us(ns: float) -> str:
    return f"{ns / 1000:,.0f}" if ns >= 100_000 else f"{ns / 1000:,.1f}"


def print_step_table(results: dict[tuple[str, int], StepTimes], sizes: list[int]) -> None:
    print(
        "| configuration | requests | schedule µs (p50 / p90) | update µs (p50 / p90) "
        "| schedule+update µs (p50 / p90) | per request µs | per output token µs "
        "| CPU µs (p50) | encode µs (p50 / p90) | batch bytes | vs baseline |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        base = median(results[(BASELINE.name, n)].total)
        for variant in VARIANTS:
            t = results[(variant.name, n)]
            total = median(t.total)
            print(
                f"| {variant.name} | {n} "
                f"| {us(median(t.schedule))} / {us(p90(t.schedule))} "
                f"| {us(median(t.update))} / {us(p90(t.update))} "
                f"| {us(total)} / {us(p90(t.total))} "
                f"| {total / n / 1000:.2f} "
                f"| {total / statistics.mean(t.tokens) / 1000:.2f} "
                f"| {us(median(t.cpu))} "
                f"| {us(median(t.encode))} / {us(p90(t.encode))} "
                f"| {int(median(t.nbytes)):,} "
                f"| {total / base:.2f}x |"
            )


def profile_steps(num_requests: int, num_steps: int, top: int) -> None:
    rng = random.Random(SEED)
    sched = make_scheduler(TARGET, num_requests, num_steps)
    worker = FakeWorker(NUM_SPEC_TOKENS, rng)
    for request in make_requests(num_requests, rng):
        sched.add_request(request)
    warm_up(sched, worker, num_requests)
    gc.collect()
    profiler = cProfile.Profile()
    run_steps(sched, worker, num_requests, num_steps, profiler)
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.strip_dirs().sort_stats(key).print_stats(top)
        print(
            f"\ncProfile, {num_steps} steps (schedule + update) at {num_requests} requests, "
            f"{TARGET.name}, sorted by {key}:"
        )
        print(out.getvalue().split("\n", 4)[-1].rstrip())  # drop pstats' header lines


# --- part 2: block hashing ------------------------------------------------------------------


def hash_throughput(algo: str, token_ids: list[int], repeats: int) -> float:
    hasher = BlockHasher(algo)
    best = None
    for _ in range(repeats):
        hashes: list[bytes] = []
        t0 = time.perf_counter_ns()
        extend_block_hashes(hasher, hashes, token_ids, BLOCK_SIZE)
        elapsed = time.perf_counter_ns() - t0
        assert len(hashes) == len(token_ids) // BLOCK_SIZE
        best = elapsed if best is None else min(best, elapsed)
    assert best is not None
    return len(token_ids) / (best / 1e9)


# --- main -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and tokens (< 30 s)")
    parser.add_argument(
        "--profile", action="store_true", help="also cProfile 50 steps at 256 requests"
    )
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # keep results and progress (stderr) in order

    sizes = [256, 1024]
    steps = {256: 40, 1024: 15} if args.quick else {256: 300, 1024: 100}
    rounds = 2 if args.quick else 5
    hash_tokens = 262_144 if args.quick else 1_048_576
    hash_repeats = 1 if args.quick else 3

    print(f"specserve scheduler benchmark{' (--quick)' if args.quick else ''}")
    print(f"machine: {os.cpu_count()} CPUs, {cpu_model()}, Python {platform.python_version()}")
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    print(
        f"workload: block size {BLOCK_SIZE}, prompts of {PROMPT_LEN} tokens sharing a "
        f"{SHARED_PREFIX_LEN}-token prefix, max_model_len {MAX_MODEL_LEN}, "
        f"max_num_batched_tokens = requests x {2 * (1 + 2 * NUM_SPEC_TOKENS)}, fake worker accepts "
        f"a ~ U{{0..{NUM_SPEC_TOKENS}}} drafts per step"
    )
    print(
        "reference: a scheduler has no stand-alone peer to run in-process; the "
        "in-run baseline is the same workload with spec decoding off and prefix caching off"
    )

    log("part 1: scheduler step cost")
    results: dict[tuple[str, int], StepTimes] = {}
    for n in sizes:
        for name, times in measure_all(n, steps[n], rounds).items():
            results[(name, n)] = times
    print(
        f"\nStep cost ({steps[256]} steps at 256 requests, {steps[1024]} at 1024, variants "
        f"interleaved in {rounds} rounds; fake-result construction not timed)\n"
    )
    print_step_table(results, sizes)

    log("part 2: block hashing")
    rng = random.Random(SEED)
    token_ids = [rng.randrange(VOCAB_SIZE) for _ in range(hash_tokens)]
    rates = {}
    for algo in ("sha256", "xxh3_128"):
        log(f"  {algo}: {hash_tokens:,} tokens x {hash_repeats}")
        rates[algo] = hash_throughput(algo, token_ids, hash_repeats)
    print(
        f"\nBlock hashing ({hash_tokens:,} random token ids, block size {BLOCK_SIZE}, best of "
        f"{hash_repeats})\n"
    )
    print("| algorithm | tokens/s | blocks/s | vs sha256 |")
    print("|---|---:|---:|---:|")
    for algo, rate in rates.items():
        print(
            f"| {algo} | {rate / 1e6:.2f} M | {rate / BLOCK_SIZE / 1e3:,.0f} k "
            f"| {rate / rates['sha256']:.2f}x |"
        )

    target = results[(TARGET.name, GOAL_NUM_REQUESTS)]
    p50, p90_, cpu50 = median(target.total), p90(target.total), median(target.cpu)
    print(
        f"\nGoal: schedule + update <= {GOAL_NS / 1e6:.0f} ms per step at {GOAL_NUM_REQUESTS} "
        f"requests ({TARGET.name}): wall p50 {p50 / 1e6:.2f} ms, p90 {p90_ / 1e6:.2f} ms, "
        f"CPU p50 {cpu50 / 1e6:.2f} ms -> {'MET' if p50 <= GOAL_NS else 'NOT MET'} "
        f"(judged on wall p50; p90 is {'within' if p90_ <= GOAL_NS else 'over'} the goal)"
    )
    load = os.getloadavg()[0]
    print(f"load average at end: {load:.2f}")
    if load > (os.cpu_count() or 1) - 0.5:
        print(
            "warning: other processes kept the CPUs busy; wall times include waiting for a CPU "
            "(compare the CPU column)"
        )

    if args.profile:
        log("profile: 50 steps at 256 requests")
        profile_steps(GOAL_NUM_REQUESTS, 50, top=25)


if __name__ == "__main__":
    main()
