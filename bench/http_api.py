"""The HTTP API under load: specserve's OpenAI endpoint and `vllm serve`, driven by guidellm (the
load generator vLLM's project ships) on ShareGPT prompts, and specserve's ZeroMQ SDK on the same
prompts, at several concurrencies, in one run.

Usage: .venv/bin/python bench/service.py --http [--concurrency 1,8,32] [--max-tokens 64]
    [--rounds 2] [--no-peer]

Needs `bash scripts/setup_peer.sh` (vLLM's CPU build and guidellm in .venv-peer). Both servers
load the same weights: the bundled SmolLM2-135M-Instruct, dequantized once into a Hugging Face
directory (float32), with the same limits (max_model_len 2048, 64 sequences, 2048 batched
tokens, prefix caching on). Every request is a ShareGPT first user turn as a chat message,
`max_tokens` output tokens with EOS ignored, temperature 1 (both servers' default).

Every measured request is cold: each concurrency has its own prompts (max(16, 2c) of them),
and a warm-up on 8 other prompts precedes the runs. Per round, each server runs alone: specserve
three times, fresh each time (guidellm over HTTP; the bench's driver over the ZeroMQ SDK; the
same driver over HTTP with aiohttp, the client library of vLLM's own serving benchmark, which
isolates what the HTTP layer costs), then vLLM under guidellm. Rounds repeat all of it, so the
machine's drift reaches every engine; the table shows the median over rounds.

On two cores the load generator's CPU competes with the server's, so the table also gives the CPU
each output token cost the load generator (the driver, or guidellm's process) and specserve's
HTTP API process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
from service import percentile

from specserve.client import AsyncClient, SamplingParams
from specserve.launch.local_redis import free_port
from specserve.shared.paths import cache_root
from specserve.shared.tokenizer import Tokenizer
from specserve.training.corpus import read_sharegpt

ROOT = Path(__file__).resolve().parent.parent
PEER_BIN = ROOT / ".venv-peer" / "bin"
LIMITS = {"max-model-len": "2048", "max-num-seqs": "64", "max-num-batched-tokens": "2048"}
READY_TIMEOUT_S = 600.0
WARMUP_REQUESTS = 8


def log(msg: str) -> None:
    print(f"[http-bench] {msg}", file=sys.stderr, flush=True)


# --- the workload ----------------------------------------------------------------------------


def peer_model_dir() -> Path:
    """The bundled model as a Hugging Face directory (float32 safetensors + tokenizer), made
    once: the one format both servers load."""
    path = cache_root() / "peer-models" / "smollm2-135m-f32"
    if (path / "model.safetensors").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.shared.gguf_metadata import find_bundled_gguf

    gguf = find_bundled_gguf()
    log(f"dequantizing {gguf.name} into {path}")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    model.hf_quantizer = None  # the weights are plain float32 tensors now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = path.with_suffix(".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(path)
    return path


def sharegpt_prompts(tokenizer: Tokenizer, count: int, max_prompt_tokens: int) -> list[str]:
    """First user turns of ShareGPT chats, in file order, whose chat prompt fits."""
    prompts = []
    for chat in read_sharegpt():
        text = next(t for role, t in chat.turns if role == "user")
        if len(tokenizer.encode_prompt(text, chat=True)) <= max_prompt_tokens:
            prompts.append(text)
        if len(prompts) == count:
            break
    return prompts


@dataclass
class Result:
    engine: str
    concurrency: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    output_tokens_per_s: float
    requests: int  # that finished (the percentiles cover these only)
    asked: int  # sent
    client_us_per_token: float | None = None  # the load generator's CPU per output token
    api_us_per_token: float | None = None  # specserve's HTTP API process's


# --- servers ---------------------------------------------------------------------------------


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not ready within {READY_TIMEOUT_S:.0f} s")


@contextmanager
def server(
    name: str, argv: list[str], url: str, env: dict[str, str], log_path: Path
) -> Iterator[None]:
    started = time.monotonic()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(url, proc)
        log(f"{name} ready in {time.monotonic() - started:.0f} s")
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def specserve_argv(model: Path, port: int, api_port: int) -> list[str]:
    limits = [x for k, v in LIMITS.items() for x in (f"--{k}", v)]
    return [
        sys.executable, "-m", "specserve.cli", "--log-level", "warning", "up", "--model",
        str(model), "--port", str(port), "--api-port", str(api_port), "--insecure",
        "--served-model-name", "smollm2", *limits,
    ]  # fmt: skip


def vllm_argv(model: Path, port: int) -> list[str]:
    limits = [x for k, v in LIMITS.items() for x in (f"--{k}", v)]
    return [
        # (the `vllm` command looks up the "vllm" distribution, which the CPU build is not named)
        str(PEER_BIN / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
        str(model), "--port", str(port), "--dtype", "float32",
        "--served-model-name", "smollm2", "--enable-prefix-caching", *limits,
    ]  # fmt: skip


def vllm_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND="0-1",
        OMP_NUM_THREADS="2",
    )  # fmt: skip
    return env


# --- load --------------------------------------------------------------------------------------


def guidellm(url: str, model: Path, data: Path, concurrency: int, requests: int) -> Result:
    """One guidellm run: `requests` requests, `concurrency` streams, against `url`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        argv = [
            str(PEER_BIN / "guidellm"), "run",
            "--backend", f"kind=openai_http,target={url},model=smollm2",
            "--profile", f"kind=concurrent,streams={concurrency}",
            "--data", f"kind=json_file,path={data}",
            "--constraint", f"kind=max_requests,count={requests}",
            "--tokenizer", f"kind=huggingface_auto,model={model}",
            "--output", f"kind=json,path={out}", "--disable-console",
        ]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp, env=vllm_env())
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"guidellm failed ({done.returncode}): {done.stderr[-2000:]}")
        bench = json.loads(out.read_text())["benchmarks"][0]
    metrics = bench["metrics"]

    def pct(name: str, p: str) -> float:
        return metrics[name]["successful"]["percentiles"][p]

    tokens = metrics["output_token_count"]["successful"]["total_sum"]
    count = metrics["request_totals"]["successful"]
    return Result(
        "", concurrency, pct("time_to_first_token_ms", "p50"), pct("time_to_first_token_ms", "p99"),
        pct("inter_token_latency_ms", "p50"), pct("inter_token_latency_ms", "p99"),
        tokens / bench["duration"], count, requests,
    )  # fmt: skip


