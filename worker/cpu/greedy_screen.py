"""Greedy tokens of a float32 LM head, exactly, from a cheaper read of it.

A float32 decode step at batch 1 streams every weight once, and the LM head is a fifth of
them (SmolLM2-135M: 113 of 540 MB, ~3.4 ms of a ~19 ms step on a 2-core Zen 4). A greedy row
needs only the head's argmax. `GreedyScreen` reads a copy of the head instead, a bfloat16 one
(half the bytes) or an int8 one with a scale a column (a quarter), bounds how far each screened
logit can be from the float32 head's, and computes in float32 only the columns whose bound
reaches the row's best: their logits bit for bit as the head's own call gives them (the same
panel kernel sums each output column on its own, in the same order, whichever columns it is
given), so the token is the float32 head's argmax, first index on ties.

The bound has one form for both copies: |head_j - screen_j| <= c_j ||x||_2, with a constant
c_j per column computed when the copy is made. Let gamma = K 2^-24 / (1 - K 2^-24) bound a
float32 sum of K products in any order, relative to the sum of their magnitudes, so that the
head's own logit is within gamma ||w_j|| ||x|| of x.w_j (Cauchy-Schwarz).

- bfloat16 (x and w rounded to bfloat16, relative error u = 2^-8 each; float32 sums; the sum
  rounded to bfloat16): c_j = SLACK ||w_j||, with SLACK = (2u + u^2) + u (1 + u)^2 +
  gamma (1 + (1 + u)^2), plus 1%.
- int8 (w_j = s_j q_j + e_j, q_j integers of at most 127, s_j = max|w_j| / 127; the kernel
  sums x_i q_ij in float32 and multiplies by s_j once): x.w_j - s_j x.q_j = x.e_j, so c_j =
  ||e_j|| + gamma ||w_j|| + (gamma + 2^-24 (1 + gamma)) s_j ||q_j||, plus 1% (`_int8_bounds`
  computes ||e_j|| in float32 and adds what that rounding can hide). On SmolLM2's head it is
  3% below the bfloat16 copy's.

Column j can hold the argmax only if screen_j + B_j >= screen_b - B_b, b the screen's own
argmax, B = c ||x||. `kernels.screen_argmax` applies that test in float32, with its floor
moved so that float32 rounding only ever keeps more columns (typically one or two columns a
row pass), and computes the passing columns' logits as the head's float32 panels do.

Only where it is exact: the head's float32 call would run the panel kernel at this many rows
(`PackedWeight.runs_panels`) and every value is finite. Which copy: bfloat16 where the CPU
multiplies bfloat16 (AVX512_BF16), int8 where it would widen bfloat16 to float32 anyway (AVX2,
AVX-512 without AVX512_BF16):
there both copies multiply at float32's rate, so the screen answers steps of up to
`WIDENED_MAX_ROWS` rows, which wait on the head's bytes. Nor where the head itself reads no more
bytes a weight than the copy at that many rows (`linear.PackedWeight.narrow_for`): a head made
of 8-bit blocks (SmolLM2's tied head, Q8_0 in its GGUF) read as those blocks gives every logit
exactly from 8.5 bits a weight, fewer than the bfloat16 copy's 16 and about the int8 copy's 8,
with no columns to recompute; a head of bfloat16 values (a drafter's) reads 16. Except where
the copy multiplies as bfloat16: there the narrow head keeps only the rows at which it was
timed faster than the screen when the screen was made (`NARROW_HEAD_CALIBRATION_ROWS`), since
from a few rows on the head's arithmetic, not its bytes, sets its time. Drafters read
the screen's logits as they are (`logits`; widened, up to `WIDENED_MAX_LOGIT_ROWS` rows): a draft
needs no exact logits, since the target verifies it. An EAGLE-3 drafter's own float32 draft
head has a screen of its own, whose `argmax` gives its greedy drafts
(`Eagle3Drafter.greedy_drafts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

import structlog
import torch

from specserve.worker.cpu import kernels
from specserve.worker.cpu.linear import CALIBRATE_MIN_BYTES, PackedWeight, _best_passes

log = structlog.get_logger(__name__)

_U = 2.0**-8  # bfloat16's unit roundoff
_U32 = 2.0**-24
_MARGIN = 2.0**-20  # what float32 inputs of the column test are moved by: 16x its rounding
# A row that keeps more columns than this is left to the float32 head: computing that many
# columns one by one would cost more than reading the head.
MAX_CANDIDATES = 1024
# Where the copy multiplies at float32's rate (AVX2) the screen pays while the float32 head is
# bound by its bytes. A 49,152 x 576 head (SmolLM2) on a 2-core AMD Zen 3, caches flushed
# between calls, ms: the float32 head and its argmax against the int8 screen's argmax, 1 row
# 9.3 / 3.1, 2 rows 6.9 / 2.8, 4 rows 7.9 / 3.6, 8 rows 10.6-11.2 / 6.4-7.9, 16 rows 15.5 /
# 11.5, 24 rows 19.0 / 16.5, 32 rows 28.3 / 33.4; the float32 head against the int8 screen's
# logits alone (drafts), 1 row 7.4 / 2.5, 8 rows 10.9 / 5.8, 16 rows 14.4 / 10.8, 24 rows
# 18.2 / 14.8, 32 rows 26.7 / 31.0. In the engine with real rows (A/B, 4 rounds, outputs equal)
# a greedy limit of 16 against 8 gave batch 16 0.96-1.03x (median 0.98x), as a limit of 16
# against 4 had for the bfloat16 copy (1.00x; batch 8 1.05x).
WIDENED_MAX_ROWS = 8  # argmax (candidate columns recomputed in float32)
WIDENED_MAX_LOGIT_ROWS = 24  # logits alone
# A head read as its narrow panels (8-bit blocks) reads fewer bytes than a bfloat16 copy, but
# a copy the CPU multiplies as bfloat16 does twice float32's arithmetic a cycle, while the
# narrow panels widen every weight to float32: from a few rows on, where the head's arithmetic
# rather than its bytes sets its time, the screen wins. So the narrow head keeps greedy rows
# only up to the most of these row counts at which it still beats the screen, timed when the
# screen is made (SmolLM2's 49,152 x 576 head on a 2-core Zen 4, caches flushed between calls,
# ms, the 8-bit head against the bfloat16 screen: 1 row 1.17 / 2.04, 4 rows 1.46 / 2.05, 8 rows
# 2.80 / 2.27, 16 rows 4.94 / 3.22, 64 rows 19.39 / 10.45).
NARROW_HEAD_CALIBRATION_ROWS = (1, 2, 4, 8, 16)
FLUSH_BYTES = 64 * 2**20  # written before each timed call: twice the largest L3 of a 2-core VM


Copy = Literal["bfloat16", "int8"]
COPY_BITS = {"bfloat16": 16, "int8": 8}  # what each copy reads a weight


def _gamma(depth: int) -> float:
    """The bound of a float32 sum of `depth` products, relative to their magnitudes' sum."""
    return depth * _U32 / (1 - depth * _U32)


