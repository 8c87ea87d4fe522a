"""The matmuls of a SmolLM2 decode step on CPU: the panel kernel beside oneDNN's packed GEMM and
`F.linear` on the plain weight, and in float32 the narrow panels (4-bit layers, 8-bit head;
16-bit for bfloat16 values).

One pass over all 121 weights (four per layer and the LM head, as `worker/models.py` fuses
them), the way a decode step streams them from memory, at several row counts:
    .venv/bin/python bench/linear.py [--rows 1,16,64] [--repeats 5]

The layers' weights are 4-bit blocks and the head's 8-bit ones, as the bundled model's are
(`narrow_panels.round_to_q4_blocks`, `round_to_q8_blocks`). They are timed in alternation; the
best pass of each is printed with its ratio to the panels' time (`worker/cpu/linear.py` makes the
same comparison at load to decide from how many rows on panels hand over to oneDNN). In float32
the `narrow` column is the same pass reading the layers' 4-bit panels and the head's 8-bit ones
where the kernel takes them (`narrow_panels`), the `head` columns the head alone on its float32
and its 8-bit panels, and the `16-bit` column a pass over the same weights rounded to bfloat16
(a checkpoint saved in bfloat16 and run in float32), on their 16-bit panels, against their
float32 panels (`f32`).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import torch
from machine import cpu_model

from specserve.worker.cpu import kernels, narrow_panels

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
    narrow: list[tuple[torch.Tensor, int] | None] | None = None,
) -> None:
    for i, (w, p) in enumerate(zip(weights, panels, strict=True)):
        kind = narrow[i] if narrow else None
        kernels.panel_linear(inputs[w.shape[1]], p, None, w.shape[0], *(kind or (None, 0)))


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
        f"{'F.linear ms':>12} {'ratio':>7} {'narrow ms':>9} {'ratio':>7} {'head ms':>8} "
        f"{'8-bit ms':>8} {'ratio':>7} {'f32 ms':>7} {'16-bit ms':>9} {'ratio':>7}"
    )
    for dtype in (torch.float32, torch.bfloat16):
        if dtype not in kernels.linear_dtypes():
            print(f"{dtype!s:<9} the panel kernel does not run this dtype on this CPU")
            continue
        g = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=g) / k**0.5 for n, k in SHAPES]
        weights = [narrow_panels.round_to_q4_blocks(w) for w in weights[:-1]] + [
            narrow_panels.round_to_q8_blocks(weights[-1])
        ]
        weights = [w.to(dtype) for w in weights]
        panels = [kernels.pack_panels(w) for w in weights]
        narrow = b16 = None
        if dtype == torch.float32 and kernels.linear_narrow_max_rows(4):
            narrow = [narrow_panels.pack(w) for w in weights]
            halves = [w.to(torch.bfloat16).float() for w in weights]
            b16 = halves, [kernels.pack_panels(w) for w in halves]
            b16_narrow = [(narrow_panels.pack_b16(w, p), 16) for w, p in zip(*b16, strict=True)]
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
            if narrow and b16:
                passes["narrow"] = partial(panels_pass, weights, panels, inputs, narrow)
                head = weights[-1:], panels[-1:], inputs
                passes["head"] = partial(panels_pass, *head)
                passes["head_q8"] = partial(panels_pass, *head, narrow[-1:])
                passes["f32"] = partial(panels_pass, *b16, inputs)
                passes["b16"] = partial(panels_pass, *b16, inputs, b16_narrow)
            best = _best(passes, args.repeats)
            four_bit = (
                f"{best['narrow'] * 1e3:>9.2f} {best['panels'] / best['narrow']:>6.2f}x "
                f"{best['head'] * 1e3:>8.2f} {best['head_q8'] * 1e3:>8.2f} "
                f"{best['head'] / best['head_q8']:>6.2f}x {best['f32'] * 1e3:>7.2f} "
                f"{best['b16'] * 1e3:>9.2f} {best['f32'] / best['b16']:>6.2f}x"
                if "narrow" in best
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
