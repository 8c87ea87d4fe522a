"""How much memory a worker may still give its KV cache once the model's weights are loaded.

`--kv-cache-memory-fraction F` sizes the cache as F of that, the way vLLM's
`--gpu-memory-utilization` sizes it from the whole device: on a CUDA device the memory CUDA
reports free; on CPU the kernel's MemAvailable, within the cgroup's memory limit (a pod's).
"""

from __future__ import annotations

from pathlib import Path

import torch


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
