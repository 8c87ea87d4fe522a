"""Narrow panels: a float32 weight kept as the exact narrower values it is made of.

A GGUF Q4_1 tensor dequantizes each 32-deep block of a row to `d q + m` (d and m float16, q
integers 0..15), a Q8_0 one to `d q` (d float16, q integers -128..127), and a checkpoint saved
in bfloat16 holds bfloat16 values: the float32 weights the model runs are those values, and a
decode step of few rows waits on reading them (SmolLM2-135M's layers, Q4_1: 425 MB a step in
float32, ~11 ms on a 2-core VM; its tied LM head, Q8_0: 113 MB; a bfloat16 drafter run in
float32 reads twice its bytes). Where every value of a weight is exactly of one of those forms,
`pack` lays it out in that form for the panel kernel (`csrc/linear.c`), which makes each weight
again in registers (4-bit: one fused multiply-add; 8-bit: one multiply; d q is exact in float32,
so the one rounding, if any, gives the float32 value; 16-bit: a shift) and sums the products
exactly as the float32 panels do: 5, 8.5 or 16 bits a weight instead of 32, the same outputs
bit for bit. The kind is named by its bits (`kernels.NARROW_BITS`).

The forms are found, not assumed: for 4-bit m is a block's least value (where q = 0; d q >= 0)
and d is tried at the float16 values around (max - m) / 15; for 8-bit d is tried around
max |w| / 127 (and / 128); every value of the weight is checked to be remade exactly, and a
weight with one value that is not gets no panels of that kind. 16-bit: every value's low 16
bits are zero.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

from specserve.worker.cpu import kernels
from specserve.worker.cpu.kernels import (
    BLOCK_DEPTH,
    NARROW_BITS,
    PANEL,
    Q4_BLOCK_BYTES,
    Q8_BLOCK_BYTES,
)

_PROBE_ROWS = 16  # rows checked first: most weights that are not 4-bit fail there, cheaply


def pack(
    weight: torch.Tensor, kinds: Sequence[int] = NARROW_BITS, panels: torch.Tensor | None = None
) -> tuple[torch.Tensor, int] | None:
    """`weight`'s narrowest exact panels among `kinds` (bits: 4, 8, 16; those the kernel runs)
    and their kind, or None where it has none; `panels`: its float32 panels if made already."""
    packers = {4: pack_q4, 8: pack_q8, 16: partial(pack_b16, panels=panels)}
    for bits in sorted(kinds):
        narrow = packers[bits](weight)
        if narrow is not None:
            return narrow, bits
    return None


def pack_b16(weight: torch.Tensor, panels: torch.Tensor | None = None) -> torch.Tensor | None:
    """`weight [N, K]`'s 16-bit panels (uint8, `kernels.narrow_panels_bytes(16, N, K)` bytes:
    the float32 panels' upper halves, from `panels` if given), or None where a value is not a
    bfloat16."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or not weight.numel():
        return None
    bits = weight.detach().view(torch.int32)
    if bits[:_PROBE_ROWS].bitwise_and(0xFFFF).any() or bits.bitwise_and(0xFFFF).any():
        return None
    panels = (kernels.pack_panels(weight) if panels is None else panels).view(torch.int32)
    return panels.bitwise_right_shift(16).to(torch.int16).view(torch.uint8).view(-1)


