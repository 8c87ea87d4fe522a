"""SmolLM2-135M on CPU: prefill and decode throughput, specserve beside transformers.

Both run the same dequantized GGUF weights in the same dtype on the same threads, in the same
process:
    .venv/bin/python bench/generate.py [--quick] [--dtype float32|bfloat16] [--long-context N]
        [--peer transformers|layers]

`--long-context N` adds a batch-16 decode row with N-token prompts, where attention over the
paged cache, rather than the weights, dominates a step. `--peer layers` measures specserve
against itself with the one-call decode step switched off (`worker/cpu/fused_decode.py`), so
every op of a decode step runs from Python, layer by layer.

The two engines are timed in alternation (ours, theirs, ours, ...), so a change in the
machine's speed during the run reaches both sides alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from machine import cpu_model

from specserve.llm import LLM
from specserve.shared.gguf_metadata import find_bundled_gguf
from specserve.shared.logging import configure_logging
from specserve.shared.protocol import SamplingParams
from specserve.worker.cpu import fused_decode

DECODE_PROMPT_LEN = 32  # tokens per prompt in the decode rows (without --long-context)


def _time_pair(
    ours: Callable[[], object], theirs: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Median wall times of `ours` and `theirs`, run in alternation after one warm-up each."""
    ours()
    theirs()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, bucket in ((ours, times[0]), (theirs, times[1])):
            start = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


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


@contextmanager
def layer_by_layer() -> Iterator[None]:
    """Decode steps run layer by layer from Python (the one-call decode step switched off)."""
    fused = fused_decode.decode_step
    fused_decode.decode_step = lambda *args, **kwargs: None
    try:
        yield
    finally:
        fused_decode.decode_step = fused


def layers_generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> None:
    with layer_by_layer():
        ours_generate(llm, prompts, new_tokens)


def decode_rates(
    ours: Callable[[int], None],
    theirs: Callable[[int], None],
    batch: int,
    new_tokens: int,
    repeats: int,
) -> tuple[float, float]:
    """Decode tokens/s of both: (t(N new tokens) - t(1 new token)) removes the prefill."""
    full = _time_pair(lambda: ours(new_tokens), lambda: theirs(new_tokens), repeats)
    prefill_only = _time_pair(lambda: ours(1), lambda: theirs(1), repeats)
    return tuple(  # type: ignore[return-value]
        batch * (new_tokens - 1) / (f - p) for f, p in zip(full, prefill_only, strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--long-context", type=int, default=0, metavar="N")
    parser.add_argument("--peer", default="transformers", choices=["transformers", "layers"])
    args = parser.parse_args()
    configure_logging("warning")
    threads = torch.get_num_threads()
    repeats = 1 if args.quick else 3
    new_tokens = 16 if args.quick else 64
    prefill_len = 256 if args.quick else 512

    print("loading specserve (bundled SmolLM2-135M GGUF) ...", flush=True)
    # Room for 16 long requests without preemption (the default budget holds ~11k tokens).
    num_blocks = 16 * -(-(args.long_context + new_tokens) // 16) + 64 if args.long_context else None
    llm = LLM(
        "smollm2-135m",
        dtype=args.dtype,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        num_blocks=num_blocks,
    )
    if args.peer == "transformers":
        print("loading transformers from the same GGUF ...", flush=True)
        hf = load_transformers(getattr(torch, args.dtype))

        def peer(prompts: list[list[int]], new_tokens: int) -> None:
            hf_generate(hf, prompts, new_tokens)
    else:

        def peer(prompts: list[list[int]], new_tokens: int) -> None:
            layers_generate(llm, prompts, new_tokens)

    rows = []
    (prompt,) = _prompts(1, prefill_len, 0)
    print(f"prefill: 1 x {prefill_len} tokens ...", flush=True)
    ours, theirs = _time_pair(
        lambda: ours_generate(llm, [prompt], 1), lambda: peer([prompt], 1), repeats
    )
    rows.append((f"prefill tokens/s (1 x {prefill_len})", prefill_len / ours, prefill_len / theirs))

    short = DECODE_PROMPT_LEN
    decode_cases = [(1, short), (16, short)] + (
        [(16, args.long_context)] if args.long_context else []
    )
    for batch, prompt_len in decode_cases:
        batch_prompts = _prompts(batch, prompt_len, batch)
        print(f"decode: batch {batch}, {prompt_len}-token prompts, {new_tokens} new tokens ...")
        ours_rate, hf_rate = decode_rates(
            lambda n, p=batch_prompts: ours_generate(llm, p, n),
            lambda n, p=batch_prompts: peer(p, n),
            batch,
            new_tokens,
            repeats,
        )
        context = "" if prompt_len == short else f", {prompt_len}-token prompts"
        rows.append((f"decode tokens/s (batch {batch}{context})", ours_rate, hf_rate))

    print()
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__} with {threads} threads, {args.dtype}")  # fmt: skip
    width = max(len(name) for name, _, _ in rows)
    peer_name = "transformers" if args.peer == "transformers" else "layer by layer"
    print(f"{'metric':<{width}} {'specserve':>12} {peer_name:>14} {'ratio':>8}")
    for name, ours_value, hf_value in rows:
        print(
            f"{name:<{width}} {ours_value:>12.1f} {hf_value:>14.1f} {ours_value / hf_value:>7.2f}x"
        )


if __name__ == "__main__":
    main()
