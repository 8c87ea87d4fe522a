"""Prefix-aware routing against round-robin: same workers, workload and arrival times, one run.

Usage: .venv/bin/python bench/service.py [--workers 2] [--groups 6] [--users 8] [--questions 2]
    [--system-tokens 192] [--rate 2] [--max-tokens 16] [--model smollm2-135m] [--num-blocks N]
    [--redis-url URL] [--seed 0] [--quick] [--index-only] [--json] [--curve [--repeat 3]]
       .venv/bin/python bench/service.py --http [...]: the HTTP API under guidellm against
    `vllm serve` and the ZeroMQ SDK (bench/http_api.py)
       .venv/bin/python bench/service.py --failover [...]: kill -9 of a control plane under
    load, time to the first resumed token and the throughput dip (bench/failover.py)

The workload has the shape of llm-d's precise-prefix-cache benchmark, scaled to a small CPU box:
G groups of users, each group sharing one long system prompt; each of U users per group asks Q
questions of ~24 random tokens. Requests arrive in an open loop (Poisson at --rate) in a shuffled
order, each generating --max-tokens greedy tokens with ignore_eos. A worker's KV cache is too
small for every group's system prompt, so where a request lands decides whether its prefix is
recomputed.

Per routing mode, a fresh control plane (a thread of this process, so its metrics are read
directly) and fresh worker processes (cold caches) serve the same workload with the same arrival
times against one Redis. Both modes run one after the other in this process, so they share the
machine's conditions as far as a sequential run can. Part 2 (alone with --index-only) times the
prefix index against the same Redis (`IndexReader.longest_prefix` for a 12-block prompt,
`IndexWriter.apply` batches) and the control plane's admission rate, with and without Redis.

With --curve it measures authentication instead: prefix routing without keys against prefix
routing with CURVE on both ports (`--keys`, every worker and the client authenticated), the two
interleaved --repeat times, and prints TTFT p50, inter-token latency p50 and throughput of each
with the ratios (the medians over the repeats).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import hashlib
import itertools
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from redis import Redis

from specserve.cache_index import IndexReader, IndexWriter, Namespace, connect, register_worker
from specserve.client import AsyncClient, ServiceError
from specserve.control.control_plane import ControlArgs, ControlPlane, tune_gc
from specserve.launch.local_redis import LocalRedis, free_port
from specserve.shared.config import AttentionType, KVGroupSpec
from specserve.shared.curve import generate_keys
from specserve.shared.kv_events import BlockStored
from specserve.shared.logging import configure_logging
from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    GenerateRequest,
    Register,
    SamplingParams,
    WorkerInfo,
)

MODES = ("round-robin", "prefix")
BLOCK_SIZE = 16
QUESTION_TOKENS = 24
QUESTION_JITTER = 4  # questions are 20..28 tokens
TOKEN_RANGE = (100, 30_000)  # inside any common vocabulary, clear of special tokens
RUNNING_ROOM = 8  # running requests whose own blocks the default KV cache leaves room for
REQUEST_TIMEOUT_S = 600.0
REGISTER_TIMEOUT_S = 120.0
PROGRESS_EVERY_S = 10.0
INDEX_BLOCKS = 12  # a 192-token prompt
SKEW = 3  # worker i of the index bench holds INDEX_BLOCKS - SKEW * i leading blocks

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- the workload ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    index: int
    group: int
    arrival_s: float  # after the start of the timed run
    prompt: list[int]


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def build_workload(args: argparse.Namespace) -> list[Job]:
    """Shuffled questions behind their group's system prompt, with Poisson arrival times."""
    rng = random.Random(args.seed)
    systems = [random_tokens(rng, args.system_tokens) for _ in range(args.groups)]
    per_group = args.users * args.questions
    prompts = [
        (group, systems[group] + random_tokens(rng, question_length(rng)))
        for group in range(args.groups)
        for _ in range(per_group)
    ]
    rng.shuffle(prompts)
    jobs, arrival = [], 0.0
    for index, (group, prompt) in enumerate(prompts):
        jobs.append(Job(index, group, arrival, prompt))
        arrival += rng.expovariate(args.rate)
    return jobs