# A request's token arrivals: (seconds since it was sent, tokens that arrived then).
Arrivals = AsyncIterator[tuple[float, int]]


async def closed_loop(concurrency: int, requests: int, send: Callable[[int], Arrivals]) -> Result:
    """`concurrency` workers, each sending request `i` as soon as its previous one ended, timed
    the way guidellm times them: TTFT to the first token, ITL between later arrivals (split
    evenly over the tokens of one arrival), output tokens per second over the whole run."""
    ttfts: list[float] = []
    itls: list[float] = []
    tokens = 0
    queue = list(range(requests))

    async def worker() -> None:
        nonlocal tokens
        while queue:
            last = None
            async for at, n in send(queue.pop()):
                if last is None:
                    ttfts.append(at * 1000)
                else:
                    itls.extend([(at - last) * 1000 / n] * n)
                last = at
                tokens += n

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    return Result(
        "", concurrency, percentile(ttfts, 0.5), percentile(ttfts, 0.99),
        percentile(itls, 0.5), percentile(itls, 0.99), tokens / seconds, len(ttfts), requests,
    )  # fmt: skip


async def sdk_load(
    url: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int
) -> Result:
    """The load through the ZeroMQ SDK: each request a chat message, streamed."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    async with AsyncClient(url, timeout=600) as client:

        async def send(i: int) -> Arrivals:
            messages = [{"role": "user", "content": prompts[i % len(prompts)]}]
            sent = time.perf_counter()
            async for out in client.stream(messages, params):
                if out.token_ids:
                    yield time.perf_counter() - sent, len(out.token_ids)

        return await closed_loop(concurrency, requests, send)


async def http_load(
    api: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int
) -> Result:
    """The same load through the HTTP API with the same driver (server-sent events read with
    aiohttp, whose C parser costs the driver less per token than the SDK; httpx's pure-Python
    one cost it 2.5x more, which on two cores showed up as the server's latency), so that what
    the HTTP layer adds is measured apart from the client that drives it."""
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(api, connector=connector, timeout=timeout) as session:

        async def send(i: int) -> Arrivals:
            body = {
                "model": "smollm2", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
            }  # fmt: skip
            sent = time.perf_counter()
            async with session.post("/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.content:
                    if _has_content(line):
                        yield time.perf_counter() - sent, 1

        return await closed_loop(concurrency, requests, send)


def _has_content(line: bytes) -> bool:
    """A chunk with new text (not the opening role chunk, the finish chunk or [DONE])."""
    if not line.startswith(b"data: {") or b'"content"' not in line:
        return False
    choices = json.loads(line[6:])["choices"]
    return bool(choices and choices[0]["delta"].get("content"))


# --- CPU per token -----------------------------------------------------------------------------


def own_cpu_s() -> float:
    """This process's CPU time and its finished children's (guidellm runs as one)."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def process_cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def api_pid(log_path: Path) -> int | None:
    """The HTTP API process of a `specserve up`, from its log ("started api (pid N)")."""
    found = re.search(r"started api \(pid (\d+)\)", log_path.read_text())
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class CpuMark:
    """CPU times before a run: the load generator's and (if any) the API process's."""

    api: int | None
    client_s: float
    api_s: float

    @classmethod
    def now(cls, api: int | None) -> CpuMark:
        return cls(api, own_cpu_s(), process_cpu_s(api))

    def charge(self, result: Result, max_tokens: int) -> None:
        """Fill in what each output token of the run cost since this mark."""
        tokens = max(1, result.requests * max_tokens)  # EOS is ignored: each finished one's all
        result.client_us_per_token = (own_cpu_s() - self.client_s) * 1e6 / tokens
        if self.api is not None:
            result.api_us_per_token = (process_cpu_s(self.api) - self.api_s) * 1e6 / tokens


# --- the run ---------------------------------------------------------------------------------


def requests_at(concurrency: int) -> int:
    return max(16, 2 * concurrency)


@dataclass(frozen=True)
class Workload:
    """Disjoint ShareGPT prompts: a warm-up set and one set per concurrency, so that every
    measured request arrives cold (its prompt in no cache) on every engine and mode."""

    warmup: list[str]
    by_concurrency: dict[int, list[str]]
    files: dict[int | str, Path]  # guidellm's JSONL for each set ("warmup" and each c)


def make_workload(prompts: list[str], concurrencies: list[int], max_tokens: int, tmp: Path):
    warmup, rest = prompts[:WARMUP_REQUESTS], prompts[WARMUP_REQUESTS:]
    sets: dict[int | str, list[str]] = {"warmup": warmup}
    for c in concurrencies:
        n = requests_at(c)
        if len(rest) < n:
            raise SystemExit(f"not enough ShareGPT prompts for concurrency {c}")
        sets[c], rest = rest[:n], rest[n:]
    files = {}
    for key, texts in sets.items():
        files[key] = tmp / f"sharegpt-{key}.jsonl"
        with open(files[key], "w") as f:
            for text in texts:
                f.write(json.dumps({"prompt": text, "output_tokens_count": max_tokens}) + "\n")
    return Workload(warmup, {c: sets[c] for c in concurrencies}, files)  # type: ignore[misc]


MODES = ("specserve http", "specserve zmq sdk", "specserve http driver")


def run_round(args: argparse.Namespace, model: Path, work: Workload, logs: Path) -> list[Result]:
    """specserve in each mode (a fresh server per mode: cold caches), then vLLM."""
    results: list[Result] = []
    for mode in args.modes:
        port, api_port = free_port(), free_port()
        api = f"http://127.0.0.1:{api_port}"
        argv = specserve_argv(model, port, api_port)
        with server("specserve", argv, api, dict(os.environ), logs / "specserve.log"):
            asyncio.run(http_load(api, work.warmup, 4, len(work.warmup), args.max_tokens))
            pid = api_pid(logs / "specserve.log")
            for c in args.concurrency:
                prompts, n = work.by_concurrency[c], requests_at(c)
                mark = CpuMark.now(None if mode == "specserve zmq sdk" else pid)
                if mode == "specserve http":
                    r = guidellm(api, model, work.files[c], c, n)
                elif mode == "specserve zmq sdk":
                    url = f"tcp://127.0.0.1:{port}"
                    r = asyncio.run(sdk_load(url, prompts, c, n, args.max_tokens))
                else:
                    r = asyncio.run(http_load(api, prompts, c, n, args.max_tokens))
                mark.charge(r, args.max_tokens)
                r.engine = mode
                results.append(r)
                log(f"{mode} c={c}: {r}")
    if args.no_peer:
        return results
    vport = free_port()
    url = f"http://127.0.0.1:{vport}"
    log("vllm: starting (it compiles its model first: a minute or two)")
    with server("vllm", vllm_argv(model, vport), url, vllm_env(), logs / "vllm.log"):
        guidellm(url, model, work.files["warmup"], 4, WARMUP_REQUESTS)
        for c in args.concurrency:
            mark = CpuMark.now(None)
            r = guidellm(url, model, work.files[c], c, requests_at(c))
            mark.charge(r, args.max_tokens)
            r.engine = "vllm http"
            results.append(r)
            log(f"vllm http c={c}: {r}")
    return results


def print_table(rounds: list[list[Result]]) -> None:
    keys = sorted(
        {(r.engine, r.concurrency) for rs in rounds for r in rs}, key=lambda k: (k[1], k[0])
    )
    fields = ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tokens_per_s"]
    cpu_fields = ["client_us_per_token", "api_us_per_token"]
    med: dict[tuple[str, int], dict[str, float]] = {}
    finished: dict[tuple[str, int], tuple[int, int]] = {}  # fewest finished, most sent
    for key in keys:
        runs = [r for rs in rounds for r in rs if (r.engine, r.concurrency) == key]
        med[key] = {f: statistics.median(getattr(r, f) for r in runs) for f in fields}
        for f in cpu_fields:
            values = [getattr(r, f) for r in runs if getattr(r, f) is not None]
            med[key][f] = statistics.median(values) if values else math.nan
        finished[key] = min(r.requests for r in runs), max(r.asked for r in runs)
    header = ["concurrency", "engine", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
    cpu_header = ["load generator CPU us/tok", "API CPU us/tok"]
    print("| " + " | ".join([*header, "output tok/s", "finished", *cpu_header]) + " |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    short = []
    for c, engine in [(k[1], k[0]) for k in keys]:
        m = med[(engine, c)]
        cells = " | ".join(f"{m[f]:.1f}" for f in fields)
        done, asked = finished[(engine, c)]
        cpu = " | ".join("-" if math.isnan(m[f]) else f"{m[f]:.0f}" for f in cpu_fields)
        print(f"| {c} | {engine} | {cells} | {done}/{asked} | {cpu} |")
        if done < asked:
            short.append(f"{engine} at c={c}")
    print()
    if short:
        print(f"not every request finished ({', '.join(short)}): their percentiles leave it out")
    for c in sorted({k[1] for k in keys}):
        engines = ("specserve http", "specserve zmq sdk", "specserve http driver", "vllm http")
        http, sdk, driver, peer = (med.get((e, c)) for e in engines)
        line = f"c={c}:"
        if driver and sdk:
            ttft = driver["ttft_p50_ms"] / sdk["ttft_p50_ms"]
            itl = driver["itl_p50_ms"] - sdk["itl_p50_ms"]
            line += f" HTTP/SDK (same driver) TTFT p50 {ttft:.3f}x, ITL p50 {itl:+.2f} ms;"
        if http and peer:
            ttft = http["ttft_p99_ms"] / peer["ttft_p99_ms"]
            rate = http["output_tokens_per_s"] / peer["output_tokens_per_s"]
            line += (
                f" specserve/vLLM TTFT p99 {ttft:.3f}x (lower is better), throughput {rate:.3f}x"
            )
        print(line)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32]
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-peer", action="store_true", help="specserve only (no vLLM)")
    p.add_argument(
        "--modes",
        type=lambda s: s.split(","),
        default=list(MODES),
        help=f"specserve's rows, comma-separated from: {', '.join(MODES)}",
    )
    args = p.parse_args(argv)
    if unknown := set(args.modes) - set(MODES):
        p.error(f"unknown mode(s): {', '.join(sorted(unknown))}")
    if not (PEER_BIN / "guidellm").exists():
        print("error: run `bash scripts/setup_peer.sh` first (vLLM and guidellm)", file=sys.stderr)
        return 2
    model = peer_model_dir()
    tokenizer = Tokenizer.from_hf_dir(model)
    needed = WARMUP_REQUESTS + sum(requests_at(c) for c in args.concurrency)
    prompts = sharegpt_prompts(tokenizer, needed, args.max_prompt_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        work = make_workload(prompts, args.concurrency, args.max_tokens, Path(tmp))
        rounds = []
        for i in range(args.rounds):
            log(f"round {i + 1}/{args.rounds} (load {os.getloadavg()[0]:.2f})")
            rounds.append(run_round(args, model, work, Path(tmp)))
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}; median of {args.rounds} rounds\n")
    print_table(rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
