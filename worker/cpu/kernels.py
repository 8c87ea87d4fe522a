"""Compiled CPU kernels (`csrc/*.c`): built once with the system C compiler, loaded with ctypes.

- `paged_decode_attention`: decoding with SDPA first gathers every request's K and V pages into
  a padded batch, so each layer copies the whole context and then reads it again, and the
  padding grows with the longest request (at 16 requests of 1k tokens, about 70% of a
  step). The kernel reads the pages where they lie, once.
- `paged_prefill_attention`: every multi-row query of a step (prompt chunks, verification and
  draft blocks) in one call per layer, read from the pages where they lie, with the scores
  and the running softmax in registers (AVX-512, or AVX2 with FMA): 1.1-2.4x SDPA's flash
  kernel on 40-1,024-row prompts at head dim 64, which also needs the pages gathered first
  (docs/benchmarks.md).
- `panel_linear`: `y = x W^T + b` for the few rows of a decode step (AVX-512, or AVX2 with
  FMA), over weights laid out once in panels of 16 output columns (`pack_panels`).
  A step streams every weight of the model from memory; the kernel streams each panel once
  per 28 rows (6 with AVX2), at about the CPU's peak: 1.2-1.8x oneDNN's packed GEMM up to 16
  rows, on par beyond, on AVX-512 (`worker.linear`). On CPUs with AMX tiles bfloat16 inputs of
  any number of rows multiply on the tiles (`linear_amx_min_rows`).
- `add_rms_norm`, `silu_mul` and `rope_write_kv` (q/k norms, RoPE and the K/V cache write): a
  decoder layer's element-wise glue, which PyTorch runs as 3-9 small ops each (a dispatch and
  a pass over memory apiece), in one call.
- `decode_layers`: a whole decode step, every layer, in one call (`worker.fused_decode`).
- `argmax_rows`: greedy picks over vocabulary-wide rows, ~10x PyTorch's `max` on CPU, and
  `screen_argmax`: the greedy screen's tokens from its screened logits
  (`worker.cpu.greedy_screen`), whose int8 copy of the head `int8_panel_linear` reads.

Each kernel's body is a "team" function (`csrc/team.h`) that the threads of one OpenMP team
share, so the standalone calls above and the fused decode step run the same code.

The C files are compiled (`$CC`, else `cc`/`gcc`) into one library in the kernels directory
(`$SPECSERVE_KERNELS_DIR`, default `$SPECSERVE_CACHE_DIR/kernels`, i.e.
`~/.cache/specserve/kernels`), named by a key of the sources, the flags and the CPU's features,
and reused afterwards. `specserve kernels build` (`build`) fills the directory ahead of time, e.g.
in an image build: a library found there is loaded as it is, with no compiler and no write
access, so a read-only root filesystem keeps the fast path. Otherwise it is built on first use.
Where it can be neither found nor built (no compiler, a read-only directory), or with
`SPECSERVE_CPU_KERNELS=0`, the callers keep their PyTorch paths (same results up to float32
summation order), and the log says why once (`kernels.unavailable`, `kernels.disabled`). The
kernels run on torch's own OpenMP threads: the library's `libgomp.so.1` resolves to the copy
torch has already loaded.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import structlog
import torch
import torch.nn.functional as F

from specserve.shared.paths import cache_root

log = structlog.get_logger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(sorted(CSRC.glob("*.c")))  # compiled into one library
# -ffast-math only when compiling (vectorised expf and reductions); linking without it keeps
# crtfastmath.o, which would set flush-to-zero for the whole process, out of the library.
# No implicit fused multiply-adds: element-wise math (RoPE) then rounds as PyTorch's separate
# ops do; the matmul and attention kernels ask for theirs explicitly.
COMPILE_FLAGS = (
    "-O3", "-march=native", "-ffast-math", "-ffp-contract=off", "-fopenmp", "-fPIC", "-std=c11",
)  # fmt: skip
LINK_FLAGS = ("-shared", "-fopenmp", "-lm")
DTYPES = (torch.float32, torch.bfloat16)
_C_INT64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class KernelsUnavailable(Exception):
    """Why the library can be neither found nor built: the `kernels.unavailable` reason."""


class DecodeLayer(NamedTuple):
    """One row of `decode_layers`' layer table: a layer's weight addresses (0: no such bias or
    norm; None: the weight does not fit the kernel) and its KV group."""

    input_norm: int | None
    qkv: int | None
    qkv_bias: int | None
    q_norm: int | None
    k_norm: int | None
    o: int | None
    o_bias: int | None
    post_norm: int | None
    gate_up: int | None
    gate_up_bias: int | None
    down: int | None
    down_bias: int | None
    qkv_narrow: int  # narrow panels of the weight above (0: none), `PackedWeight.narrow`
    qkv_bits: int  # ... their kind (`PackedWeight.bits`; 0: none)
    o_narrow: int
    o_bits: int
    gate_up_narrow: int
    gate_up_bits: int
    down_narrow: int
    down_bits: int
    group: int


class DecodeGroup(NamedTuple):
    """One row of `decode_layers`' KV group table: the step's metadata for the group."""

    k_rows: int
    pages: int
    max_pages: int
    first_pos: int
    seq_lens: int
    window: int


class DecodeDims(NamedTuple):
    """`decode_layers`' sizes of the step and the model, and the first layer's input if given."""

    rows: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    block_size: int
    num_blocks: int
    is_bf16: int
    attn_input: int  # the first layer's attention input (0: rms_norm of the residual stream)
    attn_in: int  # ... its values a row


class DraftChain(NamedTuple):
    """`draft_chain`'s table: an EAGLE-3 drafter's greedy chain besides its layers."""

    depths: int
    num_groups: int  # KV group rows per depth in the group table
    embed: int  # the token embedding table, [embed_rows, hidden]
    embed_rows: int
    embed_bf16: int  # the table's dtype (the drafter's may differ: cast as PyTorch casts)
    input_norm: int  # the first layer's norm of the embeddings
    hidden_norm: int  # ... and of the hidden state
    norm_before_residual: int
    head: int  # the draft head's panels, [draft_vocab, hidden]
    head_narrow: int  # its narrow panels (0: none)
    head_bits: int
    draft_vocab: int
    draft_to_target: int  # [draft_vocab] int64 target ids


# The column order of each table `decode_layers` reads, by the number `decode_table_fields`
# takes: the rows are built by name from these, and a library whose columns are named otherwise
# is refused (a column out of place would read one weight as another, silently).
DECODE_TABLES: dict[str, tuple[str, ...]] = {
    "layer": DecodeLayer._fields,
    "group": DecodeGroup._fields,
    "dims": DecodeDims._fields,
    "chain": DraftChain._fields,  # `draft_chain`'s own
}


def enabled() -> bool:
    return os.environ.get("SPECSERVE_CPU_KERNELS", "1") != "0"


def kernels_dir() -> Path:
    """Where the library is looked for and built: `$SPECSERVE_KERNELS_DIR`, which may be
    filled ahead of time and read-only, else the cache's `kernels`."""
    configured = os.environ.get("SPECSERVE_KERNELS_DIR")
    return Path(configured) if configured else cache_root() / "kernels"


