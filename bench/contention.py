"""Decode throughput when another process takes a core: how a worker's threads wait matters.

Usage: .venv/bin/python bench/contention.py [--repeat 2] [--max-tokens 64] [--peer vllm]

Each configuration decodes the bundled SmolLM2-135M (float32) in its own process, batch 1 and
batch 16 (32-token prompts, greedy), once on a quiet machine and once while a busy-looping
process holds one core, `--repeat` times, interleaved. Configurations:

- `worker`: what a specserve worker runs with: one thread per usable core, OpenMP threads spin
  briefly (GOMP_SPINCOUNT=1000, `shared/cpus.py`);
- `torch default`: the same threads with torch's default OpenMP waiting (long spins);
- `1 thread`: a single thread (what a worker gets when it shares the machine with another).

The table gives the best run of each cell and the slowdown under load (quiet / loaded).

`--peer vllm` measures the served engines instead, over HTTP with one driver (bench/http_api.py):
`specserve up` (one worker) and vLLM's CPU server (`.venv-peer`, `bash scripts/setup_peer.sh`)
on the same float32 weights, each alone, streaming chat completions of ShareGPT prompts at
concurrency 1 and 16, quiet and with the busy process, and prints each engine's slowdown.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    "worker": ({"GOMP_SPINCOUNT": "1000"}, None),
    "torch default": ({}, None),
    "1 thread": ({"GOMP_SPINCOUNT": "1000"}, 1),
}

MEASURE = r"""
import sys, time, torch
from specserve.llm import LLM
from specserve.shared.logging import configure_logging
from specserve.shared.protocol import SamplingParams
threads, max_tokens = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
configure_logging("warning")
llm = LLM("smollm2-135m", max_model_len=512, num_blocks=256)
params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
prompt = list(range(100, 132))
llm.generate([prompt], params)
out = []
for batch in (1, 16):
    prompts = [[100 + i] + prompt for i in range(batch)]
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        llm.generate(prompts, params)
        best = max(best, batch * max_tokens / (time.perf_counter() - start))
    out.append(best)
print(*out)
"""


def measure(env: dict[str, str], threads: int, max_tokens: int) -> tuple[float, float]:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(threads), str(max_tokens)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    b1, b16 = map(float, run.stdout.split()[-2:])
    return b1, b16


@contextlib.contextmanager
def busy_core(loaded: bool):
    """A process that spins on one core for the duration (nothing when not `loaded`)."""
    if not loaded:
        yield
        return
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(1.0)
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


def served(args: argparse.Namespace) -> None:
    """specserve and vLLM served over HTTP, quiet and loaded, concurrency 1 and 16."""
    import http_api
    from http_api import free_port, http_load, peer_model_dir, server, sharegpt_prompts

    from specserve.shared.tokenizer import load_tokenizer

    model = peer_model_dir()
    prompts = sharegpt_prompts(load_tokenizer(str(model)), 64, 512)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine in ("specserve", "vllm"):
            port, api_port = free_port(), free_port()
            if engine == "specserve":
                argv, env = http_api.specserve_argv(model, port, api_port), dict(os.environ)
                url = f"http://127.0.0.1:{api_port}"
            else:
                argv, env = http_api.vllm_argv(model, port), http_api.vllm_env()
                url = f"http://127.0.0.1:{port}"
            with server(engine, argv, url, env, Path(tmp) / f"{engine}.log"):
                asyncio.run(http_load(url, prompts[:8], 4, 8, args.max_tokens))  # warm-up
                for concurrency in (1, 16):
                    got = {}
                    for loaded in (False, True):
                        with busy_core(loaded):
                            result = asyncio.run(
                                http_load(url, prompts, concurrency, 2 * concurrency + 8,
                                          args.max_tokens)
                            )  # fmt: skip
                        got[loaded] = result.output_tokens_per_s
                    rows.append((engine, concurrency, got[False], got[True]))
    print(f"{len(os.sched_getaffinity(0))} cores, load {os.getloadavg()[0]:.2f}; served over "
          f"HTTP, ShareGPT chat prompts, {args.max_tokens} tokens, temperature 1")  # fmt: skip
    print(f"{'engine':<10} {'streams':>7} {'quiet tok/s':>12} {'loaded tok/s':>13} {'slowdown':>9}")
    for engine, concurrency, quiet, loaded in rows:
        print(f"{engine:<10} {concurrency:>7} {quiet:>12.1f} {loaded:>13.1f} "
              f"{quiet / loaded:>8.2f}x")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--peer", choices=["vllm"], default=None)
    args = p.parse_args()
    if args.peer == "vllm":
        served(args)
        return
    cores = len(os.sched_getaffinity(0))
    best: dict[tuple[str, bool], list[float]] = {}
    loads = []
    for _ in range(args.repeat):
        for loaded in (False, True):
            with busy_core(loaded):
                for name, (env, threads) in CONFIGS.items():
                    got = measure(env, threads or cores, args.max_tokens)
                    old = best.get((name, loaded), [0.0, 0.0])
                    best[(name, loaded)] = [max(a, b) for a, b in zip(old, got, strict=True)]
                    loads.append(os.getloadavg()[0])
    print(
        f"{cores} cores; SmolLM2-135M float32, greedy, {args.max_tokens} tokens; best of "
        f"{args.repeat} interleaved rounds; load average seen {min(loads):.2f}-{max(loads):.2f}"
    )
    print(f"{'config':<14} {'batch':>5} {'quiet tok/s':>12} {'loaded tok/s':>13} {'slowdown':>9}")
    for name in CONFIGS:
        for i, batch in enumerate((1, 16)):
            quiet, loaded = best[(name, False)][i], best[(name, True)][i]
            print(f"{name:<14} {batch:>5} {quiet:>12.1f} {loaded:>13.1f} {quiet / loaded:>8.2f}x")


if __name__ == "__main__":
    main()
