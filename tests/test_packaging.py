"""`pip install specserve` is the client SDK and the control plane: torch comes only with the
`worker` extra, and nothing those two import may need it."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER_ONLY = {"torch", "safetensors"}

TORCH_FREE = """\
import importlib, pkgutil, sys
import specserve
specserve.Client, specserve.AsyncClient, specserve.SamplingParams
import specserve.cli, specserve.launch.up
for name in ("control", "cache_index", "shared"):
    package = importlib.import_module(f"specserve.{name}")
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
print(sorted(m for m in sys.modules if m.split(".")[0] in sys.argv[1:]))
"""

WITHOUT_TORCH = """\
import sys
sys.modules["torch"] = None  # as if only `pip install specserve` had run
from specserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9._-]+", r)[0].lower() for r in requirements}


def test_torch_comes_only_with_the_worker_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not requirement_names(project["dependencies"]) & WORKER_ONLY
    assert requirement_names(project["optional-dependencies"]["worker"]) >= WORKER_ONLY


def test_the_client_and_the_control_plane_never_import_torch():
    cmd = [sys.executable, "-c", TORCH_FREE, *sorted(WORKER_ONLY)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_running_a_model_without_the_worker_extra_says_what_to_install():
    for argv in (["worker"], ["generate", "--prompt", "hi"], ["up"]):
        cmd = [sys.executable, "-c", WITHOUT_TORCH, *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "pip install 'specserve[worker]'" in proc.stderr and "Traceback" not in proc.stderr
