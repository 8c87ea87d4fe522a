"""Speculative decoding on held-out ShareGPT prompts: acceptance, speed-up, the drafter's cost.

In one run, on the bundled SmolLM2-135M-Instruct (fp32, greedy) and prompts that drafter
training never saw (the first user turns of ShareGPT V3's held-out chats):

1. Acceptance: mean acceptance length and per-position acceptance rates for EAGLE-3 at
   K = 3, 5, 7 and DFlash at K+1 = 4, 8, 16 (the bundled drafters unless --eagle3/--dflash).
2. Speed: output tokens/s at batch 1, 4 and 16 without speculation, with n-gram and with both
   drafters, all engines in lockstep (`lockstep.py`: one step of each in turn, so the
   machine's drift between and within runs cancels out of their ratios) and repeated; every
   speculative output is checked to be the non-speculative one, token for token. Each ratio
   pairs an engine's round with the plain engine's (the median and range of those ratios).
3. The drafter's share of step time (time in the proposer over time in the worker's step).
4. The speculation policy: each method with `--spec-policy fixed` (always K drafts) and
   `adaptive` (the default: drafts only where they pay), and what the adaptive one chose.

The speed runs repeat the same prompts, so with prefix caching on every run after the first
would reuse their KV. So every run is cold, prefix caching off, unless `--prefix-caching`.

    .venv/bin/python bench/spec.py [--quick] [--prompts 16] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice

import torch
from lockstep import lockstep
from machine import cpu_model

from specserve.llm import LLM
from specserve.shared.logging import configure_logging
from specserve.shared.tokenizer import load_tokenizer
from specserve.training.corpus import read_sharegpt
from specserve.training.evaluate import first_turn_prompts, measure

MODEL = "smollm2-135m"
HELD_OUT = 200  # `specserve train-drafter --held-out` default: chats no drafter trained on


@dataclass(frozen=True)
class Engine:
    name: str
    kwargs: dict


def held_out_prompts(count: int, max_prompt_tokens: int) -> list[list[int]]:
    """First user turns of held-out ShareGPT chats (chat template applied), short enough."""
    tokenizer = load_tokenizer(MODEL)
    assert tokenizer is not None
    chats = islice(read_sharegpt(), HELD_OUT)
    return first_turn_prompts(tokenizer, chats, count, max_prompt_tokens)


def timed_proposer(llm: LLM) -> Callable[[], tuple[float, float]]:
    """Wrap the engine's proposer and step to time them; returns a reader of the totals."""
    runner = llm.engine.runner
    totals = {"propose": 0.0, "step": 0.0}
    speculator = runner.speculator
    if speculator is not None:
        propose = speculator.propose

        def timed_propose(*args, **kwargs):
            start = time.perf_counter()
            try:
                return propose(*args, **kwargs)
            finally:
                totals["propose"] += time.perf_counter() - start

        speculator.propose = timed_propose  # type: ignore[method-assign]
    execute = runner.execute

    def timed_execute(*args, **kwargs):
        start = time.perf_counter()
        try:
            return execute(*args, **kwargs)
        finally:
            totals["step"] += time.perf_counter() - start

    runner.execute = timed_execute  # type: ignore[method-assign]
    return lambda: (totals["propose"], totals["step"])


def acceptance_table(
    prompts: Sequence[list[int]], max_tokens: int, drafters: dict[str, str | None]
) -> None:
    print("\n## Acceptance on held-out prompts (greedy, batch 16)\n")
    print("| method | K | mean acceptance length | acceptance rate per position |")
    print("|---|---:|---:|---|")
    for method, ks in (("eagle3", (3, 5, 7)), ("dflash", (3, 7, 15))):
        for k in ks:
            llm = LLM(
                MODEL,
                spec_method=method,
                drafter=drafters[method],
                num_spec_tokens=k,
                spec_policy="fixed",  # the drafter's acceptance with every round verifying K
            )
            stats = measure(llm, prompts, max_tokens, batch=16).stats
            rates = ", ".join(f"{r:.2f}" for r in stats.acceptance_rate_per_position)
            print(f"| {method} | {k} | {stats.mean_acceptance_length:.2f} | {rates} |", flush=True)


def speed_table(
    prompts: Sequence[list[int]],
    max_tokens: int,
    engines: Sequence[Engine],
    batches: Sequence[int],
    repeats: int,
) -> None:
    print("\n## Output tokens/s (greedy; median of repeats, engines in lockstep)\n")
    print(
        "Every round runs all engines at once, one step of each in turn (`lockstep.py`), so each\n"
        "engine's steps see the load the others' do; ratios pair each engine's round with the\n"
        "round of the engine without speculation: the median of those ratios, and their range.\n"
    )
    llms = {e.name: LLM(MODEL, **e.kwargs) for e in engines}
    timers = {name: timed_proposer(llm) for name, llm in llms.items()}
    for llm in llms.values():
        measure(llm, prompts[:1], 8, batch=1)  # warm up
    header = " | ".join(e.name for e in engines)
    print(f"| batch | {header} | " + " | ".join(f"{e.name} vs none" for e in engines[1:]) + " |")
    print("|---:|" + "---:|" * (2 * len(engines) - 1))
    shares: dict[str, list[float]] = {e.name: [] for e in engines}
    decisions: dict[tuple[str, int], list[int]] = {}
    for batch in batches:
        rates: dict[str, list[float]] = {e.name: [] for e in engines}
        reference: list[list[int]] | None = None
        for _ in range(repeats):
            before = {name: timers[name]() for name in llms}
            planned = {name: policy_totals(llm) for name, llm in llms.items()}
            runs = lockstep(llms, prompts, max_tokens, batch)
            for engine in engines:
                name, run = engine.name, runs[engine.name]
                after = timers[name]()
                total = decisions.setdefault((name, batch), [0, 0, 0])
                done = policy_totals(llms[name])
                for i, (b, a) in enumerate(zip(planned[name], done, strict=True)):
                    total[i] += a - b
                if reference is None:
                    reference = run.outputs
                assert run.outputs == reference, f"{name} output differs at batch {batch}"
                rates[name].append(run.tokens_per_second)
                step = after[1] - before[name][1]
                shares[name].append((after[0] - before[name][0]) / step if step else 0.0)
        medians = {name: statistics.median(r) for name, r in rates.items()}
        cells = " | ".join(f"{medians[e.name]:.1f}" for e in engines)
        base = rates[engines[0].name]
        ratios = " | ".join(paired_ratio(rates[e.name], base) for e in engines[1:])
        print(f"| {batch} | {cells} | {ratios} |", flush=True)
    print("\nDrafter's share of worker step time (all batches): " + ", ".join(
        f"{name} {statistics.mean(s):.0%}" for name, s in shares.items() if any(s)
    ))  # fmt: skip
    print_decisions(decisions)


