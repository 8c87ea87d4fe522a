"""Decode attention on CPU as a 64-request step meets it: the keys come from memory.

    .venv/bin/python bench/decode_attention.py [--dtype float32|bfloat16] [--batch 64]
        [--layers 30] [--order random|sequential] [--rounds 20] [--against REV]

`kernels.paged_decode_attention` over `--layers` caches of their own (SmolLM2's 9 query and 3
KV heads of 64, 16-token blocks), one query per request, each request 100-300 keys long, its
pages in random order across the cache or one after another. Every layer's K/V is read once a
round, so they come from memory as in a decode step, where the weights streamed between two
layers push them out of the caches (timing one layer over and over measures the caches
instead); the caches are placed as the engine places its own (`zeros_in_huge_pages`: 2 MiB
pages where the system grants them). Prints ms per round (all layers) and the K/V bytes read
per second.

`--against REV` also builds the kernel library from git revision REV's C sources and alternates
the two round by round (the order reversed every other round), checking their outputs agree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from attention import with_library
from machine import cpu_model

from specserve.worker.cpu import kernels
from specserve.worker.memory import zeros_in_huge_pages

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def library_at(rev: str, tmp: Path) -> object:
    """The kernel library built from revision `rev`'s `worker/cpu/csrc`."""
    src = tmp / "csrc"
    src.mkdir()
    repo = Path(__file__).resolve().parents[1]
    listing = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{rev}:worker/cpu/csrc"],
        cwd=repo, check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    for name in listing:
        blob = subprocess.run(
            ["git", "show", f"{rev}:worker/cpu/csrc/{name}"], cwd=repo, check=True,
            capture_output=True,
        ).stdout  # fmt: skip
        (src / name).write_bytes(blob)
    target = tmp / "specserve_kernels-against.so"
    kernels._compile(kernels._compiler(), tmp, target, sources=sorted(src.glob("*.c")))
    return kernels.open_library(target)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--order", default="random", choices=["random", "sequential"])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--against", help="a git revision whose kernels to alternate with")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(100, 301, (args.batch,), generator=gen)
    pages_per_request = int((seq_lens.max() + BLOCK - 1) // BLOCK)
    num_blocks = args.batch * pages_per_request
    layers = []
    for _ in range(args.layers):
        shape = (num_blocks, 2, BLOCK, KV_HEADS, HEAD_DIM)
        cache = zeros_in_huge_pages(shape, dtype)  # as the engine places its caches
        cache.copy_(torch.randn(shape, generator=gen))
        blocks = torch.randperm(num_blocks, generator=gen)
        if args.order == "sequential":
            blocks = torch.arange(num_blocks)
        k_pages = (blocks.view(args.batch, pages_per_request) * 2).contiguous()
        query = torch.randn(args.batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
        layers.append((query, cache, k_pages))
    if not kernels.attention_supported(layers[0][0], layers[0][1]):
        raise SystemExit("the decode attention kernel does not run here")
    first = torch.zeros(args.batch, dtype=torch.int64)
    scale = HEAD_DIM**-0.5
    outputs: dict[str, list[torch.Tensor]] = {}

    def step(name: str) -> None:
        outputs[name] = [
            kernels.paged_decode_attention(q, cache, pages, first, seq_lens, None, scale)
            for q, cache, pages in layers
        ]

    engines = {"current": lambda: step("current")}
    with tempfile.TemporaryDirectory() as tmp:
        if args.against:
            engines[args.against] = with_library(
                library_at(args.against, Path(tmp)), lambda: step(args.against)
            )
        times: dict[str, list[float]] = {name: [] for name in engines}
        for run in engines.values():
            run()  # warm-up
        for r in range(args.rounds):
            for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                start = time.perf_counter()
                engines[name]()
                times[name].append(time.perf_counter() - start)
    kv_bytes = int(seq_lens.sum()) * KV_HEADS * HEAD_DIM * 2 * layers[0][1].element_size()
    kv_bytes *= args.layers
    print(
        f"{cpu_model()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}; "
        f"{args.dtype}, {args.batch} requests x 100-300 keys, {args.layers} layers "
        f"({kv_bytes / 1e6:.0f} MB of K/V a round), pages {args.order}, {args.rounds} rounds"
    )
    for name, taken in times.items():
        median = statistics.median(taken)
        print(
            f"{name:>10}: median {median * 1e3:.2f} ms a round ({kv_bytes / median / 1e9:.1f} "
            f"GB/s), best {min(taken) * 1e3:.2f} ms"
        )
    if args.against:
        worst = max(
            (a.float() - b.float()).abs().max().item()
            for a, b in zip(outputs["current"], outputs[args.against], strict=True)
        )
        print(f"largest difference between the two outputs: {worst:.2e}")


if __name__ == "__main__":
    main()