def question_length(rng: random.Random) -> int:
    return QUESTION_TOKENS + rng.randint(-QUESTION_JITTER, QUESTION_JITTER)


def warmup_prompts(args: argparse.Namespace) -> list[list[int]]:
    """One short prompt per worker, unrelated to the groups: pays first-step costs untimed."""
    rng = random.Random(args.seed + 1)
    return [random_tokens(rng, QUESTION_TOKENS) for _ in range(args.workers)]


def default_num_blocks(args: argparse.Namespace) -> int:
    """KV blocks per worker: its share of the system prompts under ideal prefix routing, plus
    the own blocks of RUNNING_ROOM running requests, plus the null block. That is less than
    every group's system prompt needs, so a worker that sees all groups (round-robin) must evict
    prefixes that it will need again, while one that sees only its share keeps them."""
    prefix = args.system_tokens // BLOCK_SIZE
    longest = args.system_tokens + QUESTION_TOKENS + QUESTION_JITTER + args.max_tokens
    own = cdiv(longest, BLOCK_SIZE) - prefix
    return cdiv(args.groups, args.workers) * prefix + RUNNING_ROOM * own + 1


# --- one service: a control plane thread and worker processes -------------------------------

WORKER_CODE = """\
import sys
from specserve.launch.lifetime import die_with_parent
die_with_parent({parent})  # never outlive the benchmark
import torch
torch.set_num_threads(1)
from specserve.worker.engine import EngineArgs
from specserve.worker.worker_process import run_worker
from specserve.shared.curve import PeerKeys
keys = None if {keys!r} is None else PeerKeys.load({keys!r}, "workers", "worker")
sys.exit(run_worker(EngineArgs(**{engine!r}), {url!r}, {worker_id!r}, keys=keys))
"""


@dataclass
class Service:
    """A control plane in a thread and its workers; `close` always stops all of them."""

    plane: ControlPlane
    url: str
    worker_url: str
    logdir: Path
    keys: str | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start_worker(self, worker_id: str, engine: dict[str, object]) -> None:
        code = WORKER_CODE.format(
            parent=os.getpid(),
            engine=engine,
            url=self.worker_url,
            worker_id=worker_id,
            keys=self.keys,
        )
        env = dict(os.environ, OMP_NUM_THREADS="1", SPECSERVE_LOG_LEVEL="warning")
        with open(self.logdir / f"{worker_id}.log", "ab") as out:
            self.workers[worker_id] = subprocess.Popen(
                [sys.executable, "-c", code], stdout=out, stderr=out, env=env
            )

    def wait_registered(self, timeout: float = REGISTER_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while set(self.plane.workers) != set(self.workers):
            for worker_id, proc in self.workers.items():
                if proc.poll() is not None:
                    tail = (self.logdir / f"{worker_id}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{worker_id} exited with {proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers did not register within {timeout:.0f}s")
            time.sleep(0.05)

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=10)
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def running_service(
    routing: str, args: argparse.Namespace, redis_url: str, logdir: Path, keys: str | None
) -> Iterator[Service]:
    url = f"tcp://127.0.0.1:{free_port()}"
    worker_url = f"tcp://127.0.0.1:{free_port()}"
    control = ControlArgs(
        bind=url,
        worker_bind=worker_url,
        keys=keys,
        redis_url=redis_url,
        model=args.model,
        routing=routing,
    )
    plane = ControlPlane(control)
    service = Service(plane, url, worker_url, logdir, keys)
    try:
        service.thread = threading.Thread(target=plane.run, args=(service.stop,), daemon=True)
        service.thread.start()
        engine = dict(model=args.model, block_size=BLOCK_SIZE, num_blocks=args.num_blocks)
        for i in range(args.workers):
            service.start_worker(f"worker-{i}", engine)
        service.wait_registered()
        yield service
    finally:
        service.close()


@contextlib.contextmanager
def redis_server(url: str | None) -> Iterator[str]:
    """The given Redis, else a private one that lives for this run."""
    if url is not None:
        yield url
        return
    server = LocalRedis(die_with_parent=True).start()
    try:
        yield server.url
    finally:
        server.close()


# --- the load -------------------------------------------------------------------------------


