"""The compiled CPU decode-attention kernel (`paged_decode.c`): built once, loaded with ctypes.

Decoding with SDPA first gathers every request's K and V pages into a padded batch, so each
layer copies the whole context and then reads it again, and the padding grows with the longest
request; at 16 requests of 1k tokens that is three quarters of a step. The kernel reads the
pages where they lie, once.

The C file is compiled on first use with the system C compiler (`$CC`, else `cc`/`gcc`) into
`$SPECSERVE_CACHE_DIR/kernels` (default `~/.cache/specserve/kernels`), keyed by the source, the
flags and the CPU, and reused afterwards. Without a compiler, or with `SPECSERVE_CPU_KERNELS=0`,
attention keeps the SDPA path (same results up to float32 summation order), and says so once in
the log. It runs on torch's own OpenMP threads: the library's `libgomp.so.1` resolves to the
copy torch has already loaded.
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
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
# -ffast-math only when compiling (vectorised expf and reductions); linking without it keeps
# crtfastmath.o, which would set flush-to-zero for the whole process, out of the library.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
LINK_FLAGS = ("-shared", "-fopenmp", "-lm")
DTYPES = (torch.float32, torch.bfloat16)
_C_INT64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def enabled() -> bool:
    return os.environ.get("SPECSERVE_CPU_KERNELS", "1") != "0"


def cache_dir() -> Path:
    root = os.environ.get("SPECSERVE_CACHE_DIR") or Path.home() / ".cache" / "specserve"
    return Path(root) / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_signature() -> str:
    """The CPU's feature flags: a library built with -march=native must not move to another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(compiler: str) -> Path:
    """Compile `SOURCE` into the cache (atomically: concurrent workers may build at once)."""
    flags = " ".join(COMPILE_FLAGS + LINK_FLAGS)
    parts = (SOURCE.read_bytes(), compiler.encode(), flags.encode(), _cpu_signature().encode())
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    target = cache_dir() / f"paged_decode-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "paged_decode.o", Path(tmp) / target.name
        for cmd in (
            [compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
            [compiler, str(obj), *LINK_FLAGS, "-o", str(lib)],
        ):
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(lib, target)
    return target


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None (logged once) where it cannot be had."""
    if not enabled():
        log.info("attention.cpu_kernel.disabled", reason="SPECSERVE_CPU_KERNELS=0")
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("attention.cpu_kernel.unavailable", reason="no C compiler (set CC)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        log.warning("attention.cpu_kernel.unavailable", reason=detail.strip()[-500:])
        return None
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, _C_INT64, _PTR, _PTR, _PTR, _PTR, _PTR]
    fn.argtypes += [_C_INT64] * 7 + [ctypes.c_float, ctypes.c_int]
    return lib


def supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the kernel can run this layer (CPU, float32/bfloat16, one dtype throughout)."""
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
    (all of them below `seq_lens[b]` without a window). Call `supports` first.
    """
    lib = load()
    assert lib is not None, "paged_decode_attention called where supports() is False"
    batch, heads, dim = query.shape
    _, _, block_size, kv_heads, cache_dim = kv_cache.shape
    if cache_dim != dim or heads % kv_heads or k_pages.shape[0] != batch:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit cache {tuple(kv_cache.shape)} "
            f"and {k_pages.shape[0]} page rows"
        )
    pages = k_pages.contiguous()
    first = first_key_pos.contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty((batch, heads, dim), dtype=query.dtype)
    failed = lib.paged_decode_attention(
        query.data_ptr(),
        query.stride(0),
        kv_cache.data_ptr(),
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
        raise RuntimeError(f"paged decode attention failed for {failed} (request, head) pairs")
    return out