def _compiler() -> str | None:
    """`$CC` (a name on PATH or a path), else `cc` or `gcc`; None where there is none."""
    named = os.environ.get("CC")
    if named:
        return shutil.which(named)
    return shutil.which("cc") or shutil.which("gcc")


def _cpu_signature() -> str:
    """The CPU's feature flags: a library built with -march=native must not move to another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_model() -> str:
    """The CPU's model name (what a timing measured on it holds for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Hardware", "CPU part")):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def library_key() -> str:
    """The library's identity: its sources and headers, the flags and the CPU's features (not
    the compiler, so that a library built ahead of time is found where there is none)."""
    inputs = sorted(CSRC.glob("*.[ch]"))  # the sources and the headers they include
    flags = " ".join(COMPILE_FLAGS + LINK_FLAGS)
    parts = [*(path.read_bytes() for path in inputs), flags.encode(), _cpu_signature().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def library_path(directory: Path | None = None) -> Path:
    """The library for this CPU in `directory` (default `kernels_dir()`), there or not."""
    return (directory or kernels_dir()) / f"specserve_kernels-{library_key()}.so"


def build(directory: Path | None = None, force: bool = False) -> Path:
    """Compile the library into `directory` (default `kernels_dir()`) unless it is there (or
    `force`), atomically: concurrent workers may build at once. Raises `KernelsUnavailable`."""
    target = library_path(directory)
    if target.exists() and not force:
        return target
    compiler = _compiler()
    if compiler is None:
        named = os.environ.get("CC")
        raise KernelsUnavailable(
            f"no C compiler (CC={named} not found)" if named else "no C compiler (set CC)"
        )
    start = time.perf_counter()
    tmp = _scratch_dir(target.parent)
    try:
        _compile(compiler, Path(tmp), target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("kernels.built", path=str(target), seconds=round(time.perf_counter() - start, 2))
    return target


def status(directory: Path | None = None) -> dict[str, str]:
    """Where the library is looked for, whether this CPU's is there (others are for other CPUs
    or sources) and whether one could be built: `specserve kernels status`."""
    directory = directory or kernels_dir()
    target = library_path(directory)
    found = sorted(directory.glob("specserve_kernels-*.so")) if directory.is_dir() else []
    if not directory.exists():
        access = "missing"
    else:
        access = "writable" if os.access(directory, os.W_OK) else "read-only"
    return {
        "directory": f"{directory} ({access})",
        "library": f"{target.name} ({'present' if target in found else 'missing'})",
        "other libraries": ", ".join(p.name for p in found if p != target) or "none",
        "compiler": _compiler() or "none",
        "enabled": "yes" if enabled() else "no (SPECSERVE_CPU_KERNELS=0)",
    }


def _scratch_dir(directory: Path) -> str:
    """A temporary folder in `directory`, so the library lands there by a rename."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return tempfile.mkdtemp(dir=directory)
    except OSError as exc:
        raise KernelsUnavailable(
            f"{directory} is not writable ({exc.strerror or exc}); "
            "`specserve kernels build` fills it ahead of time"
        ) from None


def _compile(
    compiler: str,
    tmp: Path,
    target: Path,
    flags: Sequence[str] = COMPILE_FLAGS,
    sources: Sequence[Path] = SOURCES,
) -> None:
    """Every source into `target`, objects in `tmp`. The tests pass other `flags` to build the
    AVX2 bodies on an AVX-512 CPU; `bench/decode_attention.py` other `sources` (another
    revision's)."""
    objects = [str(tmp / f"{src.stem}.o") for src in sources]
    commands = [
        [compiler, *flags, "-c", str(src), "-o", obj]
        for src, obj in zip(sources, objects, strict=True)
    ]
    lib = tmp / target.name
    commands.append([compiler, *objects, *LINK_FLAGS, "-o", str(lib)])
    try:
        for cmd in commands:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(lib, target)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        raise KernelsUnavailable(
            f"compiling with {compiler} failed: {detail.strip()[-500:]}"
        ) from None


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, found or built; None (logged once) where it cannot be had. A
    library whose tables differ from `DECODE_TABLES` raises: that is a broken build."""
    if not enabled():
        log.info("kernels.disabled", reason="SPECSERVE_CPU_KERNELS=0")
        return None
    try:
        return _open_or_build()
    except KernelsUnavailable as exc:
        log.warning("kernels.unavailable", reason=str(exc))
        return None


def _open_or_build() -> ctypes.CDLL:
    """The library in `kernels_dir()` if it loads, else one built there now."""
    target = library_path()
    if not target.exists():
        why = f"no library for this CPU ({target.name}) in {target.parent}"
        return open_library(_build_for_load(target, why, force=False))
    try:
        return open_library(target)
    except KernelsUnavailable as exc:  # e.g. a truncated file left there: build it again, once
        return open_library(_build_for_load(target, str(exc), force=True))


def _build_for_load(target: Path, why: str, force: bool) -> Path:
    try:
        return build(target.parent, force=force)
    except KernelsUnavailable as exc:
        raise KernelsUnavailable(f"{why}, and it cannot be built: {exc}") from None


def open_library(path: Path) -> ctypes.CDLL:
    """The library at `path`, its functions declared and its tables checked."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelsUnavailable(f"{path} does not load: {exc}") from None
    i64, f32, flag = _C_INT64, ctypes.c_float, ctypes.c_int
    signatures = {
        "paged_decode_attention": (
            ctypes.c_int,
            [_PTR, i64, _PTR, i64, _PTR, _PTR, _PTR, _PTR, *[i64] * 7, f32, flag],
        ),
        "add_rms_norm": (None, [_PTR, i64, _PTR, i64, _PTR, _PTR, _PTR, i64, i64, f32, flag]),
        "silu_mul": (None, [_PTR, i64, _PTR, i64, i64, flag]),
        "linear_kernel_dtypes": (ctypes.c_int, []),
        "linear_enable_amx": (ctypes.c_int, []),
        "linear_amx_min_rows": (i64, []),
        "linear_widens_bf16": (ctypes.c_int, []),
        "linear_vector_bits": (ctypes.c_int, []),
        "linear_row_tiles": (i64, [i64, i64, flag, flag]),
        "panel_linear": (
            ctypes.c_int,
            [_PTR, i64, _PTR, _PTR, flag, _PTR, _PTR, i64, i64, i64, flag],
        ),
        "linear_narrow_max_rows": (i64, [flag]),
        "int8_panel_linear": (None, [_PTR, i64, _PTR, _PTR, _PTR, i64, i64, i64]),
        "rope_write_kv": (
            ctypes.c_int,
            [_PTR, *[i64] * 5, *[_PTR] * 4, f32, _PTR, i64, _PTR, i64, flag],
        ),
        "decode_layers": (ctypes.c_int, [_PTR, i64, *[_PTR] * 9, f32, f32, _PTR]),
        "draft_chain": (ctypes.c_int, [_PTR, i64, *[_PTR] * 10, f32, f32, _PTR]),
        "decode_table_fields": (ctypes.c_char_p, [ctypes.c_int]),
        "argmax_rows": (None, [_PTR, i64, i64, i64, _PTR, flag]),
        "screen_argmax": (
            ctypes.c_int,
            [_PTR, *[i64] * 3, _PTR, i64, i64, flag, _PTR, f32, ctypes.c_double, _PTR, i64, _PTR],
        ),
        "paged_prefill_supported": (ctypes.c_int, []),
        "paged_prefill_on_tiles": (ctypes.c_int, [i64, flag]),
        "paged_prefill_attention": (
            ctypes.c_int,
            [_PTR, i64, _PTR, i64, _PTR, i64, _PTR, i64, _PTR, *[i64] * 5, f32, flag],
        ),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    check_decode_tables(lib)
    lib.linear_enable_amx()
    return lib


def check_decode_tables(
    lib: ctypes.CDLL, tables: dict[str, tuple[str, ...]] = DECODE_TABLES
) -> None:
    """Raise unless each of `decode_layers`' tables has, in the library, the columns `tables`
    names, by name and in order."""
    for number, (table, fields) in enumerate(tables.items()):
        raw = lib.decode_table_fields(number)
        c_fields = tuple(raw.decode().rstrip(",").split(",")) if raw else ()
        if c_fields != fields:
            raise RuntimeError(
                f"decode_layers' {table} table: the C library's columns {list(c_fields)} are "
                f"not Python's {list(fields)} (csrc/decode_step.c and worker/cpu/kernels.py "
                "must name the same fields in the same order)"
            )


def rows_supported(*tensors: torch.Tensor) -> bool:
    """Whether the row-wise kernels can take these tensors: CPU, float32/bfloat16, one dtype,
    2-D with contiguous rows (rows themselves may be strided)."""
    dtype = tensors[0].dtype
    return (
        dtype in DTYPES
        and all(
            t.device.type == "cpu" and t.dtype == dtype and t.dim() == 2 and t.stride(1) == 1
            for t in tensors
        )
        and load() is not None
    )


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(s, rms_norm(s) * weight)` for `s = x + delta` (`s = x` without delta); `[T, H]` rows.
    Call `rows_supported` first."""
    lib = load()
    assert lib is not None, "add_rms_norm called where rows_supported() is False"
    rows, dim = x.shape
    if weight.shape != (dim,) or (delta is not None and delta.shape != x.shape):
        raise ValueError(
            f"add_rms_norm: x {tuple(x.shape)}, delta "
            f"{None if delta is None else tuple(delta.shape)}, weight {tuple(weight.shape)}"
        )
    out = torch.empty((rows, dim), dtype=x.dtype)
    total = x if delta is None else torch.empty((rows, dim), dtype=x.dtype)
    lib.add_rms_norm(
        x.data_ptr(),
        x.stride(0),
        None if delta is None else delta.data_ptr(),
        0 if delta is None else delta.stride(0),
        total.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        dim,
        eps,
        int(x.dtype == torch.bfloat16),
    )
    return total, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up = [gate | up]` (`[T, 2I]` -> `[T, I]`). Call
    `rows_supported` first."""
    lib = load()
    assert lib is not None, "silu_mul called where rows_supported() is False"
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    lib.silu_mul(
        gate_up.data_ptr(),
        gate_up.stride(0),
        out.data_ptr(),
        rows,
        width // 2,
        int(gate_up.dtype == torch.bfloat16),
    )
    return out


def rope_write_kv(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    kv_cache: torch.Tensor,
    k_rows: torch.Tensor,
) -> None:
    """In place on `qkv [T, (heads + 2 kv_heads) * D]` (`[q | k | v]`): per-head RMSNorm of q
    and k when their weights are given, RoPE with `rope_cos_sin`'s tables (`[T, 1, D]`), then K
    and V written to the layer's `kv_cache` at `k_rows` (`kv_write_rows`; V is `block_size`
    rows on). Call `rope_supported` first."""
    lib = load()
    assert lib is not None, "rope_write_kv called where rope_supported() is False"
    rows = qkv.shape[0]
    block_size, dim = kv_cache.shape[2], kv_cache.shape[4]
    if (
        qkv.shape[1] != (heads + 2 * kv_heads) * dim
        or kv_cache.shape[3] != kv_heads
        or cos.shape != (rows, 1, dim)
        or sin.shape != cos.shape
        or k_rows.shape != (rows,)
        or any(
            w is not None and (w.shape != (dim,) or w.dtype != qkv.dtype) for w in (q_norm, k_norm)
        )
        or sin.dtype != qkv.dtype
    ):
        raise ValueError(
            f"rope_write_kv: qkv {tuple(qkv.shape)} with {heads}/{kv_heads} heads, cos "
            f"{tuple(cos.shape)}, cache {tuple(kv_cache.shape)}, rows {tuple(k_rows.shape)}"
        )
    if k_rows.dtype != torch.int64 or k_rows.device.type != "cpu":
        raise ValueError("KV rows must be CPU int64")
    norms = [None if w is None else w.contiguous() for w in (q_norm, k_norm)]  # held: read
    tables = [t.contiguous() for t in (cos, sin)]
    rows_index = k_rows.contiguous()
    bad_rows = lib.rope_write_kv(
        qkv.data_ptr(),
        qkv.stride(0),
        rows,
        heads,
        kv_heads,
        dim,
        *(t.data_ptr() for t in tables),
        *(None if w is None else w.data_ptr() for w in norms),
        eps,
        kv_cache.data_ptr(),
        kv_cache.shape[0],
        rows_index.data_ptr(),
        block_size,
        int(qkv.dtype == torch.bfloat16),
    )
    if bad_rows:
        raise IndexError(kv_rows_error(bad_rows, kv_cache.shape[0]))


def kv_rows_error(bad_rows: int, num_blocks: int) -> str:
    return f"KV cache slots of {bad_rows} tokens lie outside the cache of {num_blocks} blocks"


def attention_error(failed: int) -> str:
    return (
        f"paged decode attention failed for {failed} (request, head) pairs: pages outside the "
        "cache or not covering the keys (or no scratch memory)"
    )


def rope_supported(qkv: torch.Tensor, cos: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether `rope_write_kv` can run this layer: CPU, float32/bfloat16, one dtype, `qkv` rows
    contiguous, the cache contiguous."""
    return (
        rows_supported(qkv)
        and cos.dtype == qkv.dtype
        and cos.device.type == "cpu"
        and kv_cache.dtype == qkv.dtype
        and kv_cache.device.type == "cpu"
        and kv_cache.is_contiguous()
    )


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of `[N, V]` rows (the first index on ties); rows holding NaN are left
    to `argmax`. Call `rows_supported` first."""
    lib = load()
    assert lib is not None, "argmax_rows called where rows_supported() is False"
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    if cols:
        lib.argmax_rows(
            x.data_ptr(), x.stride(0), rows, cols, out.data_ptr(), int(x.dtype == torch.bfloat16)
        )
    unsettled = out < 0
    if unsettled.any():
        out[unsettled] = x[unsettled].argmax(dim=-1)
    return out


def screen_argmax(
    x: torch.Tensor,
    screen: torch.Tensor,
    bounds: torch.Tensor,
    max_bound: float,
    margin: float,
    head_panels: torch.Tensor,
    max_candidates: int,
) -> torch.Tensor | None:
    """The greedy screen's tokens (`csrc/sampling.c` `screen_argmax`): for float32 rows `x [N,
    K]` and their screened logits `screen [N, V]` (`rows_supported`), each row's argmax of the
    float32 head packed as `head_panels` (`pack_panels`), first index on ties, from the columns
    whose bound `||x|| (1 + margin) bounds[j]` reaches the row's best; None where a row cannot
    be promised (a value not finite, more than `max_candidates` columns)."""
    lib = load()
    assert lib is not None, "screen_argmax called where rows_supported() is False"
    rows, k = x.shape
    cols = screen.shape[1]
    assert x.dtype == torch.float32 and x.stride(1) == 1 and screen.shape[0] == rows
    assert bounds.dtype == torch.float32 and bounds.is_contiguous() and bounds.shape == (cols,)
    assert head_panels.dtype == torch.float32 and head_panels.is_contiguous()
    assert head_panels.numel() == -(-cols // PANEL) * PANEL * k
    out = torch.empty(rows, dtype=torch.int64)
    failed = lib.screen_argmax(
        x.data_ptr(), x.stride(0), rows, k, screen.data_ptr(), screen.stride(0), cols,
        int(screen.dtype == torch.bfloat16), bounds.data_ptr(), max_bound, margin,
        head_panels.data_ptr(), max_candidates, out.data_ptr(),
    )  # fmt: skip
    return None if failed else out


def attention_supported(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether `paged_decode_attention` can run this layer (CPU, float32/bfloat16, one dtype)."""
    return (
        query.device.type == "cpu"
        and query.dtype in DTYPES
        and kv_cache.dtype == query.dtype
        and kv_cache.is_contiguous()
        and query.stride(-1) == 1
        and query.stride(-2) == query.shape[-1]
        and load() is not None
    )


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    k_pages: torch.Tensor,
    first_key_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """`[B, H, D]` attention of one query per request over its pages of `kv_cache`.

    `k_pages [B, P]` are the K pages of each request's blocks (cache viewed as
    `[num_blocks * 2, page]`, so block b's K is page 2b and V page 2b + 1), the first holding
    position `first_key_pos[b]`; request b sees positions `[seq_lens[b] - window, seq_lens[b])`
    (all of them below `seq_lens[b]` without a window). Call `attention_supported` first.
    """
    lib = load()
    assert lib is not None, "paged_decode_attention called where attention_supported() is False"
    batch, heads, dim = query.shape
    _, _, block_size, kv_heads, cache_dim = kv_cache.shape
    if cache_dim != dim or heads % kv_heads or k_pages.shape[0] != batch:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit cache {tuple(kv_cache.shape)} "
            f"and {k_pages.shape[0]} page rows"
        )
    index_tensors = (k_pages, first_key_pos, seq_lens)
    if any(t.dtype != torch.int64 or t.device.type != "cpu" for t in index_tensors):
        raise ValueError("pages, first key positions and sequence lengths must be CPU int64")
    pages = k_pages.contiguous()
    first = first_key_pos.contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty((batch, heads, dim), dtype=query.dtype)
    failed = lib.paged_decode_attention(
        query.data_ptr(),
        query.stride(0),
        kv_cache.data_ptr(),
        kv_cache.shape[0],
        pages.data_ptr(),
        first.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        batch,
        heads,
        kv_heads,
        dim,
        block_size,
        pages.shape[1],
        window or 0,
        scale,
        int(query.dtype == torch.bfloat16),
    )
    if failed:
        raise RuntimeError(attention_error(failed))
    return out


# Per request of `paged_prefill_attention`: its columns in the C kernel's query table.
PREFILL_QUERY_FIELDS = (
    "row", "rows", "first_pos", "first_key", "seq_len", "causal", "page_offset", "num_pages",
)  # fmt: skip


def prefill_available() -> bool:
    """Whether `paged_prefill_attention` runs on this CPU at all (the library; AVX-512, or AVX2
    with FMA)."""
    lib = load()
    return lib is not None and bool(lib.paged_prefill_supported())


def prefill_on_tiles(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether `paged_prefill_attention` runs heads of `head_dim` in `dtype` on AMX tiles
    (bfloat16, whole 32-value slices, a CPU and build with tiles, the tile state granted)."""
    lib = load()
    is_bf16 = dtype == torch.bfloat16
    return lib is not None and bool(lib.paged_prefill_on_tiles(head_dim, is_bf16))


def prefill_supported(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether `paged_prefill_attention` can run this layer: what `attention_supported` asks,
    a head dim of whole 16-wide vectors, and `prefill_available`."""
    return (
        attention_supported(query, kv_cache) and query.shape[-1] % 16 == 0 and prefill_available()
    )


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    queries: torch.Tensor,
    pages: torch.Tensor,
    window: int | None,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Multi-row attention of several requests over their pages of `kv_cache`, into `out`.

    `query` and `out` are `[N, H, D]` step rows (a query row may be strided, its heads
    contiguous); `queries [R, 8]` describes each request in the
    columns of `PREFILL_QUERY_FIELDS` (its rows, their positions, its keys and their pages:
    `pages[page_offset : page_offset + num_pages]`, K page numbers as in
    `paged_decode_attention`). A query at position p sees keys k < seq_len with k >= first_key,
    k <= p when causal, and k > p - window. Rows of no request are left as they are. Call
    `prefill_supported` first.
    """
    lib = load()
    assert lib is not None, "paged_prefill_attention called where prefill_supported() is False"
    rows, heads, dim = query.shape
    _, _, block_size, kv_heads, cache_dim = kv_cache.shape
    if cache_dim != dim or heads % kv_heads or out.shape != query.shape:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit cache {tuple(kv_cache.shape)} "
            f"or output {tuple(out.shape)}"
        )
    if query.stride(-1) != 1 or query.stride(-2) != dim:
        raise ValueError("each query row's heads must be contiguous")
    if not out.is_contiguous() or out.dtype != query.dtype:
        raise ValueError("the output must be contiguous rows of the query's dtype")
    if queries.dim() != 2 or queries.shape[1] != len(PREFILL_QUERY_FIELDS):
        raise ValueError(f"queries must be [R, {len(PREFILL_QUERY_FIELDS)}]")
    if any(t.dtype != torch.int64 or t.device.type != "cpu" for t in (queries, pages)):
        raise ValueError("the query table and pages must be CPU int64")
    table = queries.contiguous()
    if table.shape[0] and (
        int(table[:, 0].min()) < 0 or int((table[:, 0] + table[:, 1]).max()) > rows
    ):
        raise ValueError(f"a request's rows lie outside the step's {rows} rows")
    page_list = pages.contiguous()
    failed = lib.paged_prefill_attention(
        query.data_ptr(),
        query.stride(0),
        kv_cache.data_ptr(),
        kv_cache.shape[0],
        table.data_ptr(),
        table.shape[0],
        page_list.data_ptr(),
        page_list.numel(),
        out.data_ptr(),
        heads,
        kv_heads,
        dim,
        block_size,
        window or 0,
        scale,
        int(query.dtype == torch.bfloat16),
    )
    if failed:
        raise RuntimeError(
            f"paged prefill attention failed for {failed} work items: pages outside the cache "
            "or not covering the keys, a query row that sees no key (or no scratch memory)"
        )


PANEL = 16  # output columns per weight panel (csrc/linear.c)


def linear_dtypes() -> frozenset[torch.dtype]:
    """The dtypes `panel_linear` runs on this CPU: float32 and bfloat16 with AVX-512 or AVX2
    with FMA (bfloat16 multiplied as such with AVX512_BF16, else widened to float32:
    `linear_widens_bfloat16`); empty without the kernels."""
    lib = load()
    bits = lib.linear_kernel_dtypes() if lib is not None else 0
    return frozenset(dtype for bit, dtype in enumerate(DTYPES) if bits & (1 << bit))


def linear_widens_bfloat16() -> bool:
    """Whether `panel_linear` runs bfloat16 by widening it to float32 (CPUs without bfloat16
    arithmetic: AVX2 ones, and AVX-512 ones without AVX512_BF16): half the bytes of float32
    weights, at float32's multiply rate."""
    lib = load()
    return lib is not None and bool(lib.linear_widens_bf16())


def linear_vector_bits() -> int:
    """The panel kernel's vector width: 512 (AVX-512), 256 (AVX2), 0 without the kernel."""
    lib = load()
    return lib.linear_vector_bits() if lib is not None else 0


def linear_amx_min_rows() -> int:
    """From how many rows on `panel_linear` multiplies bfloat16 on AMX tiles (inputs whose K is
    a multiple of 32); 0 where it never does (no tiles, or no kernels)."""
    lib = load()
    return lib.linear_amx_min_rows() if lib is not None else 0


def linear_row_tiles(rows: int, k: int, dtype: torch.dtype, bits: int = 0) -> int:
    """How many row tiles `panel_linear` makes of `rows` rows of depth `k` (`bits`: on narrow
    panels of that kind, 0: none): each is a pass over every panel, so a step's cost rises by a
    pass where its rows cross into another tile (up to 28 rows a tile with AVX-512, 24 on 4-bit
    and 8-bit blocks, 6 with AVX2, on AVX2's blocks one tile up to 4 rows and 8 beyond, 16 on
    AMX tiles); 0 without the kernel."""
    lib = load()
    if lib is None:
        return 0
    return lib.linear_row_tiles(rows, k, int(dtype == torch.bfloat16), bits)


BLOCK_DEPTH = 32  # a 4-bit or 8-bit block's depth (csrc/linear.c)
Q4_BLOCK_BYTES = 2 * 2 * PANEL + BLOCK_DEPTH // 2 * PANEL  # d and m (float16), then the codes
Q8_BLOCK_BYTES = 2 * PANEL + BLOCK_DEPTH * PANEL  # d (float16), then the codes
NARROW_BITS = (4, 8, 16)  # the kinds of narrow panels (`narrow_panels`)


def narrow_panels_bytes(bits: int, n: int, k: int) -> int:
    """The bytes of an `[n, k]` weight's narrow panels of kind `bits` (`narrow_panels.pack`)."""
    panels = -(-n // PANEL)
    if bits == 16:
        return panels * k * PANEL * 2
    block = {4: Q4_BLOCK_BYTES, 8: Q8_BLOCK_BYTES}[bits]
    return panels * (k // BLOCK_DEPTH) * block


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """`weight [N, K]` laid out for `panel_linear` (or, int8, `int8_panel_linear`): ceil(N/16)
    panels of 16 output columns, each `[K][16]` (float32, int8) or `[ceil(K/2)][16][2]`
    (bfloat16 pairs), zero-padded."""
    n, k = weight.shape
    pad_n = -n % PANEL
    if weight.dtype == torch.bfloat16:
        pad_k = k % 2
        w = F.pad(weight.detach(), (0, pad_k, 0, pad_n))
        panels = w.view(-1, PANEL, (k + pad_k) // 2, 2).permute(0, 2, 1, 3)
    else:
        w = F.pad(weight.detach(), (0, 0, 0, pad_n))
        panels = w.view(-1, PANEL, k).permute(0, 2, 1)
    return panels.contiguous()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 `weight [N, K]` as int8 `Q [N, K]` and a float32 scale a row: row j is about
    `scale[j] * Q[j]`, Q = round(w / scale) with scale = max|w_j| / 127 (0 for a zero row)."""
    w = weight.detach()
    scale = w.abs().amax(dim=1) / 127
    q = (w / torch.where(scale > 0, scale, 1.0)[:, None]).round_().clamp_(-127, 127)
    return q.to(torch.int8), scale


def int8_panel_linear(
    x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor, out_features: int
) -> torch.Tensor:
    """`(x Q^T) * scale` of float32 rows `x [N, K]`, for `panels = pack_panels(Q)`:
    float32 `[N, out_features]`."""
    lib = load()
    assert lib is not None, "int8_panel_linear called without the kernel library"
    rows, k = x.shape
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError(
            f"int8_panel_linear: input {tuple(x.shape)} {x.dtype} strides {x.stride()}"
        )
    if panels.dtype != torch.int8 or panels.numel() != -(-out_features // PANEL) * PANEL * k:
        raise ValueError(
            f"int8_panel_linear: panels {tuple(panels.shape)} {panels.dtype} do not fit "
            f"{out_features} outputs of depth {k}"
        )
    if scale.shape != (out_features,) or scale.dtype != torch.float32:
        raise ValueError(f"int8_panel_linear: scale {tuple(scale.shape)} {scale.dtype}")
    out = torch.empty((rows, out_features), dtype=torch.float32)
    if rows:
        lib.int8_panel_linear(
            x.data_ptr(), x.stride(0), panels.data_ptr(), scale.data_ptr(), out.data_ptr(),
            rows, out_features, k,
        )  # fmt: skip
    return out


def linear_narrow_max_rows(bits: int) -> int:
    """The most rows `panel_linear` runs on narrow panels of kind `bits` (`narrow_panels`): 4-bit
    and 8-bit blocks 64 with AVX-512, 16 with AVX2; 16-bit ones as many as the float32 panels
    (2^31 - 1); 0 where it has none."""
    lib = load()
    return lib.linear_narrow_max_rows(bits) if lib is not None else 0


def panel_linear(
    x: torch.Tensor,
    panels: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    narrow: torch.Tensor | None = None,
    bits: int = 0,
) -> torch.Tensor:
    """`F.linear(x, W, bias)` for `panels = pack_panels(W)`; `x [..., K]` of `W`'s dtype, in
    `linear_dtypes()`. `narrow`: float32 W's narrow panels of kind `bits` (`narrow_panels`),
    read instead of `panels` where they run this many rows, with the same result bit for bit."""
    lib = load()
    assert lib is not None, "panel_linear called where linear_dtypes() is empty"
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    depth = (k + 1) // 2 if x.dtype == torch.bfloat16 else k
    expected = (-(-out_features // PANEL), depth, PANEL * (2 if x.dtype == torch.bfloat16 else 1))
    if panels.dtype != x.dtype or panels.numel() != expected[0] * expected[1] * expected[2]:
        raise ValueError(
            f"panel_linear: input {tuple(x.shape)} {x.dtype} does not fit panels "
            f"{tuple(panels.shape)} {panels.dtype} for {out_features} outputs"
        )
    if bias is not None and (bias.shape != (out_features,) or bias.dtype != x.dtype):
        raise ValueError(f"panel_linear: bias {tuple(bias.shape)} {bias.dtype}")
    bias = None if bias is None else bias.contiguous()  # held: the kernel reads it
    if narrow is not None and (
        bits not in NARROW_BITS
        or x.dtype != torch.float32
        or narrow.dtype != torch.uint8
        or not narrow.is_contiguous()
        or narrow.numel() != narrow_panels_bytes(bits, out_features, k)
    ):
        raise ValueError(
            f"panel_linear: {bits}-bit panels {tuple(narrow.shape)} {narrow.dtype} do not fit "
            f"{x.dtype} rows for {out_features} outputs of depth {k}"
        )
    out = torch.empty((rows.shape[0], out_features), dtype=x.dtype)
    status = lib.panel_linear(
        rows.data_ptr(),
        rows.stride(0),
        panels.data_ptr(),
        None if narrow is None else narrow.data_ptr(),
        bits if narrow is not None else 0,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        out_features,
        k,
        int(x.dtype == torch.bfloat16),
    )
    if status:
        raise RuntimeError(f"panel_linear failed ({'out of memory' if status == 1 else 'dtype'})")
    return out.view(*x.shape[:-1], out_features)