@dataclass
class Outcome:
    group: int
    sent: float = 0.0
    first_token: float | None = None
    done: float | None = None
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    worker: str | None = None
    error: str | None = None


@dataclass
class Progress:
    label: str
    total: int
    sent: int = 0
    done: int = 0

    async def report(self) -> None:
        """A line every PROGRESS_EVERY_S, so a stall shows while it happens."""
        start = time.perf_counter()
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            elapsed = time.perf_counter() - start
            log(
                f"[{self.label}] {elapsed:4.0f}s: {self.sent}/{self.total} sent, "
                f"{self.done}/{self.total} done"
            )


async def one_request(
    client: AsyncClient, job: Job, params: SamplingParams, start: float, progress: Progress
) -> Outcome:
    """Send at the job's arrival time and time its stream (client side)."""
    await asyncio.sleep(max(0.0, start + job.arrival_s - time.perf_counter()))
    out = Outcome(job.group, sent=time.perf_counter())
    progress.sent += 1
    try:
        async with contextlib.aclosing(client.stream(job.prompt, params)) as stream:
            async for output in stream:
                if output.token_ids and out.first_token is None:
                    out.first_token = time.perf_counter()
                out.token_ids.extend(output.token_ids)
                out.cached_tokens = output.num_cached_tokens or out.cached_tokens
                out.worker = output.worker_id or out.worker
    except ServiceError as exc:
        out.error = str(exc)
    out.done = time.perf_counter()
    progress.done += 1
    return out


async def drive(
    url: str,
    jobs: list[Job],
    warmup: list[list[int]],
    params: SamplingParams,
    label: str,
    on_warm: Callable[[], None],
    keys: str | None = None,
) -> list[Outcome]:
    """Warm up (untimed), call `on_warm`, then replay the jobs in an open loop."""
    async with AsyncClient(url, timeout=REQUEST_TIMEOUT_S, keys=keys) as client:
        await asyncio.gather(*(client.generate(p, params) for p in warmup))
        on_warm()
        progress = Progress(label, len(jobs))
        reporter = asyncio.create_task(progress.report())
        start = time.perf_counter()
        try:
            return await asyncio.gather(
                *(one_request(client, job, params, start, progress) for job in jobs)
            )
        finally:
            reporter.cancel()


# --- reading the control plane --------------------------------------------------------------


@dataclass
class PlaneState:
    """Counters that only grow, so a difference of two readings covers the timed run."""

    samples: Samples
    engine_hits: int
    engine_queries: int


def read_plane(plane: ControlPlane) -> PlaneState:
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for metric in plane.metrics.registry.collect()
        for s in metric.samples
    }
    stats = [w.scheduler.kv.stats for w in list(plane.workers.values())]
    return PlaneState(samples, sum(s.hits for s in stats), sum(s.queries for s in stats))


def delta(before: Samples, after: Samples) -> Samples:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def total(samples: Samples, name: str) -> float:
    """The sum of a metric's samples over all its label sets."""
    return sum(value for (n, _), value in samples.items() if n == name)


def histogram_quantile(samples: Samples, name: str, q: float) -> float | None:
    """Prometheus-style quantile: linear inside the bucket that holds it."""
    buckets = sorted(
        (float(dict(labels)["le"]), value)
        for (n, labels), value in samples.items()
        if n == f"{name}_bucket"
    )
    count = buckets[-1][1] if buckets else 0.0
    if count <= 0:
        return None
    rank, lower, below = q * count, 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if upper == float("inf"):
                return lower
            share = (rank - below) / (cumulative - below) if cumulative > below else 1.0
            return lower + (upper - lower) * share
        lower, below = upper, cumulative
    return lower


def histogram_mean(samples: Samples, name: str) -> float | None:
    count = total(samples, f"{name}_count")
    return total(samples, f"{name}_sum") / count if count else None


# --- one mode -------------------------------------------------------------------------------


