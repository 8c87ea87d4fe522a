"""What adaptive speculation costs at one batch size, resolved in lockstep.

Whole `bench/spec.py` runs at batch 16 disagree by more than the effect in question (a few
percent). This runs the engines in one process on the same held-out ShareGPT prompts, one
batch, greedy, stepping them in turn (`lockstep.py`: each engine's steps timed beside the
others', so the VM's drift cancels out of their ratios), round after round:

- `none`: no speculation;
- `adaptive`: the method with the default adaptive policy;
- `upkeep`: the same engine whose policy never verifies a draft, so it pays everything that
  speculation costs besides draft rows (drafter passes and probes, n-gram's shadow proposals,
  their scoring, the planning) and gains nothing;
- `none again` (with `--control`): a second engine without speculation, whose ratio to `none`
  is what two identical engines differ by here: the measurement's floor.

It prints each round and the median and mean of every engine's rate over `none`'s: where
`adaptive` is level with `upkeep`, the drafts it verifies pay for themselves and what is left
is the upkeep. Every output is checked equal to the plain one.

    .venv/bin/python bench/spec_upkeep.py [--method ngram] [--batch 16] [--rounds 16] [--control]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from lockstep import lockstep
from machine import cpu_model
from spec import MODEL, held_out_prompts, policy_totals

from specserve.llm import LLM
from specserve.shared.logging import configure_logging
from specserve.training.evaluate import measure

METHODS = {"ngram": 4, "eagle3": 3, "dflash": 3}  # K as bench/spec.py's speed runs use it


def never_verify(llm: LLM) -> None:
    """Make `llm`'s policy choose no drafts (probes and shadow drafts go on as they would)."""
    policy = llm.engine.runner.spec_policy
    assert policy is not None
    policy._choose = lambda *args: {}  # the one place a plan's drafts are chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=sorted(METHODS), default="ngram")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--control", action="store_true", help="also a second engine without speculation"
    )
    args = parser.parse_args()
    configure_logging("warning")
    prompts = held_out_prompts(args.batch, 512)
    spec = {
        "spec_method": args.method,
        "num_spec_tokens": METHODS[args.method],
        "spec_policy": "adaptive",
    }
    llms = {
        "none": LLM(MODEL, enable_prefix_caching=False),
        "adaptive": LLM(MODEL, enable_prefix_caching=False, **spec),
        "upkeep": LLM(MODEL, enable_prefix_caching=False, **spec),
    }
    if args.control:
        llms["none again"] = LLM(MODEL, enable_prefix_caching=False)
    never_verify(llms["upkeep"])
    for llm in llms.values():
        measure(llm, prompts[:1], 8, batch=1)  # warm up
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} with "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"{args.method} K={METHODS[args.method]}, batch {args.batch}, {args.max_tokens} tokens")
    reference = None
    ratios: dict[str, list[float]] = {name: [] for name in llms if name != "none"}
    for round_ in range(args.rounds):
        runs = lockstep(llms, prompts, args.max_tokens, args.batch)
        rates = {}
        for name, run in runs.items():
            reference = reference or run.outputs
            assert run.outputs == reference, f"{name} output differs"
            rates[name] = run.tokens_per_second
        for name in ratios:
            ratios[name].append(rates[name] / rates["none"])
        cells = ", ".join(f"{name} {rate:.1f}" for name, rate in rates.items())
        print(f"round {round_ + 1}: {cells} tok/s", flush=True)
    for name, values in ratios.items():
        print(
            f"{name} / none: median {statistics.median(values):.3f}, mean "
            f"{statistics.mean(values):.3f}, range {min(values):.3f}-{max(values):.3f}"
        )
    steps, verifying, drafts = policy_totals(llms["adaptive"])
    print(f"adaptive verified in {verifying / steps:.0%} of its steps, {drafts / steps:.2f} drafts")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
