"""Children that die with their launcher, even when the launcher is killed by SIGKILL.

A launcher that dies without stopping its children would leave a Redis, a control plane or
workers holding ports and memory. On Linux the kernel can signal a child when its parent dies
(`prctl(PR_SET_PDEATHSIG)`); elsewhere these calls do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PARENT_PID_ENV = "SPECSERVE_PARENT_PID"
"""Set by a launcher in its children's environment: the pid they must not outlive."""

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> None:
    """SIGTERM this process when its parent dies (Linux).

    With `parent_pid`, exit at once if the parent is already gone: it may have died before the
    request took effect, and then no signal would ever come. Without it, fit for `preexec_fn`.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent_pid is not None and os.getppid() != parent_pid:
        sys.exit(1)


def child_environment() -> dict[str, str]:
    """This process's environment for a child that calls `die_with_launcher`."""
    return {**os.environ, PARENT_PID_ENV: str(os.getpid())}


def die_with_launcher() -> None:
    """In a process a launcher started with `child_environment`: die with that launcher."""
    parent = os.environ.get(PARENT_PID_ENV)
    if parent:
        die_with_parent(int(parent))