@dataclass
class ModeResult:
    routing: str
    requests: int
    errors: int
    wall_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float  # per request: (last token - first token) / (tokens - 1)
    e2e_p50_ms: float
    output_tokens_per_s: float
    prefix_hit_rate: float  # the router's estimate, from the control plane's metrics
    engine_hit_rate: float  # what the schedulers actually reused
    on_prefix_holder: float  # share of requests routed where their system prompt was cached
    workers_per_group: float
    lookup_p50_ms: float | None
    lookup_mean_ms: float | None
    turnaround_p50_ms: float | None
    turnaround_mean_ms: float | None  # the metric's sum also holds idle gaps before new work
    requests_per_worker: dict[str, int]
    resumed: int
    index_errors: int
    outputs: list[list[int]] = field(repr=False)


def run_mode(
    routing: str,
    args: argparse.Namespace,
    redis_url: str,
    jobs: list[Job],
    logdir: Path,
    keys: str | None = None,
) -> ModeResult:
    label = routing + ("+curve" if keys else "")
    log(f"[{label}] starting a control plane and {args.workers} workers")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with running_service(routing, args, redis_url, logdir, keys) as service:
        states: list[PlaneState] = []
        log(f"[{label}] workers registered; warm-up, then {len(jobs)} requests")
        outcomes = asyncio.run(
            drive(
                service.url,
                jobs,
                warmup_prompts(args),
                params,
                label,
                lambda: states.append(read_plane(service.plane)),
                keys,
            )
        )
        states.append(read_plane(service.plane))
    return summarize(label, args, outcomes, states[0], states[1])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def summarize(
    routing: str,
    args: argparse.Namespace,
    outcomes: list[Outcome],
    before: PlaneState,
    after: PlaneState,
) -> ModeResult:
    good = [o for o in outcomes if o.error is None and len(o.token_ids) == args.max_tokens]
    for o in outcomes:
        if o.error is None and len(o.token_ids) != args.max_tokens:
            o.error = f"{len(o.token_ids)} tokens instead of {args.max_tokens}"
    ttft = [o.first_token - o.sent for o in good if o.first_token is not None]
    itl = [
        (o.done - o.first_token) / (len(o.token_ids) - 1)
        for o in good
        if o.first_token is not None and len(o.token_ids) > 1
    ]
    e2e = [o.done - o.sent for o in good]
    wall = max(o.done for o in outcomes) - min(o.sent for o in outcomes)
    m = delta(before.samples, after.samples)
    queries = total(m, "specserve_prefix_query_tokens_total")
    engine_queries = after.engine_queries - before.engine_queries
    prefix_tokens = args.system_tokens // BLOCK_SIZE * BLOCK_SIZE
    groups: dict[int, set[str]] = {}
    for o in good:
        groups.setdefault(o.group, set()).add(o.worker or "?")
    return ModeResult(
        routing=routing,
        requests=len(outcomes),
        errors=len(outcomes) - len(good),
        wall_s=wall,
        ttft_p50_ms=percentile(ttft, 0.5) * 1e3,
        ttft_p90_ms=percentile(ttft, 0.9) * 1e3,
        itl_p50_ms=percentile(itl, 0.5) * 1e3,
        e2e_p50_ms=percentile(e2e, 0.5) * 1e3,
        output_tokens_per_s=sum(len(o.token_ids) for o in good) / wall,
        prefix_hit_rate=total(m, "specserve_prefix_hit_tokens_total") / queries if queries else 0.0,
        engine_hit_rate=(after.engine_hits - before.engine_hits) / engine_queries
        if engine_queries
        else 0.0,
        on_prefix_holder=sum(o.cached_tokens >= prefix_tokens for o in good) / max(len(good), 1),
        workers_per_group=statistics.mean(len(w) for w in groups.values()) if groups else 0.0,
        lookup_p50_ms=ms(histogram_quantile(m, "specserve_index_lookup_seconds", 0.5)),
        lookup_mean_ms=ms(histogram_mean(m, "specserve_index_lookup_seconds")),
        turnaround_p50_ms=ms(histogram_quantile(m, "specserve_step_turnaround_seconds", 0.5)),
        turnaround_mean_ms=ms(histogram_mean(m, "specserve_step_turnaround_seconds")),
        requests_per_worker=dict(sorted(Counter(o.worker or "?" for o in outcomes).items())),
        resumed=int(total(m, "specserve_requests_resumed_total")),
        index_errors=int(total(m, "specserve_index_errors_total")),
        outputs=[o.token_ids for o in outcomes],
    )


# --- part 2: the index alone ----------------------------------------------------------------