def _slack(depth: int) -> float:
    """The bfloat16 copy's bound factor on ||w|| ||x|| for sums of `depth` products, with 1% to
    spare."""
    u, gamma = _U, _gamma(depth)
    return 1.01 * ((2 * u + u * u) + u * (1 + u) ** 2 + gamma * (1 + (1 + u) ** 2))


def _int8_bounds(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """c_j of the int8 copy (the module's docstring), from float32 arithmetic: e_j computed
    as w_j - s_j q_j rounds twice an element, which 2^-23 s_j ||q_j|| covers, and the norms'
    float32 sums (relative error below K 2^-24) are covered by the 1%."""
    gamma = _gamma(weight.shape[1])
    q = q.float()
    q_norms = q.norm(dim=1).double()  # exact: integers, sums below 2^24
    error = torch.addcmul(weight, scale[:, None], q, value=-1).norm(dim=1).double()
    s = scale.double()
    rounding = 2 * _U32 * s * q_norms
    return 1.01 * (
        error
        + rounding
        + gamma * weight.norm(dim=1).double()
        + (gamma + _U32 * (1 + gamma)) * s * q_norms
    )


def default_copy() -> Copy | None:
    """The copy a screen reads on this CPU: bfloat16 where it multiplies bfloat16, int8 where
    bfloat16 would be widened to float32 (AVX2, AVX-512 without AVX512_BF16); None without
    bfloat16 panels."""
    if torch.bfloat16 not in kernels.linear_dtypes():
        return None
    return "int8" if kernels.linear_widens_bfloat16() else "bfloat16"


@dataclass(eq=False)
class GreedyScreen:
    """The screen of one float32 head: built by `GreedyScreen.of`, used while `head` (the
    head's packing) is the one in use."""

    head: PackedWeight
    copy: Copy
    panels: torch.Tensor  # the head's copy, packed for its kernel
    scale: torch.Tensor | None  # int8: each column's float32 scale
    column_bounds: torch.Tensor  # [V] float32 c_j, rounded up: |head_j - screen_j| <= c_j ||x||
    max_bound: float
    widened: bool  # the copy multiplies at float32's rate: int8, or bfloat16 widened
    # Up to this many rows the head's own narrow panels (where it has them and they read no
    # more bits than the copy) answer instead of the screen: calibrated where the copy is not
    # widened (`NARROW_HEAD_CALIBRATION_ROWS`), everywhere elsewhere.
    narrow_head_rows: int = 2**31 - 1

    @classmethod
    def of(cls, head: PackedWeight | None, copy: Copy | None = None) -> GreedyScreen | None:
        """A screen for a float32 head packed as panels, reading `copy` (default: this CPU's,
        `default_copy`)."""
        if head is None or not head.panels or head.weight.dtype != torch.float32:
            return None
        copy = copy or default_copy()
        if copy is None:
            return None
        weight = head.weight.detach()
        if copy == "bfloat16":
            panels, scale = kernels.pack_panels(weight.to(torch.bfloat16)), None
            bounds = _slack(weight.shape[1]) * weight.double().norm(dim=1)
        else:
            q, scale = kernels.quantize_int8(weight)
            panels, bounds = kernels.pack_panels(q), _int8_bounds(weight, q, scale)
        bounds = (bounds * (1 + _MARGIN)).float()
        screen = cls(
            head,
            copy,
            panels,
            scale,
            bounds,
            float(bounds.max()) if bounds.numel() else 0.0,
            copy == "int8" or kernels.linear_widens_bfloat16(),
        )
        if not screen.widened and head.narrow is not None and head.bits <= COPY_BITS[copy]:
            screen.narrow_head_rows = screen._calibrate_narrow_head()
            log.info("greedy_screen.narrow_head", copy=copy, rows=screen.narrow_head_rows)
        return screen

    def _calibrate_narrow_head(self) -> int:
        """The most of `NARROW_HEAD_CALIBRATION_ROWS` at which the head's narrow panels give
        the argmax faster than the screen (0: at none; at most the head's own `narrow_rows`):
        best of 3, alternating, with the caches flushed before each call, as a decode step's
        weights flush them before its head. A head too small for the choice to matter
        (`linear.CALIBRATE_MIN_BYTES`) keeps its narrow panels, and its tests their outcome."""
        head = self.head
        if head.weight.numel() * head.weight.element_size() < CALIBRATE_MIN_BYTES:
            return head.narrow_rows
        generator = torch.Generator().manual_seed(0)  # no draw from the global generator
        flush = torch.zeros(FLUSH_BYTES // 4)
        n, k = head.weight.shape

        def narrow_argmax(x: torch.Tensor) -> torch.Tensor:
            return kernels.panel_linear(x, head.tensor, None, n, head.narrow, head.bits).argmax(-1)

        most = 0
        for rows in NARROW_HEAD_CALIBRATION_ROWS:
            if rows > head.narrow_rows:
                break
            x = torch.randn(rows, k, generator=generator)
            narrow, screen = _best_passes(
                [partial(narrow_argmax, x)],
                [partial(self._screened_argmax, x)],
                before=partial(flush.add_, 1.0),
            )
            times = {"narrow_ms": round(narrow * 1e3, 2), "screen_ms": round(screen * 1e3, 2)}
            log.debug("greedy_screen.narrow_head_calibration_step", rows=rows, **times)
            if screen < narrow:
                break
            most = rows
        return most

    @property
    def vocab_size(self) -> int:
        return self.head.weight.shape[0]

    def pays(self, rows: int, exact: bool = True) -> bool:
        """Whether reading the screen beats the head at this many rows: for exact greedy tokens
        (`argmax`), or for logits as they are (`exact=False`, drafts). Not where the head
        reads no more bits a weight itself, by nominal width (its narrow panels: 8-bit blocks,
        8.5 bits with their scales, count as the int8 copy's 8, and are exact), up to
        `narrow_head_rows` rows (all of them where the copy is widened)."""
        narrow_bits = self.head.narrow_for(rows)[1]
        if narrow_bits and narrow_bits <= COPY_BITS[self.copy] and rows <= self.narrow_head_rows:
            return False
        if not self.widened:
            return True
        return rows <= (WIDENED_MAX_ROWS if exact else WIDENED_MAX_LOGIT_ROWS)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, V]` logits of `[N, K]` rows from the copy (for drafts): bfloat16 from the
        bfloat16 copy, float32 from the int8 one."""
        if self.scale is not None:
            rows = hidden.to(torch.float32).contiguous()
            return kernels.int8_panel_linear(rows, self.panels, self.scale, self.vocab_size)
        return kernels.panel_linear(hidden.to(torch.bfloat16), self.panels, None, self.vocab_size)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The float32 head's argmax of each `[N, K]` float32 row (first index on ties), or
        None where the screen cannot promise it (the caller then computes the logits)."""
        rows = hidden.shape[0]
        if (
            hidden.dim() != 2
            or hidden.dtype != torch.float32
            or rows == 0
            or not self.head.runs_panels(rows)
            or not self.pays(rows)
        ):
            return None
        return self._screened_argmax(hidden.contiguous())

    def _screened_argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`argmax` of contiguous float32 rows through the screen, whatever `pays` says."""
        screen = self.logits(hidden)
        if not kernels.rows_supported(screen):
            return None
        return kernels.screen_argmax(
            hidden,
            screen,
            self.column_bounds,
            self.max_bound,
            _MARGIN,
            self.head.tensor,
            MAX_CANDIDATES,
        )


@dataclass(eq=False)
class ScreenCache:
    """A head's screen, kept for the head's packing it was made for and made again when the
    head is packed anew (a cast, a move, new weights): what `greedy_tokens` and a drafter's
    greedy drafts read."""

    head: PackedWeight | None = None
    screen: GreedyScreen | None = None

    def get(self, head: PackedWeight | None) -> GreedyScreen | None:
        """The screen of `head` (None where it is not a float32 head packed as panels)."""
        if head is not self.head:
            self.head, self.screen = head, GreedyScreen.of(head)
        return self.screen
