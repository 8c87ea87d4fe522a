"""Compile FlashInfer's attention kernels ahead of time, so a GPU worker never runs a compiler.

FlashInfer 0.7 compiles each attention module (one per dtype, head_dim and sliding-window
on/off) with nvcc on first use: minutes per module, in the middle of serving, and impossible in
an image without the CUDA toolkit. FlashInfer loads a module without compiling when its shared
library sits in the package's ahead-of-time folder (`flashinfer/data/aot/<name>/<name>.so`).
`build` compiles the modules that `FlashInferBackend` plans and installs them there. It needs
nvcc and a CUDA toolkit of the version torch was built for, but no GPU: the target
architectures are named instead (`9.0a` for H100/H200, `8.0` for A100, ...).

The modules are the ones the wrappers ask for:

* decode, `BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)`: FlashInfer's FA2
  prefill kernels (its tensor-core decode path);
* causal and non-causal prefill, `BatchPrefillWithPagedKVCacheWrapper(backend="auto")`: FA3 on
  Hopper (`9.0a`), FA2 elsewhere. FA3 is built only when a Hopper target is named.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_HEAD_DIMS = (64, 128, 256)
DEFAULT_DTYPES = ("bfloat16",)
HOPPER_ARCHS = ("9.0a",)


@dataclass(frozen=True)
class ModuleRequest:
    """One FlashInfer attention module: kernel family, dtype, head_dim, sliding window."""

    backend: str  # "fa2" or "fa3"
    dtype: torch.dtype
    head_dim: int
    sliding_window: bool

    def spec(self):  # -> flashinfer.jit.JitSpec
        from flashinfer.jit.attention.modules import (
            _gen_batch_prefill_primary_module,
            gen_batch_prefill_module,
        )

        gen = (
            _gen_batch_prefill_primary_module if self.backend == "fa2" else gen_batch_prefill_module
        )
        d = self.dtype
        # (q, kv, out, index dtype, head_dim qk / vo, no RoPE, window, no soft-cap, no fp16 QK)
        return gen(
            self.backend, d, d, d, torch.int32, self.head_dim, self.head_dim, 0,
            self.sliding_window, False, False,
        )  # fmt: skip


def module_requests(
    head_dims: Iterable[int], dtypes: Iterable[str], archs: Iterable[str]
) -> list[ModuleRequest]:
    """Every module the backend can plan for these head dims and dtypes on these targets."""
    backends = ["fa2"] + (["fa3"] if any(a in HOPPER_ARCHS for a in archs) else [])
    return [
        ModuleRequest(backend, getattr(torch, dtype), head_dim, window)
        for head_dim in head_dims
        for dtype in dtypes
        for window in (False, True)
        for backend in backends
    ]


def aot_dir() -> Path:
    """Where FlashInfer loads prebuilt modules from without compiling (found without importing
    the package, which takes seconds)."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("FlashInfer is not installed: pip install 'specserve[gpu]'")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "aot"


def has_prebuilt_modules() -> bool:
    """Whether `build` (or anything else) installed prebuilt modules for FlashInfer to load."""
    try:
        return any(aot_dir().glob("*/*.so"))
    except ModuleNotFoundError:
        return False


def device_targets(device: torch.device | str) -> list[str]:
    """The target name of `device`'s architecture, as `build` takes it."""
    major, minor = torch.cuda.get_device_capability(device)
    return [f"{major}.{minor}a" if (major, minor) == (9, 0) else f"{major}.{minor}"]


def installed_path(folder: Path, name: str) -> Path:
    """Where FlashInfer looks for the prebuilt module `name` in its ahead-of-time `folder`."""
    return folder / name / f"{name}.so"


def missing_modules(requests: Iterable[ModuleRequest]) -> list[str]:
    """Names of the requested modules that are not installed ahead of time."""
    folder = aot_dir()
    names = [request.spec().name for request in requests]
    return [name for name in names if not installed_path(folder, name).is_file()]


def build(
    head_dims: Iterable[int] = DEFAULT_HEAD_DIMS,
    dtypes: Iterable[str] = DEFAULT_DTYPES,
    archs: Iterable[str] = HOPPER_ARCHS,
    progress: Callable[[str], None] = print,
) -> list[Path]:
    """Compile the modules for `archs` and install them into FlashInfer's ahead-of-time folder.

    FlashInfer reads the target list from the environment when it is imported, so this must
    run before anything imports it in this process (the CLI runs it first).
    """
    archs = list(archs)
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = " ".join(archs)
    requests = module_requests(head_dims, dtypes, archs)
    target = aot_dir()
    installed = []
    for i, request in enumerate(requests, 1):
        spec = request.spec()
        dest = installed_path(target, spec.name)
        if dest.is_file():
            progress(f"[{i}/{len(requests)}] {spec.name}: already installed")
            installed.append(dest)
            continue
        start = time.monotonic()
        progress(f"[{i}/{len(requests)}] {spec.name}: compiling ...")
        spec.build(verbose=False)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, dest)
        progress(f"[{i}/{len(requests)}] {spec.name}: {time.monotonic() - start:.0f} s")
        installed.append(dest)
    return installed