def chain(n: int, tag: str) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def timed_rate(fn: Callable[[], int], seconds: float) -> float:
    """Units per second of `fn` (it returns how many units one call did), called for `seconds`."""
    units, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        units += fn()
    return units / elapsed


def lookup_rate(client: Redis, ns: Namespace, num_workers: int, seconds: float) -> float:
    """Lookups/s of a 12-block prompt that worker i holds INDEX_BLOCKS - SKEW * i blocks of."""
    hashes = chain(INDEX_BLOCKS, "lookup")
    for i in range(num_workers):
        worker_id = f"lookup-w{i}"
        writer = IndexWriter(client, ns, worker_id, register_worker(client, ns, worker_id, {}))
        held = INDEX_BLOCKS - SKEW * i
        writer.apply([BlockStored(hashes[:held], list(range(held)), None, 0)])
    reader = IndexReader(client, ns)
    found = reader.longest_prefix(hashes)
    assert len(found) == num_workers, found
    return timed_rate(lambda: (reader.longest_prefix(hashes), 1)[1], seconds)


def lookup_latency(client: Redis, ns: Namespace, num_blocks: int, num_workers: int) -> float:
    """Median ms of one longest-prefix lookup of a `num_blocks`-block prompt that every one of
    `num_workers` workers holds in full (the worst case: every block read for every worker)."""
    hashes = chain(num_blocks, f"latency-{num_blocks}")
    for i in range(num_workers):
        worker_id = f"latency-w{i}"
        writer = IndexWriter(client, ns, worker_id, register_worker(client, ns, worker_id, {}))
        writer.apply([BlockStored(hashes, list(range(num_blocks)), None, 0)])
    reader = IndexReader(client, ns)
    assert reader.longest_prefix(hashes) == {
        f"latency-w{i}": num_blocks for i in range(num_workers)
    }
    samples = []
    for _ in range(200):
        start = time.perf_counter()
        reader.longest_prefix(hashes)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000


def write_rate(client: Redis, ns: Namespace, events_per_batch: int, seconds: float) -> float:
    """Block writes/s of `IndexWriter.apply`, each batch `events_per_batch` fresh 12-block
    prompts; hashing the events is outside the timed calls."""
    worker_id = f"writer-{events_per_batch}"
    writer = IndexWriter(client, ns, worker_id, register_worker(client, ns, worker_id, {}))
    blocks, spent, batch = 0, 0.0, 0
    while spent < seconds:
        events = [
            BlockStored(chain(INDEX_BLOCKS, f"w{batch}-{e}"), list(range(INDEX_BLOCKS)), None, 0)
            for e in range(events_per_batch)
        ]
        start = time.perf_counter()
        writer.apply(events)
        spent += time.perf_counter() - start
        blocks += INDEX_BLOCKS * events_per_batch
        batch += 1
    return blocks / spent


class SilentPlane(ControlPlane):
    """The real control plane with its sends dropped: admission timed without any peers."""

    def _send(self, identity: bytes, msg: object) -> bool:
        return True


