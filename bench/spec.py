"""Speculative decoding speed-up on CPU: the same requests with and without speculation.

Default: SmolLM2-135M with the n-gram proposer on prompts whose answers repeat their input.
With --spec-method eagle3|dflash --drafter DIR (and --model DIR), the same harness measures a
hidden-state drafter. Greedy decoding, one request at a time (batch 1, where speculation pays
most); outputs with and without speculation are checked to be identical.

    .venv/bin/python bench/spec.py [--quick] [--spec-method ngram --num-spec-tokens 4]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from specserve.llm import LLM
from specserve.shared.logging import configure_logging
from specserve.shared.protocol import SamplingParams

PROMPTS = [
    "Repeat this sentence three times: The quick brown fox jumps over the lazy dog.",
    "Write the numbers from 1 to 40, separated by commas.",
    "Copy this JSON exactly: "
    '{"name": "specserve", "version": "0.1.0", "tags": ["llm", "serving", "speculative"]}',
    "Rewrite this list, one item per line: apple, banana, cherry, date, elderberry, fig, grape, "
    "honeydew, kiwi, lemon.",
    "Here is a Python function:\n\ndef area(width, height):\n    return width * height\n\n"
    "Write it again, with a docstring.",
    "Spell the word 'banana' letter by letter, three times.",
]


def run(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], float, int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outputs = []
    tokens = 0
    start = time.perf_counter()
    for prompt in prompts:
        (out,) = llm.generate(prompt, params, chat=True)
        outputs.append(out.token_ids)
        tokens += len(out.token_ids)
    return outputs, time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--spec-method", default="ngram", choices=["ngram", "eagle3", "dflash"])
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--num-spec-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    configure_logging("warning")
    prompts = PROMPTS[:3] if args.quick else PROMPTS
    max_tokens = 48 if args.quick else args.max_tokens

    print(f"loading {args.model} without and with {args.spec_method} ...", flush=True)
    base = LLM(args.model)
    spec = LLM(
        args.model,
        spec_method=args.spec_method,
        drafter=args.drafter,
        num_spec_tokens=args.num_spec_tokens,
    )
    run(base, prompts[:1], 8)  # warm up both
    run(spec, prompts[:1], 8)
    print(f"generating {len(prompts)} prompts x {max_tokens} tokens, each way ...", flush=True)
    base_out, base_s, base_tokens = run(base, prompts, max_tokens)
    stats_before = spec.spec_stats.num_drafts
    spec_out, spec_s, spec_tokens = run(spec, prompts, max_tokens)
    assert spec_out == base_out, "speculative output differs from plain greedy output"
    stats = spec.spec_stats
    assert stats.num_drafts > stats_before

    print()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads, float32"
    )
    print(f"model {args.model}, {args.spec_method} K={args.num_spec_tokens}, greedy, batch 1")
    print(f"outputs identical with and without speculation: {spec_out == base_out}")
    print(f"{'':<24} {'no speculation':>16} {args.spec_method:>12}")
    print(f"{'tokens/s':<24} {base_tokens / base_s:>16.1f} {spec_tokens / spec_s:>12.1f}")
    print(f"{'speed-up':<24} {'1.00x':>16} {base_s / spec_s:>11.2f}x")
    print(f"mean acceptance length: {stats.mean_acceptance_length:.2f}")
    rates = ", ".join(f"{r:.2f}" for r in stats.acceptance_rate_per_position)
    print(f"acceptance rate per position: [{rates}]")
    print(
        f"drafts: {stats.num_drafts}, draft tokens: {stats.num_draft_tokens}, "
        f"accepted: {stats.num_accepted_tokens}"
    )


if __name__ == "__main__":
    main()
