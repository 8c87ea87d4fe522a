"""Where specserve keeps what it makes for itself on this machine."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """specserve's cache (`$SPECSERVE_CACHE_DIR`, default `~/.cache/specserve`)."""
    return Path(os.environ.get("SPECSERVE_CACHE_DIR") or Path.home() / ".cache" / "specserve")