def admission_rate(
    model: str, redis_url: str | None, seconds: float, burst: int = 1, other_plane: bool = True
) -> float:
    """Requests/s the control plane admits (validate, hash, look up, route, add to a scheduler):
    512-token prompts sharing 500 tokens, two registered workers with room for all of them,
    `burst` requests per pass of the loop (placed together, one index round trip). With Redis
    and `other_plane`, the index also lists a worker of another (unreachable) control plane, so
    every lookup goes through Redis, as with several planes; a lone plane routes from its own
    block pools (exact for its own workers) and leaves Redis out of admission."""
    plane = SilentPlane(ControlArgs(bind="tcp://127.0.0.1:0", model=model, redis_url=redis_url))
    tag = uuid.uuid4().hex[:6]
    thresholds = gc.get_threshold()
    tune_gc()  # as `specserve control` runs: a control plane process's collector settings
    plane.freeze_gc = True
    try:
        for i in range(2):
            info = WorkerInfo(
                worker_id=f"admit-{tag}-{i}", model=model, device="cpu",
                kv_groups=[KVGroupSpec(AttentionType.FULL, BLOCK_SIZE)], num_blocks=1 << 18,
                max_model_len=4096, vocab_size=30_000, eos_token_ids=[],
                max_num_batched_tokens=8192, max_num_seqs=4096,
            )  # fmt: skip
            plane._on_register(info.worker_id.encode(), "", Register(PROTOCOL_VERSION, info))
        if redis_url and other_plane:
            ns = next(iter(plane.workers.values())).namespace
            peer = {"session": "other-plane", "control_url": "tcp://127.0.0.1:9"}
            register_worker(plane.index.client, ns, f"admit-{tag}-peer", peer)
            plane._peers_tick(time.monotonic())
            assert plane._other_planes(), "the other plane's worker is not seen"
        shared = [TOKEN_RANGE[0] + i for i in range(500)]
        count = itertools.count()

        def admit() -> int:
            for _ in range(burst):
                i = next(count)
                prompt = shared + [TOKEN_RANGE[0] + (i >> s) % 1000 for s in range(0, 120, 10)]
                request = GenerateRequest(PROTOCOL_VERSION, f"a{i}", prompt_token_ids=prompt)
                plane._on_generate(b"bench-%d" % (i % 4096), request)  # under per-client caps
            plane._place_accepted()
            return burst

        rate = timed_rate(admit, seconds)
        admitted = sum(len(w.scheduler.requests) for w in plane.workers.values())
        assert admitted == next(count), f"only {admitted} requests reached a scheduler"
        return rate
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        plane.sock.close(linger=0)
        plane.worker_sock.close(linger=0)  # an open socket would block the context's term()


def drop_namespace(client: Redis, ns: Namespace) -> None:
    """The bench's private namespace only (the library itself never scans the keyspace)."""
    keys = list(client.scan_iter(match=ns.base + b"*", count=1000))
    if keys:
        client.unlink(*keys)


def index_bench(redis_url: str, model: str, seconds: float) -> dict[str, float]:
    client = connect(redis_url)
    ns = Namespace(f"bench-{uuid.uuid4().hex[:10]}", BLOCK_SIZE)
    try:
        log(f"[index] lookups and writes, {seconds:g}s each")
        return {
            "lookups_per_s_2_workers": lookup_rate(client, ns, 2, seconds),
            "lookups_per_s_4_workers": lookup_rate(client, ns, 4, seconds),
            "block_writes_per_s_1x12": write_rate(client, ns, 1, seconds),
            "block_writes_per_s_16x12": write_rate(client, ns, 16, seconds),
            "lookup_ms_128_blocks_64_workers": lookup_latency(client, ns, 128, 64),
            "admissions_per_s_redis": admission_rate(model, redis_url, seconds),
            "admissions_per_s_local": admission_rate(model, None, seconds),
            "admissions_per_s_redis_burst64": admission_rate(model, redis_url, seconds, 64),
            "admissions_per_s_local_burst64": admission_rate(model, None, seconds, 64),
            "admissions_per_s_one_plane_burst64": admission_rate(
                model, redis_url, seconds, 64, other_plane=False
            ),
        }
    finally:
        drop_namespace(client, ns)
        client.close()


# --- reporting ------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def table_rows(rr: ModeResult, px: ModeResult) -> list[tuple[str, str, str, str]]:
    def row(name: str, attr: str, digits: int = 1, show_ratio: bool = True):
        a, b = getattr(rr, attr), getattr(px, attr)
        return (name, fmt(a, digits), fmt(b, digits), ratio(b, a) if show_ratio else "")

    return [
        row("TTFT p50 (ms)", "ttft_p50_ms", 0),
        row("TTFT p90 (ms)", "ttft_p90_ms", 0),
        row("end-to-end p50 (ms)", "e2e_p50_ms", 0),
        row("output tokens/s", "output_tokens_per_s"),
        row("wall time (s)", "wall_s"),
        row("prefix hit rate (router, metrics)", "prefix_hit_rate", 3, False),
        row("prefix hit rate (schedulers)", "engine_hit_rate", 3, False),
        row("on the worker holding the prefix", "on_prefix_holder", 3, False),
        row("workers per group", "workers_per_group", 2, False),
        row("index lookup p50 (ms)", "lookup_p50_ms", 3, False),
        row("index lookup mean (ms)", "lookup_mean_ms", 3, False),
        row("step turnaround p50 (ms)", "turnaround_p50_ms", 3, False),
        row("step turnaround mean (ms)", "turnaround_mean_ms", 3, False),
        ("requests per worker", _per_worker(rr), _per_worker(px), ""),
        ("errors / resumed", f"{rr.errors} / {rr.resumed}", f"{px.errors} / {px.resumed}", ""),
    ]


