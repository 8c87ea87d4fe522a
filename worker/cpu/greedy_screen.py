"""Greedy tokens of a float32 LM head, exactly, from a bfloat16 read of it.

A float32 decode step at batch 1 streams every weight once, and the LM head is a fifth of
them (SmolLM2-135M: 113 of 540 MB, ~3.4 ms of a ~19 ms step on a 2-core Zen 4). A greedy row
needs only the head's argmax. `GreedyScreen` reads a bfloat16 copy of the head instead (half
the bytes), bounds how far each screened logit can be from the float32 head's, and computes
in float32 only the columns whose bound reaches the row's best: their logits bit for bit as
the head's own call gives them (the same panel kernel sums each output column on its own, in
the same order, whichever columns it is given), so the token is the float32 head's argmax,
first index on ties.

The bound. The screen multiplies x and w rounded to bfloat16 (relative error u = 2^-8 each),
sums in float32 and rounds the sum to bfloat16; the head sums x w in float32. With
S = sum_i |w_i| |x_i| and gamma = K 2^-24 (a float32 sum of K products, in any order):

    |head - screen| <= (2u + u^2) S + u (1 + u)^2 S + gamma S + gamma (1 + u)^2 S
                    <= SLACK * S,   and   S <= ||w||_2 ||x||_2 =: B_j / SLACK.

Column j can hold the argmax only if screen_j + B_j >= screen_b - B_b, b the screen's own
argmax. `kernels.screen_columns` applies that test in float32, with its inputs moved so that
float32 rounding only ever keeps more columns; typically one or two columns a row pass.

Only where it is exact: the head's float32 call would run the panel kernel at this many rows
(`PackedWeight.runs_panels`), every value is finite, and the CPU has bfloat16 panels. Where
those widen bfloat16 to float32 (AVX2), the screen multiplies at float32's rate: it answers
steps of up to `WIDENED_MAX_ROWS` rows, which wait on the head's bytes. Drafters read the
screen's logits as they are (`logits`; on AVX2 up to `WIDENED_MAX_LOGIT_ROWS` rows): a draft
needs no exact logits, since the target verifies it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specserve.worker.cpu import kernels
from specserve.worker.cpu.linear import PackedWeight

_U = 2.0**-8  # bfloat16's unit roundoff
_U32 = 2.0**-24
_MARGIN = 2.0**-20  # what float32 inputs of the column test are moved by: 16x its rounding
# A step whose rows keep more columns than this each is left to the float32 head: gathering
# and packing that many of its rows again would cost more than reading half the head.
MAX_CANDIDATES = 4096
# With bfloat16 widened to float32 (AVX2) the screen pays where the float32 head is bound by
# its bytes. A 49,152 x 576 head (SmolLM2) on a 2-core AMD Zen 3, ms: the float32 head and its
# argmax against the screen's argmax, 1 row 6.8 / 4.7, 2 rows 6.5 / 4.4, 4 rows 6.9 / 6.2,
# 8 rows 8.6 / 8.7, 16 rows 13.3 / 14.0 (random rows: ~44 candidate columns a row, where real
# rows keep 1-2); the float32 head against the screen's logits alone (drafts), 1 row 9.0 / 4.2,
# 4 rows 8.2 / 5.3, 8 rows 10.0 / 7.6, 16 rows 13.7 / 12.4, 24 rows 17.3 / 16.4. The engine
# with real rows (A/B, 4 rounds): a limit of 16 against 4 gave batch 8 1.02-1.15x (median
# 1.05x) and batch 16 0.93-1.09x (1.00x).
WIDENED_MAX_ROWS = 8  # argmax (candidate columns recomputed in float32)
WIDENED_MAX_LOGIT_ROWS = 24  # logits alone


def _slack(depth: int) -> float:
    """The bound's factor on ||w|| ||x|| for sums of `depth` products, with 1% to spare."""
    gamma = depth * _U32 / (1 - depth * _U32)
    u = _U
    return 1.01 * ((2 * u + u * u) + u * (1 + u) ** 2 + gamma * (1 + (1 + u) ** 2))


@dataclass(eq=False)
class GreedyScreen:
    """The screen of one float32 head: built by `GreedyScreen.of`, used while `head` (the
    head's packing) is the one in use."""

    head: PackedWeight
    panels: torch.Tensor  # the head's weight in bfloat16, packed for `kernels.panel_linear`
    column_norms: torch.Tensor  # [V] float32: ||w_j||_2, rounded up
    max_norm: float
    slack: float
    widened: bool  # the panels widen bfloat16 to float32 (`kernels.linear_widens_bfloat16`)

    @classmethod
    def of(cls, head: PackedWeight | None) -> GreedyScreen | None:
        """A screen for a float32 head packed as panels on a CPU with bfloat16 panels."""
        if head is None or not head.panels or head.weight.dtype != torch.float32:
            return None
        if torch.bfloat16 not in kernels.linear_dtypes():
            return None
        weight = head.weight.detach()
        norms = (weight.double().norm(dim=1) * (1 + _MARGIN)).float()
        return cls(
            head,
            kernels.pack_panels(weight.to(torch.bfloat16)),
            norms,
            float(norms.max()) if norms.numel() else 0.0,
            _slack(weight.shape[1]),
            kernels.linear_widens_bfloat16(),
        )

    @property
    def vocab_size(self) -> int:
        return self.head.weight.shape[0]

    def pays(self, rows: int, exact: bool = True) -> bool:
        """Whether reading the screen beats the float32 head at this many rows: for exact
        greedy tokens (`argmax`), or for logits as they are (`exact=False`, drafts)."""
        if not self.widened:
            return True
        return rows <= (WIDENED_MAX_ROWS if exact else WIDENED_MAX_LOGIT_ROWS)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, V]` bfloat16 logits of `[N, K]` rows from the bfloat16 copy (for drafts)."""
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
        screen = self.logits(hidden)
        if not kernels.rows_supported(screen):
            return None
        candidates = self._candidates(screen, hidden.double().norm(dim=1))
        if candidates is None:
            return None
        columns = torch.unique(candidates[:, 1])  # sorted: ties go to the lowest id
        exact = kernels.panel_linear(
            hidden, kernels.pack_panels(self.head.weight[columns]), None, columns.numel()
        )
        keep = torch.full((rows, columns.numel()), False)
        keep[candidates[:, 0], torch.searchsorted(columns, candidates[:, 1].contiguous())] = True
        return columns[exact.masked_fill(~keep, -math.inf).argmax(dim=1)]

    def _candidates(self, screen: torch.Tensor, x_norms: torch.Tensor) -> torch.Tensor | None:
        """`[M, 2]` (row, column) pairs that may hold their row's argmax (each row's screened
        best among them); None where a value is not finite or too many columns pass."""
        best_column = kernels.argmax_rows(screen)
        best = screen.gather(1, best_column[:, None])[:, 0].double()
        if not (bool(torch.isfinite(best).all()) and bool(torch.isfinite(x_norms).all())):
            return None  # a NaN or an infinity in a row (argmax_rows gives NaN's index)
        scales = self.slack * x_norms * (1 + _MARGIN)  # B_j = scale * ||w_j||
        floors = best - scales * self.column_norms[best_column].double()
        widest = best.abs() + 2 * scales * self.max_norm  # what the test's terms reach
        floors = floors - widest * _MARGIN - 2.0**-140
        if not bool(torch.isfinite(floors).all()):
            return None
        return kernels.screen_columns(
            screen,
            floors,
            scales,
            self.column_norms,
            self.max_norm,
            MAX_CANDIDATES * screen.shape[0],
        )
