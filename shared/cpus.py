"""Which cores a worker may use, how many threads it runs on them, and how those threads wait.

A worker with more threads than cores it actually gets (two workers on two cores, or another
process holding a core) collapses: OpenMP threads that finish a parallel region spin for the
others, and a spinning thread holds the very core its peer waits for (measured with the bundled
model on two cores, another process using one: batch-1 decode 48 -> 7 tokens/s, batch 16
435 -> 23). So a worker runs one thread per core it may use (its affinity mask, capped by a
cgroup CPU quota), `up` gives each of its workers its own cores, and a worker's threads spin only
briefly before they sleep (GOMP_SPINCOUNT=1000: 23 and 216 tokens/s under the same load, 4% below
the default on an idle machine). No torch here: the spin setting must be in the environment
before torch is imported.
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping
from pathlib import Path

# How long an OpenMP thread spins before it sleeps (GNU OpenMP, which torch's CPU builds use);
# left alone when the user set it, or OMP_WAIT_POLICY.
SPIN_COUNT = "1000"


def usable_cpus() -> list[int]:
    """The cores this process may run on: its affinity mask, the first ones of it when a cgroup
    CPU quota allows fewer."""
    cpus = sorted(os.sched_getaffinity(0))
    quota = cgroup_cpu_limit()
    if quota is not None:
        cpus = cpus[: max(1, math.floor(quota))]
    return cpus


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time this cgroup may use (cgroup v2 `cpu.max`, else v1 `cpu.cfs_*`); None
    without a quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def parse_cpus(text: str) -> list[int]:
    """`0-3,6` -> [0, 1, 2, 3, 6]; ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        first, last = int(lo), int(hi or lo)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part.strip()!r} in {text!r}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError("no CPUs given")
    return sorted(cpus)


def format_cpus(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


def divide_cpus(cpus: list[int], parts: int) -> list[list[int]]:
    """Split `cpus` into `parts` contiguous shares whose sizes differ by at most one; with fewer
    cores than parts, part i shares core i mod the number of cores."""
    if len(cpus) < parts:
        return [[cpus[i % len(cpus)]] for i in range(parts)]
    size, extra = divmod(len(cpus), parts)
    shares, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        shares.append(cpus[start:end])
        start = end
    return shares


def set_spin_default(env: MutableMapping[str, str] = os.environ) -> None:
    """Make OpenMP threads sleep soon when they wait, unless the user chose how they wait."""
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = SPIN_COUNT


def pin(cpus: list[int]) -> None:
    """Run this process (and the threads it starts from now on) on `cpus` only."""
    os.sched_setaffinity(0, cpus)
