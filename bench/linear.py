"""The matmuls of a SmolLM2 decode step on CPU: the panel kernel beside oneDNN's packed GEMM and
`F.linear` on the plain weight, and in float32 the block panels (4-bit layers, 8-bit head).

One pass over all 121 weights (four per layer and the LM head, as `worker/models.py` fuses
them), the way a decode step streams them from memory, at several row counts:
    .venv/bin/python bench/linear.py [--rows 1,16,64] [--repeats 5]

The layers' weights are 4-bit blocks and the head's 8-bit ones, as the bundled model's are
(`block_panels.round_to_q4_blocks`, `round_to_q8_blocks`). They are timed in alternation; the best
pass of each is printed with its ratio to the panels' time (`worker/cpu/linear.py` makes the same
comparison at load to decide from how many rows on panels hand over to oneDNN); in float32 the
blocks' column is the same pass reading the layers' 4-bit panels and the head's 8-bit ones where
the kernel takes them (`block_panels`), and the last two columns the head alone, on its float32
and on its 8-bit panels.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import torch
from machine import cpu_model

from specserve.worker.cpu import block_panels, kernels

HIDDEN, INTER, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS + [
    (VOCAB, HIDDEN)
]


def _best(passes: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    best = dict.fromkeys(passes, float("inf"))
    for fn in passes.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in passes.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def panels_pass(
    weights: list[torch.Tensor],
    panels: list[torch.Tensor],
    inputs: dict[int, torch.Tensor],
    blocks: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None,
) -> None:
    for i, (w, p) in enumerate(zip(weights, panels, strict=True)):
        q4, q8 = blocks[i] if blocks else (None, None)
        kernels.panel_linear(inputs[w.shape[1]], p, None, w.shape[0], q4, q8)


def onednn_pass(
    weights: list[torch.Tensor], packed: list[torch.Tensor], inputs: dict[int, torch.Tensor]
) -> None:
    for w, p in zip(weights, packed, strict=True):
        torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")


def plain_pass(weights: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> None:
    """`F.linear` on the plain weight: oneDNN's GEMM (on AMX tiles where the CPU has them)."""
    for w in weights:
        torch.nn.functional.linear(inputs[w.shape[1]], w)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} "
          f"with {torch.get_num_threads()} threads")  # fmt: skip
    print(
        f"{'dtype':<9} {'rows':>5} {'panels ms':>10} {'oneDNN ms':>10} {'ratio':>7} "
        f"{'F.linear ms':>12} {'ratio':>7} {'blocks ms':>9} {'ratio':>7} {'head ms':>8} "
        f"{'8-bit ms':>8} {'ratio':>7}"
    )
    for dtype in (torch.float32, torch.bfloat16):
        if dtype not in kernels.linear_dtypes():
            print(f"{dtype!s:<9} the panel kernel does not run this dtype on this CPU")
            continue
        g = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=g) / k**0.5 for n, k in SHAPES]
        weights = [block_panels.round_to_q4_blocks(w) for w in weights[:-1]] + [
            block_panels.round_to_q8_blocks(weights[-1])
        ]
        weights = [w.to(dtype) for w in weights]
        panels = [kernels.pack_panels(w) for w in weights]
        blocks = None
        if kernels.linear_q4_max_rows() and dtype == torch.float32:
            blocks = [(block_panels.pack_q4(w), block_panels.pack_q8(w)) for w in weights[:-1]]
            blocks.append((None, block_panels.pack_q8(weights[-1])))
        try:
            onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
        except RuntimeError as err:  # bfloat16 weights need AVX-512 or AVX-NE-CONVERT there
            print(f"{dtype!s:<9} no oneDNN column: {str(err).splitlines()[0]}")
            onednn = None
        for rows in rows_list:
            inputs = {k: torch.randn(rows, k, generator=g).to(dtype) for k in (HIDDEN, INTER)}

            passes = {
                "panels": partial(panels_pass, weights, panels, inputs),
                "plain": partial(plain_pass, weights, inputs),
            }
            if onednn:
                passes["onednn"] = partial(onednn_pass, weights, onednn, inputs)
            if blocks:
                passes["blocks"] = partial(panels_pass, weights, panels, inputs, blocks)
                head = weights[-1:], panels[-1:], inputs
                passes["head"] = partial(panels_pass, *head)
                passes["head_q8"] = partial(panels_pass, *head, blocks[-1:])
            best = _best(passes, args.repeats)
            four_bit = (
                f"{best['blocks'] * 1e3:>9.2f} {best['panels'] / best['blocks']:>6.2f}x "
                f"{best['head'] * 1e3:>8.2f} {best['head_q8'] * 1e3:>8.2f} "
                f"{best['head'] / best['head_q8']:>6.2f}x"
                if "blocks" in best
                else f"{'-':>9} {'-':>7}"
            )
            one_dnn = (
                f"{best['onednn'] * 1e3:>10.2f} {best['onednn'] / best['panels']:>6.2f}x"
                if "onednn" in best
                else f"{'-':>10} {'-':>7}"
            )
            print(
                f"{str(dtype).removeprefix('torch.'):<9} {rows:>5} {best['panels'] * 1e3:>10.2f} "
                f"{one_dnn} "
                f"{best['plain'] * 1e3:>12.2f} {best['plain'] / best['panels']:>6.2f}x {four_bit}"
            )


if __name__ == "__main__":
    main()