def paired_ratio(rates: Sequence[float], baseline: Sequence[float]) -> str:
    """Median and range of the per-round ratios `rates[i] / baseline[i]`."""
    ratios = [r / b for r, b in zip(rates, baseline, strict=True)]
    low, high = min(ratios), max(ratios)
    spread = f" ({low:.2f}-{high:.2f})" if len(ratios) > 1 else ""
    return f"{statistics.median(ratios):.2f}x{spread}"


def policy_totals(llm: LLM) -> tuple[int, int, int]:
    """(steps planned, steps that verify drafts, drafts verified) so far."""
    policy = llm.engine.runner.spec_policy
    if policy is None:
        return 0, 0, 0
    stats = policy.stats
    return (
        sum(stats.steps.values()),
        sum(stats.speculating_steps.values()),
        sum(stats.drafts_verified.values()),
    )


def print_decisions(decisions: dict[tuple[str, int], list[int]]) -> None:
    """What each policy chose at each batch size, over all repeats."""
    print("\n## Speculation policy decisions (all repeats)\n")
    print("| engine | batch | steps verifying drafts | drafts verified per step |")
    print("|---|---:|---:|---:|")
    for (name, batch), (steps, speculating, drafts) in decisions.items():
        if steps:
            print(f"| {name} | {batch} | {speculating / steps:.0%} | {drafts / steps:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts, tokens, repeats")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--eagle3", default=None, help="EAGLE-3 drafter dir (default: bundled)")
    parser.add_argument("--dflash", default=None, help="DFlash drafter dir (default: bundled)")
    parser.add_argument("--eagle3-k", type=int, default=3, help="K of the speed runs")
    parser.add_argument("--dflash-k", type=int, default=3, help="K of the speed runs")
    parser.add_argument("--ngram-k", type=int, default=4)
    parser.add_argument("--skip-acceptance", action="store_true")
    parser.add_argument(
        "--prefix-caching", action="store_true", help="speed runs reuse the KV of earlier runs"
    )
    parser.add_argument("--methods", default="ngram,eagle3,dflash", help="in the speed table")
    parser.add_argument(
        "--policies",
        default="fixed,adaptive",
        help="speculation policies in the speed table (fixed: always K; adaptive: the default)",
    )
    parser.add_argument(
        "--drafter-dtypes",
        default="auto",
        help="drafter dtypes in the speed table, comma-separated (auto: the engine's default)",
    )
    args = parser.parse_args()
    configure_logging("warning")
    if args.quick:
        args.prompts, args.max_tokens, args.repeats, args.batches = 4, 32, 1, "1,4"
    prompts = held_out_prompts(args.prompts, args.max_prompt_tokens)
    drafters = {"eagle3": args.eagle3, "dflash": args.dflash}
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} with "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"model {MODEL} fp32, {len(prompts)} held-out ShareGPT prompts, "
          f"{args.max_tokens} new tokens each, greedy")  # fmt: skip
    if not args.skip_acceptance:
        acceptance_table(prompts, args.max_tokens, drafters)
    methods = {
        "ngram": {"spec_method": "ngram", "num_spec_tokens": args.ngram_k},
        "eagle3": {
            "spec_method": "eagle3",
            "drafter": args.eagle3,
            "num_spec_tokens": args.eagle3_k,
        },
        "dflash": {
            "spec_method": "dflash",
            "drafter": args.dflash,
            "num_spec_tokens": args.dflash_k,
        },
    }
    cache = {"enable_prefix_caching": args.prefix_caching}
    dtypes = args.drafter_dtypes.split(",")
    engines = [Engine("none", cache)] + [
        Engine(
            f"{method} K={kwargs['num_spec_tokens']} {policy}"
            + (f" {dtype}" if dtype and len(dtypes) > 1 else ""),
            {**kwargs, **cache, "spec_policy": policy}
            | ({"drafter_dtype": dtype} if dtype else {}),
        )
        for method, kwargs in methods.items()
        if method in args.methods.split(",")
        for policy in args.policies.split(",")
        for dtype in (dtypes if method != "ngram" else [None])  # n-gram has no drafter
    ]
    batches = [int(b) for b in args.batches.split(",")]
    speed_table(prompts, args.max_tokens, engines, batches, args.repeats)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
