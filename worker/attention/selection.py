"""Choose the attention backend for a device: `auto`, `torch` or `flashinfer`."""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import structlog
import torch

from specserve.worker.attention import flashinfer_aot
from specserve.worker.attention.base import AttentionBackend
from specserve.worker.attention.flashinfer_backend import (
    INSTALL_HINT,
    SUPPORTED_DTYPES,
    FlashInferBackend,
)
from specserve.worker.attention.torch_backend import TorchAttentionBackend

log = structlog.get_logger(__name__)

BACKEND_NAMES = ("auto", "torch", "flashinfer")
# FlashInfer's kernels need sm75+; bfloat16 needs sm80+ (Ampere).
MIN_CAPABILITY = (7, 5)
MIN_CAPABILITY_BF16 = (8, 0)


def flashinfer_unavailable_reason(
    device: torch.device | str, dtype: torch.dtype | None = None
) -> str | None:
    """Why FlashInfer cannot serve `device` (and model `dtype`), or None if it can.

    Checks, in order: a CUDA device, a usable CUDA runtime, the GPU's compute capability, the
    model dtype, and that the `flashinfer` package is installed (without importing it).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return f"device {str(device)!r} is not a CUDA device (FlashInfer runs on NVIDIA GPUs only)"
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    name = torch.cuda.get_device_name(index)
    if capability < MIN_CAPABILITY:
        return (
            f"unsupported GPU {name} (compute capability {capability[0]}.{capability[1]}); "
            f"FlashInfer needs {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer"
        )
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        return f"model dtype {dtype} is not supported by FlashInfer (use bfloat16 or float16)"
    if dtype == torch.bfloat16 and capability < MIN_CAPABILITY_BF16:
        return (
            f"unsupported GPU {name} for bfloat16 (compute capability "
            f"{capability[0]}.{capability[1]}, needs 8.0 or newer)"
        )
    if importlib.util.find_spec("flashinfer") is None:
        return f"the flashinfer package is not installed ({INSTALL_HINT})"
    return flashinfer_build_unavailable_reason()


def flashinfer_build_unavailable_reason(
    env: Mapping[str, str] = os.environ,
    which: Callable[[str], str | None] = shutil.which,
    has_module: Callable[[str], bool] = lambda name: importlib.util.find_spec(name) is not None,
    default_nvcc: str = "/usr/local/cuda/bin/nvcc",
    has_prebuilt: Callable[[], bool] = flashinfer_aot.has_prebuilt_modules,
) -> str | None:
    """Why FlashInfer could not build its kernels here, or None if it can.

    FlashInfer compiles its attention kernels with nvcc on first use unless they were built
    ahead of time (`specserve kernels flashinfer`, or the `flashinfer-jit-cache` package); an
    image without the CUDA toolkit would fail then, in the middle of serving. nvcc is looked
    for where FlashInfer looks: FLASHINFER_NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH,
    /usr/local/cuda/bin.
    """
    if has_module("flashinfer_jit_cache") or has_prebuilt() or has_nvcc(env, which, default_nvcc):
        return None
    return (
        "FlashInfer compiles its kernels on first use with nvcc, and none was found "
        "(FLASHINFER_NVCC, CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda): install the CUDA "
        "toolkit, build the kernels ahead of time (specserve kernels flashinfer), or use "
        "--attention-backend torch"
    )


def has_nvcc(
    env: Mapping[str, str] = os.environ,
    which: Callable[[str], str | None] = shutil.which,
    default_nvcc: str = "/usr/local/cuda/bin/nvcc",
) -> bool:
    """Whether FlashInfer finds nvcc where it looks: FLASHINFER_NVCC, $CUDA_HOME/bin,
    $CUDA_PATH/bin, PATH, /usr/local/cuda/bin."""
    candidates = [env.get("FLASHINFER_NVCC")]
    candidates += [
        str(Path(env[var]) / "bin" / "nvcc") for var in ("CUDA_HOME", "CUDA_PATH") if env.get(var)
    ]
    candidates += [which("nvcc"), default_nvcc]
    return any(c and Path(c).is_file() for c in candidates)


def missing_flashinfer_kernels(
    head_dims: Iterable[int], dtype: torch.dtype, device: torch.device | str
) -> str | None:
    """Why FlashInfer would need a compiler at the first request and has none: the kernels
    built ahead of time lack one of these head dims (None when nvcc or flashinfer-jit-cache is
    there, or every module is prebuilt). Checked once the models are loaded, so a worker
    fails at start, not in the middle of serving."""
    if importlib.util.find_spec("flashinfer_jit_cache") is not None or has_nvcc():
        return None
    head_dims = sorted(set(head_dims))
    dtype_name = str(dtype).removeprefix("torch.")
    targets = flashinfer_aot.device_targets(device)
    missing = flashinfer_aot.missing_modules(
        flashinfer_aot.module_requests(head_dims, [dtype_name], targets)
    )
    if not missing:
        return None
    dims = " ".join(map(str, head_dims))
    return (
        f"FlashInfer has no prebuilt kernels for head dims {dims} in {dtype_name} on this GPU "
        f"({targets[0]}; missing: {', '.join(missing)}) and no nvcc to compile them: run "
        f"`specserve kernels flashinfer --arch {targets[0]} --head-dims {dims} --dtypes "
        f"{dtype_name}` where nvcc is, or use --attention-backend torch"
    )


def select_backend(
    name: str = "auto",
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """`torch`: the reference backend. `flashinfer`: FlashInfer, or ValueError saying why it
    cannot run here. `auto`: FlashInfer where it can run (CUDA, supported GPU, fp16/bf16 model
    when `dtype` is given, package importable), else torch."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
    if name == "torch":
        return TorchAttentionBackend()
    reason = flashinfer_unavailable_reason(device, dtype)
    if reason is None:
        try:
            return FlashInferBackend(device)
        except RuntimeError as exc:  # installed but not importable, or device trouble
            reason = str(exc)
    if name == "flashinfer":
        raise ValueError(f"attention backend 'flashinfer' cannot run here: {reason}")
    # A CUDA device that could not get FlashInfer is worth a warning; a CPU one is expected.
    cuda = torch.device(device).type == "cuda"
    (log.warning if cuda else log.debug)(
        "attention.backend.auto", chosen="torch", flashinfer_unavailable=reason
    )
    return TorchAttentionBackend()
