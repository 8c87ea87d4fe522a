"""4-bit panels: a float32 weight kept as the exact 4-bit blocks it is made of.

A GGUF Q4_1 tensor dequantizes each 32-deep block of a row to `d q + m` (d and m float16, q
integers 0..15): the float32 weights the model runs are those values, and a decode step of few
rows waits on reading them (SmolLM2-135M's layers: 425 MB a step in float32, ~11 ms on a
2-core VM). Where every block of a weight is exactly of that form, `pack` lays the blocks out
for the panel kernel (`csrc/linear.c`), which makes each weight again in registers with one
fused multiply-add (d q is exact in float32, so the sum's one rounding gives the float32
value) and sums the products exactly as the float32 panels do: 5 bits a weight instead of 32,
the same outputs bit for bit.

The blocks are found, not assumed: m is a block's least value (where q = 0; d q >= 0), d is
tried at the float16 values around (max - m) / 15, and every value of the weight is checked to
be remade exactly; a weight with one block that is not gets no 4-bit panels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.worker.cpu.kernels import PANEL, Q4_BLOCK_BYTES, Q4_DEPTH

_PROBE_ROWS = 16  # rows checked first: most weights that are not 4-bit fail there, cheaply


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight [N, K]`'s 4-bit panels (uint8, `kernels.q4_panels_bytes(N, K)` bytes), or None
    where it is not float32 4-bit blocks exactly (or K is not a multiple of 32)."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    n, k = weight.shape
    if not n or not k or k % Q4_DEPTH:
        return None
    weight = weight.detach()
    if _blocks(weight[:_PROBE_ROWS]) is None:
        return None
    blocks = _blocks(weight)
    return None if blocks is None else _layout(*blocks)


def round_to_blocks(weight: torch.Tensor) -> torch.Tensor:
    """A float32 `[N, K]` weight (K a multiple of 32) as a Q4_1 writer quantizes it, dequantized
    again: per 32-deep block m = its least value and d = (max - m) / 15 as float16, q rounded
    to 0..15. Weights like the bundled model's, for tests and benchmarks."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // Q4_DEPTH, Q4_DEPTH)
    low = w.amin(-1)
    d, m = ((w.amax(-1) - low) / 15).half().float(), low.half().float()
    q = ((w - m[..., None]) / torch.where(d > 0, d, 1.0)[..., None]).round().clamp(0, 15)
    return (d[..., None] * q + m[..., None]).reshape(n, k)


def _blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(d, m) float16 `[N, K/32]` and q uint8 `[N, K]` with weight == d q + m exactly in
    float32, value for value; None where no such blocks exist."""
    n, k = weight.shape
    w = weight.reshape(n, k // Q4_DEPTH, Q4_DEPTH)
    if not torch.isfinite(w).all():
        return None
    low = w.amin(-1)
    m = low.half()
    if not torch.equal(m.float(), low):
        return None
    guess = ((w.amax(-1) - low) / 15).half()
    step = guess.view(torch.int16)
    found = torch.zeros(low.shape, dtype=torch.bool)
    d = torch.zeros_like(m)
    q = torch.zeros(w.shape, dtype=torch.uint8)
    for candidate in (guess, (step + 1).view(torch.half), (step - 1).view(torch.half)):
        scale = candidate.float()[..., None]
        codes = ((w - low[..., None]) / scale).round().nan_to_num(0.0).clamp(0, 15)
        remade = scale * codes + low[..., None]  # the bits compared: -0.0 is not +0.0
        exact = (remade.view(torch.int32) == w.view(torch.int32)).all(-1) & ~found
        d[exact] = candidate[exact]
        q[exact] = codes[exact].to(torch.uint8)
        found |= exact
    if not found.all():
        return None
    return d, m, q.reshape(n, k)


def _layout(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The kernel's layout: per panel of 16 rows of the weight, per 32-deep block, d[16] and
    m[16] (float16) then 16 bytes a pair of steps, byte c = q(2j, c) | q(2j + 1, c) << 4;
    padded rows are zeros (weights of 0)."""
    n, num_blocks = d.shape
    pad = -n % PANEL
    panels = (n + pad) // PANEL

    def per_panel(t: torch.Tensor) -> torch.Tensor:  # [N, B] float16 -> [P, B, 32] bytes
        t = F.pad(t, (0, 0, 0, pad)).view(panels, PANEL, num_blocks).transpose(1, 2)
        return t.contiguous().view(torch.uint8)

    pairs = F.pad(q, (0, 0, 0, pad)).view(panels, PANEL, num_blocks, Q4_DEPTH // 2, 2)
    pairs = pairs.permute(0, 2, 3, 1, 4)  # [P, B, j, c, 2]
    codes = (pairs[..., 0] | (pairs[..., 1] << 4)).reshape(panels, num_blocks, -1)
    out = torch.cat([per_panel(d), per_panel(m), codes], dim=-1).contiguous()
    assert out.shape[-1] == Q4_BLOCK_BYTES
    return out.view(-1)
