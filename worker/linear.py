"""Linear layers whose weights are laid out once, at load time, for the CPU's oneDNN matmul.

On CPU, torch's default `F.linear` runs a GEMM that reads the weight in its plain layout on
every call. oneDNN can reorder a weight once into the blocked layout its kernels stream, and the
small-M GEMMs of decoding then run 2-3x faster (fp32: 120 SmolLM2 linears at M=16 take 13.6 ms
instead of 40.6 ms on a 2-core AVX-512 machine; see docs/benchmarks.md). The math is the same
matmul in the same dtype; only the summation order differs (|diff| ~1e-6 in fp32).

The plain weight stays where it is, because drafters and tests read it; the packed copy (an
opaque oneDNN tensor) is used by `forward` only, so a packed model holds its linear weights
twice. CUDA, float16 and float64 weights, and builds without oneDNN, keep `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN can run this weight: a CPU fp32/bf16 matrix on a build that has it (bf16
    only on CPUs with the instructions oneDNN's bf16 kernels need)."""
    if not (
        weight.device.type == "cpu"
        and weight.dtype in _PACKABLE_DTYPES
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight reordered for oneDNN, or None where `F.linear` must be used."""
    if not can_pack(weight):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except RuntimeError:  # a CPU or build oneDNN turns down: the plain path still works
        return None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the packed weight when there is one (and `x` is a
    CPU tensor of the weight's dtype: otherwise `F.linear` gives its usual clear error)."""
    if packed is None or x.dtype != weight.dtype or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """`nn.Linear` that uses a packed copy of its weight once `pack_weights()` has made one.

    Moving or casting the module (`.to()`, `.half()`, ...) or loading a state dict into it
    packs the new weight again, so the copy never goes stale.
    """

    packed: torch.Tensor | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_load_state_dict_post_hook(lambda module, _: module.repack())

    def pack_weights(self) -> int:
        self.packed = pack_weight(self.weight)
        return int(self.packed is not None)

    def repack(self) -> None:
        """Pack the current weight again if a packed copy is in use."""
        if self.packed is not None:
            self.pack_weights()

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        module = super()._apply(fn, recurse)
        self.repack()
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


def pack_weights(module: nn.Module) -> int:
    """Call `pack_weights()` on every submodule that has one (each `Linear`, and e.g. a model
    whose LM head reuses its embedding); returns how many weights were packed."""
    return sum(m.pack_weights() for m in module.modules() if hasattr(m, "pack_weights"))
