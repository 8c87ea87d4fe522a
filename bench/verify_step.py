"""One target forward on CPU: a decode step against verification blocks, laid out as decode
rows (`torch_backend.token_rows`, the default) and as multi-row queries (the layout before it).

    python bench/verify_step.py                    # batches 1, 4, 16 at 200 tokens of context
    python bench/verify_step.py --context 1000 --batches 1 4

Prints the median milliseconds of each forward (metadata build included), two rounds per batch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specserve.worker.attention import torch_backend
from specserve.worker.attention.base import SequenceStep
from specserve.worker.kv_cache import PagedKVCache
from specserve.worker.model_registry import load_target
from specserve.worker.model_runner import forward_step

BLOCK_SIZE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_target(args.model, torch.float32).model
    config = model.config
    pages = -(-(args.context + 16) // BLOCK_SIZE)
    num_blocks = 1 + max(args.batches) * pages
    cache = PagedKVCache(
        config.kv_groups, num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim,
        torch.float32, "cpu",
    )  # fmt: skip

    def forward_ms(batch: int, q: int, as_rows: bool) -> float:
        torch_backend.TOKEN_ROW_BLOCK = 16 if as_rows else 0
        steps = [
            SequenceStep(
                q,
                args.context + q,
                [list(range(1 + b * pages, 1 + (b + 1) * pages))] * len(config.kv_groups),
            )
            for b in range(batch)
        ]
        ids = torch.randint(0, config.vocab_size, (batch * q,))
        positions = torch.tensor([args.context + j for _ in range(batch) for j in range(q)])
        times = []
        for _ in range(args.repeats + 2):
            start = time.perf_counter()
            meta = model.backend.build_metadata(steps, config.kv_groups, BLOCK_SIZE, "cpu")
            forward_step(model, ids, positions, meta, cache, ())
            times.append(time.perf_counter() - start)
        return statistics.median(times[2:]) * 1e3

    print(f"{args.model} fp32, {args.context} tokens of context, {torch.get_num_threads()} threads")
    print("| batch | decode | verify 4, multi-row | verify 4, decode rows | verify 8, multi-row "
          "| verify 8, decode rows |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    default = torch_backend.TOKEN_ROW_BLOCK
    try:
        for batch in args.batches:
            for _ in range(2):
                cells = [forward_ms(batch, 1, True)]
                for q in (4, 8):
                    cells += [forward_ms(batch, q, False), forward_ms(batch, q, True)]
                print(f"| {batch} | " + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)
    finally:
        torch_backend.TOKEN_ROW_BLOCK = default


if __name__ == "__main__":
    main()
