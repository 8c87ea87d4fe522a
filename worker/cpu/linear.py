"""Linear layers whose weights are laid out once, at load time, for a fast CPU matmul.

On CPU, torch's default `F.linear` runs a GEMM that reads the weight in its plain layout on
every call, which is slow for the few rows of a decode step. So each weight gets a packed copy:

- on AVX-512 CPUs (and in float32 on AVX2 ones with FMA), panels for specserve's own kernel
  (`kernels.panel_linear`): it streams each weight once per 16 rows at about the CPU's peak.
  For SmolLM2's 121 matmuls (LM head included) on a 2-core AMD Zen 4: 23.6 ms at 16 rows in
  float32 (oneDNN packed: 29.7 ms) and 13.1 ms in bfloat16 (17.3 ms); 11.8 ms (20.7 ms) at one
  row; on par (+-10%) at 64 to 256 rows. On a 2-core AMD Zen 1 (AVX2, float32): 27.4 ms at one
  row (34.3), 70.2 ms at 16 (91.6), 245 ms at 64 (261) (`bench/linear.py`,
  docs/benchmarks.md). From `PANEL_MAX_ROWS` rows on (prompt chunks) oneDNN's GEMM on the
  plain weight takes over: streaming each weight once per 16 rows stops paying there, and in a
  real prefill between the model's other ops the panels ran at about 290 GFLOP/s where oneDNN
  ran at about 450 (64 ShareGPT prompts: 1,000 prompt tokens/s against 1,540 in float32, 1,600
  against 2,400 in bfloat16). oneDNN is reached through `F.linear` in bfloat16 and
  `torch.ops.mkldnn._linear_pointwise` in float32, whose `F.linear` goes to a slower GEMM (860
  tokens/s); both reorder the weight per call, which costs little beside a GEMM of that many
  rows and needs no third copy of the weights.
- elsewhere, oneDNN's blocked layout (`torch.ops.mkldnn`), 1.5-3x faster than `F.linear` at
  16 rows (13.6 ms instead of 40.6 ms on a Zen 5 machine, 36 ms instead of 57 ms on an Intel
  one; see docs/benchmarks.md).

The math is the same matmul in the same dtype; only the summation order differs (|diff| ~1e-6
in float32; bfloat16 results are rounded once from a float32 sum, as oneDNN does).

Which path wins at a handful of rows depends on the CPU (on the Intel machine, MKL's plain GEMV
beats oneDNN's packed weights up to 3 rows). So a model large enough for it to matter times
both over its own weights at load (`calibrate_min_rows`) and each packed weight remembers from
how many rows on it is used. That takes seconds (tens on a small CPU with a model of a few
hundred MB), so it is logged while it runs and its result is cached per CPU model, thread
count, kernel library and weight shapes in `$SPECSERVE_CACHE_DIR/linear_calibration.json`: the
next start of the same model on the same kind of machine skips it.

The plain weight stays where it is, because drafters and tests read it; the packed copy is used
by `forward` only, so a packed model holds its linear weights twice. CUDA, float16 and float64
weights, and CPUs with neither path, keep `F.linear`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from specserve.shared.paths import cache_root
from specserve.worker.cpu import kernels

log = structlog.get_logger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Models whose packed weights are smaller than this keep the default (packed from 1 row): their
# matmuls are too short for the choice to matter, and tests of small models stay deterministic.
CALIBRATE_MIN_BYTES = 32 * 2**20
CALIBRATION_ROWS = (1, 2, 4, 8, 16)
PANEL_MAX_ROWS = 256  # from this many rows on, panel-packed weights run oneDNN's GEMM instead
CALIBRATION_FILE = "linear_calibration.json"  # in `cache_root()`


@dataclass(eq=False)
class PackedWeight:
    """`weight` laid out for a CPU GEMM (`tensor`): panels for `kernels.panel_linear`, else
    oneDNN's blocked layout; used for inputs of at least `min_rows` rows."""

    tensor: torch.Tensor
    weight: torch.Tensor
    min_rows: int = 1
    panels: bool = False

    large_rows_onednn: bool = False  # panels hand PANEL_MAX_ROWS rows and more to oneDNN

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.panels:
            return torch.ops.mkldnn._linear_pointwise(x, self.tensor, bias, "none", [], "")
        if self.large_rows_onednn and x.numel() >= PANEL_MAX_ROWS * x.shape[-1]:
            if x.dtype == torch.bfloat16:
                return F.linear(x, self.weight, bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")
        return kernels.panel_linear(x, self.tensor, bias, self.weight.shape[0])


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


def _onednn_runs(weight: torch.Tensor) -> bool:
    """A CPU fp32/bf16 matrix on a build with oneDNN (bf16 only on CPUs with the instructions
    oneDNN's bf16 kernels need)."""
    if not (
        weight.device.type == "cpu"
        and weight.dtype in _PACKABLE_DTYPES
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_weight(weight: torch.Tensor, min_rows: int = 1) -> PackedWeight | None:
    """The weight laid out for the panel kernel or oneDNN, or None where `F.linear` must be
    used."""
    if _panel_kernel_runs(weight):
        panels = kernels.pack_panels(weight)
        return PackedWeight(
            panels, weight, min_rows, panels=True, large_rows_onednn=_onednn_runs(weight)
        )
    if not _onednn_runs(weight):
        return None
    try:
        tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except RuntimeError:  # a CPU or build oneDNN turns down: the plain path still works
        return None
    return PackedWeight(tensor, weight, min_rows)


def pack_again(packed: PackedWeight | None, weight: torch.Tensor) -> PackedWeight | None:
    """`weight` packed with `packed`'s `min_rows`, if `packed` is in use (after `weight` was
    moved, cast or reloaded); None stays None."""
    return None if packed is None else pack_weight(weight, packed.min_rows)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the packed weight when there is one, `x` has at
    least its `min_rows` rows, and `x` is a CPU tensor of the weight's dtype (otherwise
    `F.linear` gives its usual clear error)."""
    if (
        packed is None
        or x.numel() < packed.min_rows * x.shape[-1]
        or x.dtype != weight.dtype
        or x.device.type != "cpu"
    ):
        return F.linear(x, weight, bias)
    return packed(x, bias)


class Linear(nn.Linear):
    """`nn.Linear` that uses a packed copy of its weight once `pack_weights()` has made one.

    Moving or casting the module (`.to()`, `.half()`, ...) or loading a state dict into it
    packs the new weight again, so the copy never goes stale.
    """

    packed: PackedWeight | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_load_state_dict_post_hook(lambda module, _: module.repack())

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


def pack_weights(module: nn.Module, calibrate: bool = True) -> list[PackedWeight]:
    """Call `pack_weights()` on every submodule that has one (each `Linear`, and e.g. a model
    whose LM head reuses its embedding); with `calibrate`, a model whose packed weights reach
    `CALIBRATE_MIN_BYTES` then times from how many rows on they beat `F.linear`."""
    packed = [p for m in module.modules() if hasattr(m, "pack_weights") for p in m.pack_weights()]
    nbytes = sum(p.weight.numel() * p.weight.element_size() for p in packed)
    if calibrate and nbytes >= CALIBRATE_MIN_BYTES:
        min_rows = _cached_min_rows(packed, round(nbytes / 2**20))
        for p in packed:
            p.min_rows = min_rows
    return packed


def _cached_min_rows(packed: Sequence[PackedWeight], megabytes: int) -> int:
    """`calibrate_min_rows(packed)`, from the cache when this kind of machine has measured
    these weights before (it takes seconds), else measured and cached."""
    path = cache_root() / CALIBRATION_FILE
    key, described = _calibration_key(packed)
    cache = _read_calibrations(path)
    min_rows = _cached_entry(cache, key)
    if min_rows is not None:
        log.info(
            "linear.calibration_cached",
            weights=len(packed),
            megabytes=megabytes,
            packed_from_rows=min_rows,
            path=str(path),
        )
        return min_rows
    log.info("linear.calibrating", weights=len(packed), megabytes=megabytes, rows=CALIBRATION_ROWS)
    start = time.perf_counter()
    min_rows = calibrate_min_rows(packed)
    seconds = round(time.perf_counter() - start, 2)
    log.info(
        "linear.packed",
        weights=len(packed),
        megabytes=megabytes,
        packed_from_rows=min_rows,
        calibration_seconds=seconds,
    )
    cache[key] = {**described, "min_rows": min_rows, "seconds": seconds}
    _write_calibrations(path, cache)
    return min_rows


def _calibration_key(packed: Sequence[PackedWeight]) -> tuple[str, dict[str, Any]]:
    """What a calibration holds for: the CPU model, the thread count, the kernel library (or
    none), torch's version and the packed weights' shapes; hashed, and the readable part."""
    described = {
        "cpu": kernels.cpu_model(),
        "threads": torch.get_num_threads(),
        "kernels": kernels.library_key() if kernels.load() is not None else None,
        "torch": torch.__version__,
    }
    weights = [
        [*p.weight.shape, str(p.weight.dtype).removeprefix("torch."), p.panels] for p in packed
    ]
    identity = json.dumps([described, weights, CALIBRATION_ROWS]).encode()
    return hashlib.sha256(identity).hexdigest()[:16], described


def _cached_entry(cache: dict[str, Any], key: str) -> int | None:
    entry = cache.get(key)
    min_rows = entry.get("min_rows") if isinstance(entry, dict) else None
    return min_rows if type(min_rows) is int and min_rows >= 1 else None


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

    The pass streams every weight once, as a decode step does, so memory bandwidth is part of
    what is measured rather than weights sitting in cache."""
    for rows in candidates:
        inputs = {  # constant inputs: GEMM time does not depend on values; no RNG draws
            (p.weight.shape[1], p.weight.dtype): torch.full(
                (rows, p.weight.shape[1]), 0.5, dtype=p.weight.dtype
            )
            for p in packed
        }
        best = [float("inf"), float("inf")]
        for _ in range(3):
            for i, use_packed in enumerate((False, True)):
                start = time.perf_counter()
                for p in packed:
                    x = inputs[(p.weight.shape[1], p.weight.dtype)]
                    p(x, None) if use_packed else F.linear(x, p.weight)
                best[i] = min(best[i], time.perf_counter() - start)
        log.debug(
            "linear.calibration_step",
            rows=rows,
            plain_ms=round(best[0] * 1e3, 2),
            packed_ms=round(best[1] * 1e3, 2),
        )
        if best[1] <= best[0]:
            return rows
    return 2 * candidates[-1]
