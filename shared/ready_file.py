"""A file that exists exactly while a process is ready, for Kubernetes exec probes.

The control plane is ready while at least one worker is registered with it, a worker while it is
registered and serving; `test -f PATH` in the pod tells the kubelet, without a port to probe.
"""

from __future__ import annotations

import os
from pathlib import Path


class ReadyFile:
    """`set(True)` creates the file, `set(False)` removes it; nothing happens without a path."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = None if path is None else Path(path)
        self._ready: bool | None = None

    def set(self, ready: bool) -> None:
        if self.path is None or ready == self._ready:
            return
        if ready:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(f"{os.getpid()}\n")
            tmp.replace(self.path)  # atomically: a probe never sees a half-written file
        else:
            self.path.unlink(missing_ok=True)
        self._ready = ready
