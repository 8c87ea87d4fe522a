"""Host memory for a worker: how much it may still give its KV cache once the model's weights
are loaded, and how the C allocator keeps what a CPU step frees.

`--kv-cache-memory-fraction F` sizes the cache as F of that, the way vLLM's
`--gpu-memory-utilization` sizes it from the whole device: on a CUDA device the memory CUDA
reports free; on CPU the kernel's MemAvailable, within the cgroup's memory limit (a pod's).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

# glibc's malloc settings (mallopt): blocks up to this size come from the heap (glibc's largest),
# and freed heap memory up to this much stays mapped for the next step instead of going back to
# the kernel.
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30
HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KiB pages)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# A user who set any of these chose glibc's malloc behaviour: it is left alone.
_USER_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory(env: Mapping[str, str] = os.environ) -> bool:
    """Have glibc's malloc keep the large blocks a CPU step frees, for the next step to reuse.

    A prompt chunk's activations are tens of MB each (2,048 rows x 3,072 SwiGLU inputs is 12.6
    MB in bfloat16). By default glibc maps such blocks from the kernel on their own and unmaps
    them when freed, and trims the heap, so chunk after chunk faults its buffers in again and
    the kernel zeroes them page by page: about 190,000 page faults per prefill of 64 ShareGPT
    prompts, 4-9% of its time on a 2-core AMD Zen 4 machine (none kept; docs/benchmarks.md).
    The heap then holds up to its largest step's buffers while idle. Process-wide, so it is
    applied where the engine runs on CPU; returns whether it was (not without glibc, nor where
    the user set glibc's malloc tunables)."""
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", "") or any(
        name in env for name in _USER_MALLOC_SETTINGS
    ):
        return False
    try:  # the C library this process already runs on: no search for it
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    log.debug("memory.malloc", keep_freed=applied)
    return applied


def zeros_in_huge_pages(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in a mapping of its own that the kernel may back with 2 MiB pages
    (transparent huge pages, where the system grants them on request, as by default).

    A decode step reads every request's K/V pages (6-12 KB each, scattered over the cache) from
    memory; in 4 KiB pages each costs the TLB misses of two or three pages. On a 2-core Zen 4
    machine, reading 12-24 KB blocks in random order ran at 17-21 GB/s in 4 KiB pages and 20-24
    in 2 MiB ones, and `bench/decode_attention.py` 6-10% faster (docs/benchmarks.md). Its
    memory is committed here, as `torch.zeros` commits it, so a cache too large for the machine
    fails at start."""
    numel = math.prod(shape)
    # One huge page more than the tensor, which starts at the first 2 MiB boundary inside: a
    # mapping placed anywhere holds whole huge pages only between its boundaries (a 3 MiB one
    # might hold none). The slack is never touched, so never committed.
    buffer = mmap.mmap(
        -1, numel * dtype.itemsize + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        # A kernel without transparent huge pages refuses: 4 KiB pages, as before.
        with contextlib.suppress(OSError):
            buffer.madvise(advice)
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(buffer)) % HUGE_PAGE
    tensor = torch.frombuffer(buffer, dtype=dtype, count=numel, offset=offset).view(tuple(shape))
    return tensor.zero_()  # the tensor holds the mapping: it lives as long as the tensor


def free_memory_bytes(device: torch.device | str, root: Path = Path("/")) -> int:
    """Bytes this process may still allocate on `device`."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    available = _meminfo_available(root / "proc" / "meminfo")
    headroom = _cgroup_headroom(root / "sys" / "fs" / "cgroup")
    return available if headroom is None else min(available, headroom)


def _meminfo_available(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # kB
    raise ValueError(f"no MemAvailable in {path}")


def _cgroup_headroom(root: Path) -> int | None:
    """memory.max - memory.current (cgroup v2), or the v1 equivalents; None without a limit."""
    for limit_file, usage_file in (
        (root / "memory.max", root / "memory.current"),
        (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes"),
    ):
        try:
            limit, usage = limit_file.read_text().strip(), int(usage_file.read_text())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:  # v1 says "no limit" with a huge number
            return None
        return max(int(limit) - usage, 0)
    return None


def kv_budget_bytes(device: torch.device | str, fraction: float) -> int:
    """`fraction` of the memory still free on `device`; ValueError outside (0, 1]."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction}")
    return int(free_memory_bytes(device) * fraction)
