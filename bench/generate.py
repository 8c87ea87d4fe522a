"""SmolLM2-135M on CPU: prefill and decode throughput, specserve beside transformers.

Both run the same dequantized GGUF weights in the same dtype on the same threads, in the same
process:
    .venv/bin/python bench/generate.py [--quick] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from specserve.llm import LLM
from specserve.shared.gguf_metadata import find_bundled_gguf
from specserve.shared.logging import configure_logging
from specserve.shared.protocol import SamplingParams


def _time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `repeats` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40_000, (length,), generator=g).tolist() for _ in range(batch)]


def load_transformers(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    path = find_bundled_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.eval()


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> None:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


def ours_generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> None:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == new_tokens for o in outs)
    llm.engine.scheduler.kv.reset_prefix_cache()  # every repeat pays its full prefill


def decode_rate(run: Callable[[int], None], batch: int, new_tokens: int, repeats: int) -> float:
    """Decode tokens/s: (t(N new tokens) - t(1 new token)) removes the prefill."""
    full = _time(lambda: run(new_tokens), repeats)
    prefill_only = _time(lambda: run(1), repeats)
    return batch * (new_tokens - 1) / (full - prefill_only)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    configure_logging("warning")
    threads = torch.get_num_threads()
    repeats = 1 if args.quick else 3
    new_tokens = 16 if args.quick else 64
    prefill_len = 256 if args.quick else 512

    print("loading specserve (bundled SmolLM2-135M GGUF) ...", flush=True)
    llm = LLM("smollm2-135m", dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=4096)
    print("loading transformers from the same GGUF ...", flush=True)
    hf = load_transformers(getattr(torch, args.dtype))

    rows = []
    (prompt,) = _prompts(1, prefill_len, 0)
    print(f"prefill: 1 x {prefill_len} tokens ...", flush=True)
    ours = _time(lambda: ours_generate(llm, [prompt], 1), repeats)
    theirs = _time(lambda: hf_generate(hf, [prompt], 1), repeats)
    rows.append((f"prefill tokens/s (1 x {prefill_len})", prefill_len / ours, prefill_len / theirs))

    for batch in (1, 16):
        batch_prompts = _prompts(batch, 32, batch)
        print(f"decode: batch {batch}, {new_tokens} new tokens ...", flush=True)
        ours_rate = decode_rate(
            lambda n, p=batch_prompts: ours_generate(llm, p, n), batch, new_tokens, repeats
        )
        hf_rate = decode_rate(
            lambda n, p=batch_prompts: hf_generate(hf, p, n), batch, new_tokens, repeats
        )
        rows.append((f"decode tokens/s (batch {batch})", ours_rate, hf_rate))

    print()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__} with {threads} threads, {args.dtype}")  # fmt: skip
    print(f"{'metric':<30} {'specserve':>12} {'transformers':>14} {'ratio':>8}")
    for name, ours_value, hf_value in rows:
        print(f"{name:<30} {ours_value:>12.1f} {hf_value:>14.1f} {ours_value / hf_value:>7.2f}x")


if __name__ == "__main__":
    main()
