"""Children of a launcher die with it, even when it is killed by SIGKILL (Linux only)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only"
)

CHILD = """\
import time
from specserve.launch.lifetime import die_with_launcher
die_with_launcher()
print("ready", flush=True)
time.sleep(120)
"""

LAUNCHER = f"""\
import subprocess, sys, time
from specserve.launch.lifetime import child_environment
child = subprocess.Popen(
    [sys.executable, "-c", {CHILD!r}], env=child_environment(), stdout=subprocess.PIPE
)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    """Running or sleeping; a zombie awaiting its new parent's reaping counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_child_dies_with_its_killed_launcher():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE)
    try:
        child = int(launcher.stdout.readline())
        assert alive(child)
        launcher.kill()  # SIGKILL: the launcher gets no chance to stop its child
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.stdout.close()


def test_a_child_whose_launcher_is_already_gone_exits_at_once():
    env = {**os.environ, "SPECSERVE_PARENT_PID": "1"}  # not this child's parent: it died
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, timeout=60, capture_output=True)
    assert proc.returncode == 1 and b"ready" not in proc.stdout