def pack_q4(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight [N, K]`'s 4-bit panels (uint8, `kernels.narrow_panels_bytes(4, N, K)` bytes), or
    None where it is not float32 4-bit blocks exactly (or K is not a multiple of 32)."""
    return _pack_blocks(weight, _blocks, _layout)


def pack_q8(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight [N, K]`'s 8-bit panels (uint8, `kernels.narrow_panels_bytes(8, N, K)` bytes), or
    None where it is not float32 8-bit blocks exactly (or K is not a multiple of 32)."""
    return _pack_blocks(weight, _q8_blocks, _q8_layout)


def _pack_blocks(
    weight: torch.Tensor,
    find: Callable[[torch.Tensor], tuple[torch.Tensor, ...] | None],
    layout: Callable[..., torch.Tensor],
) -> torch.Tensor | None:
    """`layout(*find(weight))` for a float32 matrix of whole 32-deep blocks, trying its first
    rows first (most weights that are not such blocks fail there, cheaply); None where `find`
    finds none."""
    if not blockable(weight):
        return None
    weight = weight.detach()
    if find(weight[:_PROBE_ROWS]) is None:
        return None
    blocks = find(weight)
    return None if blocks is None else layout(*blocks)


def blockable(weight: torch.Tensor) -> bool:
    """A float32 matrix whose rows are whole 32-deep blocks."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        return False
    n, k = weight.shape
    return bool(n and k and not k % BLOCK_DEPTH)


def round_to_q4_blocks(weight: torch.Tensor) -> torch.Tensor:
    """A float32 `[N, K]` weight (K a multiple of 32) as a Q4_1 writer quantizes it, dequantized
    again: per 32-deep block m = its least value and d = (max - m) / 15 as float16, q rounded
    to 0..15. Weights like the bundled model's, for tests and benchmarks."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK_DEPTH, BLOCK_DEPTH)
    low = w.amin(-1)
    d, m = ((w.amax(-1) - low) / 15).half().float(), low.half().float()
    q = ((w - m[..., None]) / torch.where(d > 0, d, 1.0)[..., None]).round().clamp(0, 15)
    return (d[..., None] * q + m[..., None]).reshape(n, k)


def round_to_q8_blocks(weight: torch.Tensor) -> torch.Tensor:
    """A float32 `[N, K]` weight (K a multiple of 32) as a Q8_0 writer quantizes it, dequantized
    again: per 32-deep block d = max |w| / 127 as float16, q rounded to -127..127."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK_DEPTH, BLOCK_DEPTH)
    d = (w.abs().amax(-1) / 127).half().float()
    q = (w / torch.where(d > 0, d, 1.0)[..., None]).round().clamp(-127, 127) + 0.0  # as integers
    return (d[..., None] * q).reshape(n, k)


def _blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(d, m) float16 `[N, K/32]` and q uint8 `[N, K]` with weight == d q + m exactly in
    float32, value for value; None where no such blocks exist."""
    n, k = weight.shape
    w = weight.reshape(-1, BLOCK_DEPTH)
    if not torch.isfinite(w).all():
        return None
    low = w.amin(-1)
    m = low.half()
    if not torch.equal(m.float(), low):
        return None
    spread = w.amax(-1) - low

    def remake(rows: torch.Tensor, blocks: torch.Tensor, scale: torch.Tensor):
        base = low[blocks, None]
        codes = ((rows - base) / scale).round_().nan_to_num_(0.0).clamp_(0, 15)
        return codes, scale * codes + base

    guesses = [partial(_nudged, spread / 15, offset) for offset in (0, 1, -1)]
    found = _find_scales(w, guesses, remake, torch.uint8)
    return None if found is None else (found[0].view(n, -1), m.view(n, -1), found[1].view(n, k))


def _nudged(values: torch.Tensor, offset: int, blocks: torch.Tensor) -> torch.Tensor:
    """`values[blocks]` as float16, moved by `offset` float16 steps."""
    return ((values[blocks]).half().view(torch.int16) + offset).view(torch.half)


def _find_scales(
    w: torch.Tensor,
    guesses: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    remake: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]],
    code_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each block (row) of `w [B, 32]`'s float16 scale d and codes q: the guesses are tried in
    turn on the blocks not yet settled (`guess(blocks)`: their candidate scales; `remake(rows,
    blocks, scale)`: their codes and the values those give), and a block is settled where
    every value is remade bit for bit (-0.0 is not +0.0); None where one never is. The first
    guess settles nearly every block of a real tensor, without a copy of it."""
    d = torch.zeros(w.shape[0], dtype=torch.half)
    q = torch.zeros(w.shape, dtype=code_dtype)
    left = torch.arange(w.shape[0])
    for guess in guesses:
        if not left.numel():
            break
        rows = w if left.numel() == w.shape[0] else w[left]
        candidate = guess(left)
        codes, remade = remake(rows, left, candidate.float()[:, None])
        exact = (remade.view(torch.int32) == rows.view(torch.int32)).all(-1)
        d[left[exact]] = candidate[exact]
        q[left[exact]] = codes[exact].to(code_dtype)
        left = left[~exact]
    return None if left.numel() else (d, q)


def _layout(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The kernel's layout: per panel of 16 rows of the weight, per 32-deep block, d[16] and
    m[16] (float16) then 16 bytes a pair of steps, byte c = q(2j, c) | q(2j + 1, c) << 4;
    padded rows are zeros (weights of 0)."""
    n, num_blocks = d.shape
    pad = -n % PANEL
    panels = (n + pad) // PANEL
    pairs = F.pad(q, (0, 0, 0, pad)).view(panels, PANEL, num_blocks, BLOCK_DEPTH // 2, 2)
    pairs = pairs.permute(0, 2, 3, 1, 4)  # [P, B, j, c, 2]
    codes = (pairs[..., 0] | (pairs[..., 1] << 4)).reshape(panels, num_blocks, -1)
    out = torch.cat([_per_panel(d), _per_panel(m), codes], dim=-1).contiguous()
    assert out.shape[-1] == Q4_BLOCK_BYTES
    return out.view(-1)


def _per_panel(scales: torch.Tensor) -> torch.Tensor:
    """`[N, B]` float16 scales as the panels hold them: `[P, B, 32]` bytes, a panel's 16 rows'
    values per block, padded rows zeros."""
    n, num_blocks = scales.shape
    pad = -n % PANEL
    per_panel = F.pad(scales, (0, 0, 0, pad)).view(-1, PANEL, num_blocks).transpose(1, 2)
    return per_panel.contiguous().view(torch.uint8)


def _q8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """d float16 `[N, K/32]` and q int8 `[N, K]` with weight == d q exactly in float32, value
    for value; None where no such blocks exist."""
    n, k = weight.shape
    w = weight.reshape(-1, BLOCK_DEPTH)
    if not torch.isfinite(w).all():
        return None
    top = w.abs().amax(-1)

    def remake(rows: torch.Tensor, blocks: torch.Tensor, scale: torch.Tensor):
        codes = (rows / scale).round_().nan_to_num_(0.0).clamp_(-128, 127).add_(0.0)  # no -0.0
        return codes, scale * codes

    guesses = [
        partial(_nudged, top / levels, offset)
        for levels, offset in itertools.product((127, 128), (0, 1, -1))
    ]
    found = _find_scales(w, guesses, remake, torch.int8)
    return None if found is None else (found[0].view(n, -1), found[1].view(n, k))


def _q8_layout(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The kernel's layout: per panel of 16 rows of the weight, per 32-deep block, d[16]
    (float16) then 32 steps of 16 codes, byte c of step j = q(j, c); padded rows are zeros."""
    n, num_blocks = d.shape
    pad = -n % PANEL
    panels = (n + pad) // PANEL
    codes = F.pad(q, (0, 0, 0, pad)).view(panels, PANEL, num_blocks, BLOCK_DEPTH)
    codes = codes.permute(0, 2, 3, 1).contiguous().view(torch.uint8)  # [P, B, j, c]
    out = torch.cat([_per_panel(d), codes.reshape(panels, num_blocks, -1)], dim=-1).contiguous()
    assert out.shape[-1] == Q8_BLOCK_BYTES
    return out.view(-1)
