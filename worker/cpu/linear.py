"""Linear layers whose weights are laid out once, at load time, for a fast CPU matmul.

On CPU, torch's default `F.linear` runs a GEMM that reads the weight in its plain layout on
every call, which is slow for the few rows of a decode step. So each weight gets a packed copy:

- on AVX-512 CPUs and AVX2 ones with FMA (bfloat16 widened to float32 where the CPU has no
  bfloat16 arithmetic: AVX2, and AVX-512 without AVX512_BF16), panels for specserve's own kernel
  (`kernels.panel_linear`): it streams each weight once per tile of up to 28 rows (6 with AVX2)
  at about the CPU's peak. For SmolLM2's 121 matmuls (LM head included) on a 2-core AMD Zen 4:
  23.6 ms at 16 rows in float32 (oneDNN packed: 29.7 ms) and 13.1 ms in bfloat16 (17.3 ms); 11.8
  ms (20.7 ms) at one row; on par (+-10%) at 64 to 256 rows. On a 2-core AMD Zen 1 (AVX2,
  float32): 27.4 ms at one row (34.3), 70.2 ms at 16 (91.6), 245 ms at 64 (261)
  (`bench/linear.py`, docs/benchmarks.md). From `PANEL_MAX_ROWS` rows on (prompt chunks)
  oneDNN's GEMM on the plain weight takes over (not for bfloat16 where the panels widen it:
  oneDNN emulates it there, several times slower): streaming each weight once per tile of rows
  stops paying there, and in a real prefill between the model's other ops the panels ran at
  about 290 GFLOP/s where oneDNN ran at about 450 (64 ShareGPT prompts: 1,000 prompt tokens/s
  against 1,540 in float32, 1,600 against 2,400 in bfloat16). oneDNN is reached through
  `F.linear` in bfloat16 and `torch.ops.mkldnn._linear_pointwise` in float32, where `F.linear`
  goes to the BLAS torch was built with: slower on that machine (860 tokens/s), faster on an
  Intel Xeon, so which of the two runs float32 is calibrated (`BLAS_CALIBRATION_ROWS`). Both
  reorder the weight per call, which costs little beside a GEMM of that many rows and needs
  no third copy of the weights. Where a CPU's GEMM
  library beats the panels from fewer rows, the hand-over moves down (calibrated, below) and
  oneDNN gets a blocked copy of each weight. On CPUs with AMX tiles (Intel Sapphire Rapids and
  later) the bfloat16 panels multiply on the tiles from 4 rows on (where K is a multiple of 32):
  on a 2-core machine of that kind 15.4 ms at 16 rows and 24.9 at 64 (oneDNN: 19.1, 26.8; the
  AVX512_BF16 panels took 29.7 and 95.9). Those keep prompt chunks of up to
  `AMX_PANEL_MAX_ROWS` rows, which oneDNN's bfloat16 GEMM would first compile a kernel for.
- elsewhere, oneDNN's blocked layout (`torch.ops.mkldnn`), 1.5-3x faster than `F.linear` at
  16 rows (13.6 ms instead of 40.6 ms on a Zen 5 machine, 36 ms instead of 57 ms on an Intel
  one; see docs/benchmarks.md).

The math is the same matmul in the same dtype; only the summation order differs (|diff| ~1e-6
in float32; bfloat16 results are rounded once from a float32 sum, as oneDNN does).

Which path wins at a handful of rows depends on the CPU (on the Intel machine, MKL's plain GEMV
beats oneDNN's packed weights up to 3 rows; panels are used from one row, since only they run
the fused decode step), and so does where panels should hand over to oneDNN. So a model large
enough for it to matter times both over its own weights at load
(`calibrate_min_rows`, `calibrate_onednn_rows`) and each packed weight remembers from how many
rows on it is used and from how many on oneDNN takes over. That takes seconds (tens on a
small CPU with a model of a few hundred MB), so it is logged while it runs and its result is
cached per CPU model, thread count, kernel library and weight shapes in
`$SPECSERVE_CACHE_DIR/linear_calibration.json`: the next start of the same model on the same
kind of machine skips it. A calibration during which other processes held the cores (its
threads got less than `MIN_CALIBRATION_CPU_SHARE` of their time) is used but not cached.

The plain weight stays where it is, because drafters and tests read it; the packed copy is used
by `forward` only, so a packed model holds its linear weights twice (three times where the
hand-over was calibrated below `PANEL_MAX_ROWS`), plus a float32 weight's narrow panels where
its values have a narrower exact form (`narrow_panels`: a sixth, 17/64 or half of its bytes
more; a bfloat16 checkpoint run in float32 thus holds 2.5 times its float32 bytes). CUDA,
float16 and float64
weights, and CPUs with neither path, keep `F.linear`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeGuard

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from specserve.shared.paths import cache_root
from specserve.worker.cpu import kernels, narrow_panels

log = structlog.get_logger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Models whose packed weights are smaller than this keep the default (packed from 1 row): their
# matmuls are too short for the choice to matter, and tests of small models stay deterministic.
CALIBRATE_MIN_BYTES = 32 * 2**20
CALIBRATION_ROWS = (1, 2, 4, 8, 16)
PANEL_MAX_ROWS = 256  # from this many rows on, panel-packed weights run oneDNN's GEMM instead
# ... except bfloat16 panels that multiply on AMX tiles: they keep inputs of fewer rows than
# this (prompt chunks, a drafter's catch-ups). oneDNN's bfloat16 GEMM compiles a kernel for
# every row count it first meets, and those come in every size: on a 2-core Intel Xeon with AMX
# a first 300-900-row call of a 576 x 1,728 weight took ~5 ms more than the 1.3 ms of its
# compiled kernel (16-256 rows: ~1.8 ms more), where the tiles ran SmolLM2's layers at 0.86 /
# 0.98 / 0.97 of oneDNN's compiled time at 256 / 512 / 1,024 rows (1.77x it at 2,048).
AMX_PANEL_MAX_ROWS = 1024
ONEDNN_CALIBRATION_ROWS = (8, 16, 32, 64, 128)  # where calibration may move that hand-over
# Where calibration may end the narrow panels (`narrow_panels`), up to the kernel's own limit:
# their expansion costs arithmetic that outweighs the bytes saved from some row count on, which
# depends on the CPU and the kind (SmolLM2's 4-bit layers on a 2-core Zen 4, which runs 512-bit
# operations in two halves: 1.10x faster at 16 rows, level at 24-48, 0.94x at 64; on a Zen 5
# still 1.15x at 64). A CPU with 128-bit FMA units loses much sooner: on a 2-core Zen 1 (AVX2)
# 1.05x faster at 4 rows, 0.90x at 6 and 0.88x at 8, where the AVX2 blocks' own limit (16
# rows) left 8 as the only answer short of 16.
NARROW_CALIBRATION_ROWS = (4, 6, 8, 12, 16, 24, 32, 48, 64)
# ... and they end only where the float32 panels take at most this share of their time: where
# the two tie (the Zen 1 at 4 rows: 1.05x one run, level in the calibration), the narrow panels
# read a fraction of the bytes, which leaves memory bandwidth to the other cores' work.
NARROW_MARGIN = 0.97
# oneDNN takes over where its GEMMs take at most this share of the panels' time: the rest must
# pay for the glue of the layer-by-layer path, which the fused decode step (panels only) saves.
# On a 2-core Sapphire Rapids machine in bfloat16 (AVX512_BF16 panels, before their AMX body)
# that glue was about a third of a panel pass at 8-16 rows: 8 rows at 0.88 of the panels' time
# ran 193-223 tokens/s on oneDNN against 267 on the panels, 16 rows at 0.65 ran even.
ONEDNN_MARGIN = 0.6
# From `PANEL_MAX_ROWS` rows on, a float32 weight without a blocked copy goes to a library GEMM
# on its plain layout: oneDNN's (`_linear_pointwise`) or the BLAS that `F.linear` calls (MKL in
# torch's x86 wheels), whichever calibration at this many rows (a prompt chunk) finds faster by
# `BLAS_MARGIN`. It depends on the CPU: on a 2-core Intel Xeon with AMX, SmolLM2's layers at
# 512 rows took 0.966 of oneDNN's time through `F.linear` (0.938 at 1,024), where on an AMD
# EPYC `F.linear` went to a slower GEMM (a prefill of 860 prompt tokens/s against 1,000).
BLAS_CALIBRATION_ROWS = 512
BLAS_MARGIN = 0.98
CALIBRATION_FILE = "linear_calibration.json"  # in `cache_root()`
# A calibration is cached only if this process had at least this share of its threads' time on
# the cores while it ran; below, another process was using them and skewed the timings. On a
# 2-core AMD EPYC (Zen 3), SmolLM2's calibration had 0.96-0.99 of its two threads' time when
# quiet, 0.63 with one core busy elsewhere and 0.49 with both (which chose oneDNN from 16 rows
# where a quiet one chose 256).
MIN_CALIBRATION_CPU_SHARE = 0.8
MIN_JUDGED_CALIBRATION_S = 0.2  # shorter ones (small models) are too brief to judge, and cheap


_packing_generation = 0


def packing_generation() -> int:
    """A count that changes whenever a packed weight is made or changed (its row limits, its
    hand-over), a `Linear` takes another packed copy, or any module another submodule or
    parameter: a table of packed weights' addresses (`fused_decode.stack_for`) holds while it
    stays the same."""
    return _packing_generation


def _packing_changed(*_hook_args: object) -> None:
    global _packing_generation
    _packing_generation += 1


# Any module given another submodule or parameter (`layer.mlp = ...`, `norm.weight =
# nn.Parameter(...)`) may drop what a table points at: torch's process-wide registration hooks
# count it (a swap of a tensor's `.data` registers nothing; `fused_decode` checks those).
nn.modules.module.register_module_module_registration_hook(_packing_changed)
nn.modules.module.register_module_parameter_registration_hook(_packing_changed)


@dataclass(eq=False)
class PackedWeight:
    """`weight` laid out for a CPU GEMM (`tensor`): panels for `kernels.panel_linear`, else
    oneDNN's blocked layout; used for inputs of at least `min_rows` rows. Panels hand inputs of
    `onednn_rows` rows and more to oneDNN (`large_rows_onednn`), through `onednn`, a blocked
    copy made where calibration moved the hand-over below `PANEL_MAX_ROWS`, else through the
    plain weight."""

    tensor: torch.Tensor
    weight: torch.Tensor
    min_rows: int = 1
    panels: bool = False

    large_rows_onednn: bool = False
    panel_max_rows: int = PANEL_MAX_ROWS  # the hand-over where calibration moves it no lower
    onednn_rows: int = PANEL_MAX_ROWS
    onednn: torch.Tensor | None = None
    # Without a blocked copy, float32 inputs of `onednn_rows` rows and more take `F.linear`'s
    # BLAS instead of oneDNN's GEMM (calibrated; bfloat16 ones always take `F.linear`).
    large_rows_blas: bool = False
    # A float32 weight's exact narrower panels (`narrow_panels`), of kind `bits` (4, 8, 16),
    # read up to `narrow_rows` rows (calibrated; the kernel's own limit at most).
    narrow: torch.Tensor | None = None
    bits: int = 0
    narrow_rows: int = 0

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        _packing_changed()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.panels:
            return _onednn_linear(x, self.tensor, bias)
        rows = x.numel() // x.shape[-1]
        if self.runs_panels(rows):
            n = self.weight.shape[0]
            return kernels.panel_linear(x, self.tensor, bias, n, *self.narrow_for(rows))
        if self.onednn is not None:
            return _onednn_linear(x, self.onednn, bias)
        if x.dtype == torch.bfloat16 or self.large_rows_blas:
            return F.linear(x, self.weight, bias)
        return _onednn_linear(x, self.weight, bias)

    def runs_panels(self, rows: int) -> bool:
        """Whether an input of `rows` rows goes through the panel kernel (the fused decode
        step runs only where every linear does)."""
        return (
            self.panels
            and rows >= self.min_rows
            and not (self.large_rows_onednn and rows >= self.onednn_rows)
        )

    def narrow_for(self, rows: int) -> tuple[torch.Tensor | None, int]:
        """The narrow panels an input of `rows` rows reads and their kind ((None, 0): the
        float32 panels)."""
        if self.narrow is None or rows > self.narrow_rows:
            return None, 0
        return self.narrow, self.bits

    def row_tiles(self, rows: int) -> int:
        """The panel kernel's row tiles for `rows` rows (`kernels.linear_row_tiles`): the passes
        over the weights a step of that many rows makes; 1 where another GEMM runs it."""
        if not self.runs_panels(rows):
            return 1
        k, dtype = self.weight.shape[1], self.weight.dtype
        return kernels.linear_row_tiles(rows, k, dtype, self.narrow_for(rows)[1])

    def limit_narrow(self, bits: int, rows: int) -> None:
        """Read narrow panels of kind `bits` for at most `rows` rows (a calibrated limit; never
        raises the one this weight has; a weight of another kind is left as it is)."""
        if self.bits == bits:
            self.narrow_rows = min(self.narrow_rows, rows)

    def hand_over(self, rows: int) -> None:
        """Panels hand `rows` rows and more to oneDNN; below `PANEL_MAX_ROWS` through a
        blocked copy of the weight (more memory, a faster GEMM than reordering per call);
        from `PANEL_MAX_ROWS` on, at the weight's own `panel_max_rows`."""
        if not (self.panels and self.large_rows_onednn):
            return
        self.onednn_rows = rows if rows < PANEL_MAX_ROWS else self.panel_max_rows
        self.onednn = (
            torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            if rows < PANEL_MAX_ROWS
            else None
        )


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this weight gets a packed copy: a CPU fp32/bf16 matrix that the panel kernel or
    oneDNN can run."""
    return _panel_kernel_runs(weight) or _onednn_runs(weight)


def _panel_kernel_runs(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in kernels.linear_dtypes()
    )


def _panels_on_tiles(weight: torch.Tensor) -> bool:
    """Whether the panel kernel multiplies this weight on AMX tiles (bfloat16, K a multiple
    of 32, a CPU with tiles)."""
    return (
        weight.dtype == torch.bfloat16
        and weight.shape[1] % 32 == 0
        and kernels.linear_amx_min_rows() > 0
    )


def _onednn_runs(weight: torch.Tensor) -> bool:
    """A CPU fp32/bf16 matrix on a build with oneDNN (bf16 only on CPUs with the instructions
    oneDNN's bf16 kernels need, and not where the panel kernel widens bfloat16: oneDNN
    emulates it there, at a quarter of the panels' rate or less)."""
    if not (
        weight.device.type == "cpu"
        and weight.dtype in _PACKABLE_DTYPES
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    if weight.dtype != torch.bfloat16:
        return True
    if _panel_kernel_runs(weight) and kernels.linear_widens_bfloat16():
        return False
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_weight(weight: torch.Tensor, min_rows: int = 1) -> PackedWeight | None:
    """The weight laid out for the panel kernel or oneDNN, or None where `F.linear` must be
    used."""
    if _panel_kernel_runs(weight):
        panels = kernels.pack_panels(weight)
        limits = {bits: kernels.linear_narrow_max_rows(bits) for bits in kernels.NARROW_BITS}
        kinds = [bits for bits, rows in limits.items() if rows]  # those the kernel runs
        narrow, bits = narrow_panels.pack(weight, kinds, panels) or (None, 0)
        max_rows = AMX_PANEL_MAX_ROWS if _panels_on_tiles(weight) else PANEL_MAX_ROWS
        return PackedWeight(
            panels,
            weight,
            min_rows,
            panels=True,
            large_rows_onednn=_onednn_runs(weight),
            panel_max_rows=max_rows,
            onednn_rows=max_rows,
            narrow=narrow,
            bits=bits,
            narrow_rows=limits.get(bits, 0),
        )
    if not _onednn_runs(weight):
        return None
    try:
        tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except RuntimeError:  # a CPU or build oneDNN turns down: the plain path still works
        return None
    return PackedWeight(tensor, weight, min_rows)


def pack_again(packed: PackedWeight | None, weight: torch.Tensor) -> PackedWeight | None:
    """`weight` packed with `packed`'s `min_rows`, hand-over and narrow panels' row limit, if
    `packed` is in use (after `weight` was moved, cast or reloaded); None stays None."""
    if packed is None:
        return None
    again = pack_weight(weight, packed.min_rows)
    if again is not None:
        again.hand_over(packed.onednn_rows)
        again.large_rows_blas = packed.large_rows_blas
        if again.narrow is not None and packed.narrow is not None:
            again.limit_narrow(packed.bits, packed.narrow_rows)
    return again


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the packed weight when there is one, `x` has at
    least its `min_rows` rows, and `x` is a CPU tensor of the weight's dtype (otherwise
    `F.linear` gives its usual clear error)."""
    if not _takes_packed(x, weight, packed):
        return F.linear(x, weight, bias)
    return packed(x, bias)


def _takes_packed(
    x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None
) -> TypeGuard[PackedWeight]:
    """Whether `x` goes through `packed`: there is one, `x` has at least its `min_rows` rows
    and is a CPU tensor of the weight's dtype."""
    return (
        packed is not None
        and x.numel() >= packed.min_rows * x.shape[-1]
        and x.dtype == weight.dtype
        and x.device.type == "cpu"
    )


class Linear(nn.Linear):
    """`nn.Linear` that uses a packed copy of its weight once `pack_weights()` has made one.

    Moving or casting the module (`.to()`, `.half()`, ...) or loading a state dict into it
    packs the new weight again, so the copy never goes stale.
    """

    packed: PackedWeight | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_load_state_dict_post_hook(lambda module, _: module.repack())

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "packed":  # weight and bias are parameters: the hooks above count them
            _packing_changed()

    def pack_weights(self) -> list[PackedWeight]:
        self.packed = pack_weight(self.weight)
        return [self.packed] if self.packed is not None else []

    def repack(self) -> None:
        """Pack the current weight again if a packed copy is in use (same `min_rows`)."""
        self.packed = pack_again(self.packed, self.weight)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        module = super()._apply(fn, recurse)
        self.repack()
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)

    def forward_columns(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """`F.linear(x, weight[start:], bias[start:])`: the output columns from `start` on
        (e.g. an attention's k and v without q), through the panels that hold them where the
        panels run these rows and `start` begins a panel (a view: no copy of the weight),
        else `F.linear` on those rows of the weight. The same numbers as `forward`'s
        columns where both run the panels."""
        weight = self.weight[start:]
        bias = None if self.bias is None else self.bias[start:]
        packed = self.packed
        if (
            _takes_packed(x, self.weight, packed)
            and start % kernels.PANEL == 0
            and packed.runs_panels(x.numel() // x.shape[-1])
        ):
            panels = packed.tensor[start // kernels.PANEL :]
            return kernels.panel_linear(x, panels, bias, weight.shape[0])
        return F.linear(x, weight, bias)


def pack_weights(module: nn.Module, calibrate: bool = True) -> list[PackedWeight]:
    """Call `pack_weights()` on every submodule that has one (each `Linear`, and e.g. a model
    whose LM head reuses its embedding); with `calibrate`, a model whose packed weights reach
    `CALIBRATE_MIN_BYTES` then times from how many rows on they beat `F.linear`, from how many
    rows on panels should hand over to oneDNN, up to how many rows each kind of narrow panels
    pay, and which library GEMM runs float32 prompt chunks."""
    packed = [p for m in module.modules() if hasattr(m, "pack_weights") for p in m.pack_weights()]
    nbytes = sum(p.weight.numel() * p.weight.element_size() for p in packed)
    if calibrate and nbytes >= CALIBRATE_MIN_BYTES:
        calibration = _cached_calibration(packed, round(nbytes / 2**20))
        for p in packed:
            p.min_rows = calibration.min_rows
            p.hand_over(calibration.onednn_rows)
            p.large_rows_blas = calibration.large_rows_blas
            for bits, rows in calibration.narrow_rows.items():
                p.limit_narrow(bits, rows)
    return packed


@dataclass(frozen=True)
class Calibration:
    """What `pack_weights` measures once per model and machine (cached)."""

    min_rows: int  # packed from this many rows on
    onednn_rows: int  # panels hand over to oneDNN from this many rows on
    narrow_rows: dict[int, int]  # narrow panels of each kind (bits) read up to this many rows
    large_rows_blas: bool  # float32 prompt chunks through `F.linear`'s BLAS, not oneDNN's GEMM


def _cached_calibration(packed: Sequence[PackedWeight], megabytes: int) -> Calibration:
    """`calibrate_min_rows(packed)`, `calibrate_onednn_rows(packed)`,
    `calibrate_narrow_rows(packed, bits)` for each kind and `calibrate_large_rows_blas(packed)`
    (where the hand-over leaves large rows to the plain weight), from the cache when this kind of
    machine has measured these weights before (it takes seconds), else measured and cached."""
    path = cache_root() / CALIBRATION_FILE
    key, described = _calibration_key(packed)
    cache = _read_calibrations(path)
    cached = _cached_entry(cache, key)
    if cached is not None:
        log.info(
            "linear.calibration_cached",
            weights=len(packed),
            megabytes=megabytes,
            packed_from_rows=cached.min_rows,
            onednn_from_rows=cached.onednn_rows,
            narrow_up_to_rows=cached.narrow_rows,
            large_rows_gemm=_gemm_name(cached.large_rows_blas),
            path=str(path),
        )
        return cached
    log.info("linear.calibrating", weights=len(packed), megabytes=megabytes, rows=CALIBRATION_ROWS)
    start, cpu_start = time.perf_counter(), time.process_time()
    min_rows = calibrate_min_rows(packed)
    narrow_rows = {bits: calibrate_narrow_rows(packed, bits) for bits in kernels.NARROW_BITS}
    for p in packed:  # the hand-over is timed on the panels as they will run
        for bits, rows in narrow_rows.items():
            p.limit_narrow(bits, rows)
    onednn_rows = calibrate_onednn_rows(packed)
    blas = onednn_rows >= PANEL_MAX_ROWS and calibrate_large_rows_blas(packed)
    calibration = Calibration(min_rows, onednn_rows, narrow_rows, blas)
    wall = time.perf_counter() - start
    cpu_share = (time.process_time() - cpu_start) / (max(wall, 1e-9) * torch.get_num_threads())
    seconds = round(wall, 2)
    log.info(
        "linear.packed",
        weights=len(packed),
        megabytes=megabytes,
        packed_from_rows=min_rows,
        onednn_from_rows=onednn_rows,
        narrow_up_to_rows=narrow_rows,
        large_rows_gemm=_gemm_name(blas),
        calibration_seconds=seconds,
        cpu_share=round(cpu_share, 2),
    )
    if wall >= MIN_JUDGED_CALIBRATION_S and cpu_share < MIN_CALIBRATION_CPU_SHARE:
        log.warning(
            "linear.calibration_not_cached",
            reason="other processes used the cores while it ran; the next start measures again",
            cpu_share=round(cpu_share, 2),
            threads=torch.get_num_threads(),
        )
        return calibration
    rows = {
        "min_rows": min_rows,
        "onednn_rows": onednn_rows,
        "narrow_rows": {str(bits): rows for bits, rows in narrow_rows.items()},
        "large_rows_blas": blas,
    }
    cache[key] = {**described, **rows, "seconds": seconds}
    _write_calibrations(path, cache)
    return calibration


def _calibration_key(packed: Sequence[PackedWeight]) -> tuple[str, dict[str, Any]]:
    """What a calibration holds for: the CPU model, the thread count, the kernel library (or
    none), torch's version and the packed weights' shapes and kinds (panels, narrow panels'
    bits); hashed, and the readable part."""
    described = {
        "cpu": kernels.cpu_model(),
        "threads": torch.get_num_threads(),
        "kernels": kernels.library_key() if kernels.load() is not None else None,
        "torch": torch.__version__,
    }
    weights = [
        [
            *p.weight.shape,
            str(p.weight.dtype).removeprefix("torch."),
            p.panels,
            p.bits,
        ]
        for p in packed
    ]
    rules = [
        CALIBRATION_ROWS,
        ONEDNN_CALIBRATION_ROWS,
        ONEDNN_MARGIN,
        NARROW_CALIBRATION_ROWS,
        NARROW_MARGIN,
        BLAS_CALIBRATION_ROWS,
        BLAS_MARGIN,
    ]
    identity = json.dumps([described, weights, rules]).encode()
    return hashlib.sha256(identity).hexdigest()[:16], described


def _cached_entry(cache: dict[str, Any], key: str) -> Calibration | None:
    """The entry's calibration, or None where a field is missing or not a row count (an entry
    from before a field was calibrated is measured again)."""
    entry = cache.get(key)
    if not isinstance(entry, dict):
        return None
    min_rows, onednn_rows = entry.get("min_rows"), entry.get("onednn_rows")
    narrow, blas = entry.get("narrow_rows"), entry.get("large_rows_blas")
    if not (
        type(min_rows) is int
        and type(onednn_rows) is int
        and isinstance(narrow, dict)
        and type(blas) is bool
    ):
        return None
    narrow_rows = {bits: narrow.get(str(bits)) for bits in kernels.NARROW_BITS}
    if min(min_rows, onednn_rows) < 1 or not all(
        type(r) is int and r >= 0 for r in narrow_rows.values()
    ):
        return None
    return Calibration(min_rows, onednn_rows, narrow_rows, blas)  # type: ignore[arg-type]


def _gemm_name(blas: bool) -> str:
    return "blas" if blas else "onednn"


def _read_calibrations(path: Path) -> dict[str, Any]:
    """The cached calibrations; {} for a missing, unreadable or corrupt file (it only costs a
    calibration, never a start)."""
    try:
        cache = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("linear.calibration_cache_ignored", path=str(path), reason=str(exc))
        return {}
    if not isinstance(cache, dict):
        log.warning("linear.calibration_cache_ignored", path=str(path), reason="not an object")
        return {}
    return cache


def _write_calibrations(path: Path, cache: dict[str, Any]) -> None:
    """Replace the file atomically (workers may start together); a cache that cannot be
    written costs the next start a calibration, nothing more."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=path.parent, prefix=f".{path.name}.", delete=False
        ) as out:
            tmp = out.name
            json.dump(cache, out, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("linear.calibration_cache_unwritable", path=str(path), reason=str(exc))
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def calibrate_min_rows(
    packed: Sequence[PackedWeight], candidates: Sequence[int] = CALIBRATION_ROWS
) -> int:
    """The fewest rows in `candidates` at which one pass over all `packed` weights is faster
    packed than with `F.linear` (best of 3, alternating); twice the largest if none is.

    Panel-packed weights are used from one row without measuring: only they run the fused
    decode step, whose saved glue a GEMM's time does not show (float32 at batch 1 on a 2-core
    Sapphire Rapids machine, where MKL's GEMV beat the panels by 10% per pass: 35 tokens/s with
    panels from one row, 25 with `F.linear` below 4 rows)."""
    if any(p.panels for p in packed):
        return 1

    def passes(rows: int) -> dict[str, list[Callable[[], Any]]]:
        inputs = _constant_inputs(packed, rows)
        return {
            "plain": [partial(F.linear, x, p.weight) for p, x in zip(packed, inputs, strict=True)],
            "packed": [partial(p, x, None) for p, x in zip(packed, inputs, strict=True)],
        }

    rows = _fewest_rows(candidates, 1.0, "linear.calibration_step", passes)
    return 2 * candidates[-1] if rows is None else rows


def calibrate_onednn_rows(
    packed: Sequence[PackedWeight], candidates: Sequence[int] = ONEDNN_CALIBRATION_ROWS
) -> int:
    """The fewest rows in `candidates` from which oneDNN's GEMM on blocked copies of the
    panel-packed weights takes at most `ONEDNN_MARGIN` of the panel kernel's time for one pass
    over them (best of 3, alternating); `PANEL_MAX_ROWS` if it never does.

    The panels hold up to a few hundred rows on the CPUs measured so far (on AMX tiles in
    bfloat16 too); without the tiles, oneDNN's bfloat16 GEMM on them beat the AVX512_BF16
    panels 3.8x at 64 rows. The margin (`ONEDNN_MARGIN`) keeps the panels where oneDNN's gain
    would not pay for leaving the fused decode step."""
    panels = [p for p in packed if p.panels and p.large_rows_onednn]
    if not panels:
        return PANEL_MAX_ROWS
    blocked = [torch.ops.mkldnn._reorder_linear_weight(p.weight.detach()) for p in panels]

    def passes(rows: int) -> dict[str, list[Callable[[], Any]]]:
        inputs = _constant_inputs(panels, rows)
        return {
            "panels": [
                partial(
                    kernels.panel_linear,
                    x,
                    p.tensor,
                    None,
                    p.weight.shape[0],
                    *p.narrow_for(rows),
                )
                for p, x in zip(panels, inputs, strict=True)
            ],
            "onednn": [partial(_onednn_linear, x, b) for x, b in zip(inputs, blocked, strict=True)],
        }

    rows = _fewest_rows(candidates, ONEDNN_MARGIN, "linear.onednn_calibration_step", passes)
    return PANEL_MAX_ROWS if rows is None else rows


def calibrate_narrow_rows(
    packed: Sequence[PackedWeight], bits: int, candidates: Sequence[int] = NARROW_CALIBRATION_ROWS
) -> int:
    """The most rows at which the narrow panels of kind `bits` of `packed` (those that have
    them) still beat their float32 panels: the candidate before the first at which one pass
    over them on the float32 panels takes at most `NARROW_MARGIN` of their time (best of 3,
    alternating), half the first candidate if that is the first; the kernel's limit
    (`kernels.linear_narrow_max_rows`) if they always win or none has such panels (nothing to
    measure). Whether they win at one to three rows is not asked: one row reads a sixth
    (4-bit), 17/64 (8-bit) or half (16-bit) of the bytes (4-bit 1.97x faster on the Zen 4
    above, 1.57x on the Zen 1)."""
    limit = kernels.linear_narrow_max_rows(bits)
    narrow = [p for p in packed if p.narrow is not None and p.bits == bits]
    candidates = [rows for rows in candidates if rows <= limit]
    if not narrow or not candidates:
        return limit

    def passes(rows: int) -> dict[str, list[Callable[[], Any]]]:
        inputs = _constant_inputs(narrow, rows)
        calls = {f"{bits}-bit": [], "float32": []}
        for p, x in zip(narrow, inputs, strict=True):
            n = p.weight.shape[0]
            calls[f"{bits}-bit"].append(
                partial(kernels.panel_linear, x, p.tensor, None, n, p.narrow, bits)
            )
            calls["float32"].append(partial(kernels.panel_linear, x, p.tensor, None, n))
        return calls

    rows = _fewest_rows(candidates, NARROW_MARGIN, f"linear.narrow_calibration_step_{bits}", passes)
    if rows is None:
        return limit
    earlier = [r for r in candidates if r < rows]
    return earlier[-1] if earlier else rows // 2


def calibrate_large_rows_blas(
    packed: Sequence[PackedWeight], rows: int = BLAS_CALIBRATION_ROWS
) -> bool:
    """Whether `F.linear` (the BLAS torch was built with) runs the float32 panel-packed weights
    at `rows` rows in at most `BLAS_MARGIN` of oneDNN's time on their plain layout: one weight
    of each shape timed (best of 3, alternating; a GEMM of that many rows is bound by its
    arithmetic, so repeats of a shape would time the same), weighted by how many there are.
    False where there is no such weight."""
    weights = [
        p for p in packed if p.panels and p.large_rows_onednn and p.weight.dtype == torch.float32
    ]
    shapes = Counter(tuple(p.weight.shape) for p in weights)
    if not shapes:
        return False
    one_each = list({tuple(p.weight.shape): p for p in weights}.values())
    inputs = _constant_inputs(one_each, rows)
    onednn = blas = 0.0
    for p, x in zip(one_each, inputs, strict=True):
        count = shapes[tuple(p.weight.shape)]
        first, second = _best_passes(
            [partial(_onednn_linear, x, p.weight)], [partial(F.linear, x, p.weight)]
        )
        onednn, blas = onednn + count * first, blas + count * second
    log.debug(
        "linear.blas_calibration_step",
        rows=rows,
        onednn_ms=round(onednn * 1e3, 2),
        blas_ms=round(blas * 1e3, 2),
    )
    return blas <= BLAS_MARGIN * onednn


def _fewest_rows(
    candidates: Sequence[int],
    share: float,
    event: str,
    passes: Callable[[int], dict[str, list[Callable[[], Any]]]],
) -> int | None:
    """The fewest rows in `candidates` at which the second of the two named `passes` for that
    many rows takes at most `share` of the first's time (best of 3, alternating); None if it
    never does. Each row count's times are logged at debug as `event`."""
    for rows in candidates:
        named = passes(rows)
        best = _best_passes(*named.values())
        times = {f"{name}_ms": round(t * 1e3, 2) for name, t in zip(named, best, strict=True)}
        log.debug(event, rows=rows, **times)
        first, second = best
        if second <= share * first:
            return rows
    return None


def _constant_inputs(packed: Sequence[PackedWeight], rows: int) -> list[torch.Tensor]:
    """An input of `rows` rows for each of `packed` (one per in_features and dtype): constant,
    since GEMM time does not depend on values, and so that loading a model draws no random
    numbers."""
    shared: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    for p in packed:
        key = (p.weight.shape[1], p.weight.dtype)
        if key not in shared:
            shared[key] = torch.full((rows, key[0]), 0.5, dtype=key[1])
    return [shared[p.weight.shape[1], p.weight.dtype] for p in packed]


def _best_passes(
    *passes: Sequence[Callable[[], Any]], before: Callable[[], Any] | None = None
) -> list[float]:
    """The best time of each pass (a call per weight) over 3 alternating rounds, `before`
    (untimed) ahead of every pass.

    A pass streams every weight once, as a decode step does, so memory bandwidth is part of
    what is measured rather than weights sitting in cache; a pass of one weight that fits in
    cache needs a `before` that flushes it."""
    best = [float("inf")] * len(passes)
    for _ in range(3):
        for i, calls in enumerate(passes):
            if before is not None:
                before()
            start = time.perf_counter()
            for call in calls:
                call()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """oneDNN's GEMM on `weight`, blocked (`_reorder_linear_weight`) or plain."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
