"""Decode throughput when another process takes a core: how a worker's threads wait matters.

Usage: .venv/bin/python bench/contention.py [--repeat 2] [--max-tokens 64]

Each configuration decodes the bundled SmolLM2-135M (float32) in its own process, batch 1 and
batch 16 (32-token prompts, greedy), once on a quiet machine and once while a busy-looping
process holds one core, `--repeat` times, interleaved. Configurations:

- `worker`: what a specserve worker runs with: one thread per usable core, OpenMP threads spin
  briefly (GOMP_SPINCOUNT=1000, `shared/cpus.py`);
- `torch default`: the same threads with torch's default OpenMP waiting (long spins);
- `1 thread`: a single thread (what a worker gets when it shares the machine with another).

The table gives the best run of each cell and the slowdown under load (quiet / loaded).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    best: dict[tuple[str, bool], list[float]] = {}
    loads = []
    for _ in range(args.repeat):
        for loaded in (False, True):
            busy = None
            if loaded:
                busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                time.sleep(1.0)
            try:
                for name, (env, threads) in CONFIGS.items():
                    got = measure(env, threads or cores, args.max_tokens)
                    old = best.get((name, loaded), [0.0, 0.0])
                    best[(name, loaded)] = [max(a, b) for a, b in zip(old, got, strict=True)]
                    loads.append(os.getloadavg()[0])
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
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