def _per_worker(result: ModeResult) -> str:
    return "/".join(str(n) for n in result.requests_per_worker.values())


def same_outputs(rr: ModeResult, px: ModeResult) -> int:
    return sum(a == b and bool(a) for a, b in zip(rr.outputs, px.outputs, strict=True))


def print_report(args: argparse.Namespace, results: list[ModeResult], index: dict) -> None:
    rr, px = results
    n = rr.requests
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; model {args.model}, "
        f"{args.workers} workers x 1 thread, {args.num_blocks} KV blocks of {BLOCK_SIZE}"
    )
    print(
        f"workload: {args.groups} groups x {args.users} users x {args.questions} questions = "
        f"{n} requests, {args.system_tokens}-token system prompts, ~{QUESTION_TOKENS}-token "
        f"questions, Poisson {args.rate:g} req/s, {args.max_tokens} tokens each, seed "
        f"{args.seed}"
    )
    print()
    print(f"{'metric':<36} {'round-robin':>12} {'prefix':>12} {'prefix/rr':>10}")
    for name, a, b, r in table_rows(rr, px):
        print(f"{name:<36} {a:>12} {b:>12} {r:>10}")
    print()
    print(f"greedy outputs identical in both modes: {same_outputs(rr, px)}/{n}")
    print_index(index)
    print(
        f"summary: prefix/round-robin TTFT p50 {ratio(px.ttft_p50_ms, rr.ttft_p50_ms)}, "
        f"p90 {ratio(px.ttft_p90_ms, rr.ttft_p90_ms)}, throughput "
        f"{ratio(px.output_tokens_per_s, rr.output_tokens_per_s)}; prefix hit rate "
        f"{rr.prefix_hit_rate:.2f} -> {px.prefix_hit_rate:.2f}"
    )


def print_index(index: dict) -> None:
    print(
        f"index alone: longest_prefix {index['lookups_per_s_2_workers']:,.0f} lookups/s "
        f"(2 workers), {index['lookups_per_s_4_workers']:,.0f} (4 workers); apply "
        f"{index['block_writes_per_s_1x12']:,.0f} block writes/s (1 x 12 blocks per batch), "
        f"{index['block_writes_per_s_16x12']:,.0f} (16 x 12)"
    )
    print(
        f"longest_prefix of a 128-block prompt held by 64 workers: "
        f"{index['lookup_ms_128_blocks_64_workers']:.2f} ms (median)"
    )
    print(
        f"control-plane admission (512-token prompts), one per loop pass: "
        f"{index['admissions_per_s_redis']:,.0f} requests/s routing through Redis, "
        f"{index['admissions_per_s_local']:,.0f} without it; in bursts of 64 (one index round "
        f"trip each): {index['admissions_per_s_redis_burst64']:,.0f} and "
        f"{index['admissions_per_s_local_burst64']:,.0f}"
    )


def json_report(args: argparse.Namespace, results: list[ModeResult], index: dict) -> str:
    rr, px = results
    modes = {
        r.routing: {k: v for k, v in dataclasses.asdict(r).items() if k != "outputs"}
        for r in results
    }
    return json.dumps(
        {
            "config": vars(args),
            "modes": modes,
            "ratios": {
                "ttft_p50": px.ttft_p50_ms / rr.ttft_p50_ms,
                "ttft_p90": px.ttft_p90_ms / rr.ttft_p90_ms,
                "output_tokens_per_s": px.output_tokens_per_s / rr.output_tokens_per_s,
            },
            "identical_outputs": same_outputs(rr, px),
            "index": index,
        },
        indent=2,
    )


