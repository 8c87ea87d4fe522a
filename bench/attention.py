"""Multi-row attention on CPU: the paged kernel beside PyTorch's SDPA, alone and in a prefill.

    .venv/bin/python bench/attention.py [--dtype float32|bfloat16] [--lengths 40,128,256,512,1024]
        [--rounds 4] [--prompts 64]

Two parts, each timing both paths in alternation:

- `kernel`: one causal prompt of each length over SmolLM2's heads (9 query heads, 3 KV heads,
  head dim 64), pages scattered in a cache of 16-token blocks. `paged` is
  `kernels.paged_prefill_attention`; `sdpa` is what the torch backend runs without it, the
  pages gathered (`index_select`) and then SDPA's causal flash kernel; `sdpa alone` times the
  flash kernel on keys already gathered. GFLOP/s count the visible (causal) half. Where the
  kernel runs bfloat16 on AMX tiles, `no tiles` times it built without them (its vector body).
- `prefill`: the bundled SmolLM2-135M-Instruct prefilling `--prompts` ShareGPT first turns
  (one output token, prefix caching off) in one `LLM`, with the kernel and with SDPA (the torch
  backend's `multi_row_kernel`), interleaved over `--rounds`: prompt tokens/s.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import cpu_model

from specserve.worker.cpu import kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def best_of(fn: Callable[[], object], seconds: float = 0.3) -> float:
    fn()
    best, spent = float("inf"), 0.0
    while spent < seconds:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return best


def library_without_tiles(tmp: Path) -> ctypes.CDLL:
    """The kernel library built without AMX (`-mno-amx-tile`): the multi-row kernel's vector
    body on a CPU whose tiles the usual build uses."""
    target = tmp / "specserve_kernels-no-tiles.so"
    kernels._compile(kernels._compiler(), tmp, target, (*kernels.COMPILE_FLAGS, "-mno-amx-tile"))
    return kernels.open_library(target)


def with_library(lib: ctypes.CDLL, fn: Callable[[], object]) -> Callable[[], None]:
    """`fn` run with `lib` as the kernels' library."""

    def run() -> None:
        usual = kernels.load
        kernels.load = lambda: lib
        try:
            fn()
        finally:
            kernels.load = usual

    return run


def time_length(dtype: torch.dtype, rows: int, no_tiles: ctypes.CDLL | None) -> dict[str, float]:
    """Best seconds of each path for one causal prompt of `rows` rows."""
    scale = 1 / math.sqrt(HEAD_DIM)
    num_pages = -(-rows // BLOCK)
    cache = torch.randn(2 * num_pages + 4, 2, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    k_pages = torch.randperm(cache.shape[0])[:num_pages] * 2
    query = torch.randn(rows, HEADS, HEAD_DIM).to(dtype)
    table = torch.tensor([[0, rows, 0, 0, rows, 1, 0, num_pages]])
    out = torch.empty_like(query)
    pages = cache.view(-1, cache[0, 0].numel())
    q = query[None].transpose(1, 2)

    def gather() -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, -1, KV_HEADS, HEAD_DIM)
        k = pages.index_select(0, k_pages).view(shape)[:, :rows].transpose(1, 2)
        v = pages.index_select(0, k_pages + 1).view(shape)[:, :rows].transpose(1, 2)
        return k, v

    def flash(k: torch.Tensor, v: torch.Tensor) -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    gathered = gather()
    paths = {
        "paged": lambda: kernels.paged_prefill_attention(
            query, cache, table, k_pages, None, scale, out
        ),
        "sdpa": lambda: flash(*gather()),
        "alone": lambda: flash(*gathered),
    }
    if no_tiles is not None:
        paths["no tiles"] = with_library(no_tiles, paths["paged"])
    times: dict[str, float] = dict.fromkeys(paths, float("inf"))
    for _ in range(3):
        for name, fn in paths.items():
            times[name] = min(times[name], best_of(fn))
    return times


def kernel_rows(dtype: torch.dtype, lengths: list[int]) -> None:
    no_tiles = None
    with tempfile.TemporaryDirectory() as tmp:
        if kernels.prefill_on_tiles(HEAD_DIM, dtype):
            no_tiles = library_without_tiles(Path(tmp))
        extra = " no tiles ms |" if no_tiles else ""
        print(
            f"| prompt rows | paged ms | sdpa ms | sdpa alone ms |{extra} paged GFLOP/s | vs sdpa |"
        )
        print("|---:|---:|---:|---:|---:|---:|" + ("---:|" if no_tiles else ""))
        for rows in lengths:
            t = time_length(dtype, rows, no_tiles)
            flops = 4 * HEAD_DIM * HEADS * rows * (rows + 1) / 2
            vector = f" {t['no tiles'] * 1e3:.3f} |" if no_tiles else ""
            print(
                f"| {rows} | {t['paged'] * 1e3:.3f} | {t['sdpa'] * 1e3:.3f} | "
                f"{t['alone'] * 1e3:.3f} |{vector} {flops / t['paged'] / 1e9:.0f} | "
                f"{t['sdpa'] / t['paged']:.2f}x |"
            )


def prefill_rows(dtype: str, prompts_count: int, rounds: int) -> None:
    from http_api import peer_model_dir

    from specserve.llm import LLM
    from specserve.shared.logging import configure_logging
    from specserve.shared.protocol import SamplingParams
    from specserve.shared.tokenizer import load_tokenizer
    from specserve.training.corpus import read_sharegpt
    from specserve.training.evaluate import first_turn_prompts

    configure_logging("warning")
    model = peer_model_dir()
    prompts = first_turn_prompts(load_tokenizer(str(model)), read_sharegpt(), prompts_count, 512)
    llm = LLM(str(model), dtype=dtype, enable_prefix_caching=False, kv_cache_memory_mb=4096,
              max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=2048)  # fmt: skip
    backend = llm.engine.runner.model.backend
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    tokens = sum(map(len, prompts))
    llm.generate(prompts[:4], params)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for use_kernel in rates:
            backend.multi_row_kernel = use_kernel
            start = time.perf_counter()
            llm.generate(prompts, params)
            rates[use_kernel].append(tokens / (time.perf_counter() - start))
    paged, sdpa = (statistics.median(rates[k]) for k in (True, False))
    print(f"\nprefill of {len(prompts)} ShareGPT prompts ({tokens} tokens), {rounds} rounds:")
    print(f"paged kernel {paged:.1f} prompt tok/s ({', '.join(f'{r:.0f}' for r in rates[True])})")
    print(f"sdpa         {sdpa:.1f} prompt tok/s ({', '.join(f'{r:.0f}' for r in rates[False])})")
    print(f"ratio        {paged / sdpa:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--lengths", default="40,128,256,512,1024")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--skip-prefill", action="store_true")
    args = p.parse_args()
    if not kernels.prefill_available():
        raise SystemExit("the multi-row kernel does not run here (no library or no AVX-512)")
    print(
        f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores, {torch.get_num_threads()} "
        f"threads, {args.dtype}, load average {os.getloadavg()[0]:.2f}"
    )
    kernel_rows(getattr(torch, args.dtype), [int(n) for n in args.lengths.split(",")])
    if not args.skip_prefill:
        prefill_rows(args.dtype, args.prompts, args.rounds)


if __name__ == "__main__":
    main()
