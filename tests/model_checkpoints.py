"""What the checkpoint fixtures in tests/conftest.py return (importable from any test folder;
`conftest` itself is not, since every folder may have one)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    hf_model: torch.nn.Module  # float32, eval mode