# --- main -----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--questions", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=192)
    # 2 req/s sits between the two modes' capacity on a 2-core CPU box with the defaults (about
    # 1.5 req/s with round-robin, 2.6 with prefix routing): both busy, neither hopelessly behind.
    p.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--model", default="smollm2-135m", help="bundled name or HF checkpoint dir")
    p.add_argument("--num-blocks", type=int, help="KV blocks per worker (default: see code)")
    p.add_argument("--redis-url", help="default: a private redis-server for this run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--index-seconds", type=float, default=2.0)
    p.add_argument("--quick", action="store_true", help="a small run (about a minute)")
    p.add_argument("--index-only", action="store_true", help="part 2 only: index and admission")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument(
        "--curve", action="store_true", help="prefix routing without and with CURVE keys"
    )
    p.add_argument("--repeat", type=int, default=3, help="interleaved pairs with --curve")
    args = p.parse_args()
    if args.quick:
        args.users, args.questions, args.max_tokens = 2, 1, 8
        args.index_seconds = 0.5
    if args.num_blocks is None:
        args.num_blocks = default_num_blocks(args)
    return args


def curve_bench(args: argparse.Namespace, redis_url: str, jobs: list[Job], logdir: Path) -> None:
    """Prefix routing without and with CURVE, interleaved, each --repeat times; medians."""
    keys = str(logdir / "keys")
    generate_keys(keys)
    runs: dict[bool, list[ModeResult]] = {False: [], True: []}
    for _ in range(args.repeat):
        for curve in (False, True):
            runs[curve].append(
                run_mode("prefix", args, redis_url, jobs, logdir, keys if curve else None)
            )
    plain, curve = runs[False], runs[True]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; "
        f"model {args.model}, {args.workers} workers x 1 thread; {plain[0].requests} requests "
        f"at {args.rate:g}/s, {args.max_tokens} tokens each; {args.repeat} interleaved pairs"
    )
    print(f"{'metric (median of runs)':<28} {'plain':>10} {'curve':>10} {'curve/plain':>12}")
    for name, attr in [
        ("TTFT p50 (ms)", "ttft_p50_ms"),
        ("inter-token p50 (ms)", "itl_p50_ms"),
        ("output tokens/s", "output_tokens_per_s"),
    ]:
        a = statistics.median(getattr(r, attr) for r in plain)
        b = statistics.median(getattr(r, attr) for r in curve)
        print(f"{name:<28} {a:>10.2f} {b:>10.2f} {b / a:>12.3f}")
    for name, attr in [("per run, tokens/s", "output_tokens_per_s")]:
        print(f"{name}: plain {[round(getattr(r, attr), 1) for r in plain]}, "
              f"curve {[round(getattr(r, attr), 1) for r in curve]}")  # fmt: skip
    same = all(a.outputs == b.outputs for a, b in zip(plain, curve, strict=True))
    errors = sum(r.errors for r in plain + curve)
    print(f"greedy outputs identical with and without CURVE: {same}; errors: {errors}")


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the finally blocks stop every child."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def main() -> None:
    args = parse_args()
    _exit_on_sigterm()
    configure_logging("warning")
    jobs = build_workload(args)
    if args.num_blocks - 1 >= args.groups * (args.system_tokens // BLOCK_SIZE):
        log("note: each worker's KV cache holds every system prompt; round-robin need not evict")
    with redis_server(args.redis_url) as redis_url, tempfile.TemporaryDirectory() as logdir:
        if args.curve:
            curve_bench(args, redis_url, jobs, Path(logdir))
            return
        results = []
        if not args.index_only:
            results = [run_mode(mode, args, redis_url, jobs, Path(logdir)) for mode in MODES]
        index = index_bench(redis_url, args.model, args.index_seconds)
    if args.json:
        print(json_report(args, results, index) if results else json.dumps({"index": index}))
    elif results:
        print_report(args, results, index)
    else:
        print_index(index)


if __name__ == "__main__":
    if "--http" in sys.argv[1:]:  # the HTTP API against vLLM: bench/http_api.py
        import http_api

        sys.exit(http_api.main([a for a in sys.argv[1:] if a != "--http"]))
    if "--failover" in sys.argv[1:]:  # kill -9 of a control plane under load: bench/failover.py
        import failover

        sys.exit(failover.main([a for a in sys.argv[1:] if a != "--failover"]))
    main()
