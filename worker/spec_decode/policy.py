"""How many drafts each request verifies next step: speculation only where it pays.

A verified draft is worth the probability that it is accepted (the product of the acceptance
rates up to its position); it costs a target row (on CPU a verification block runs as decode
rows in the fused one-call decode kernel, `torch_backend.token_rows`; elsewhere a step with
verification rows leaves the decode path), and drafting it costs drafter time. At batch 1 a
step is mostly fixed cost and drafts are cheap; at batch 16 a row costs almost as much as a
whole batch-1 step and low-acceptance drafts cost more than they add. So after every step the
policy picks, for the batch it just ran, the set of drafts that maximises expected tokens per
second (down to none), from:

- each request's acceptance rates per draft position, learnt from its verified drafts and from
  *shadow* drafts (below), each rate the request's recent outcomes at that position (counts
  that decay per outcome) with the worker-wide rate counted as `PRIOR_STRENGTH` more: one
  request's outcomes alone swing too far to choose on (an average moving 0.3 a step over drafts
  accepted 55% of the time strays +-0.2, so after two or three rejections it fell below what a
  draft costs and stayed there until a probe, 16-64 steps away for a drafter model; EAGLE-3
  then verified in 37-44% of its batch-1 steps, 1.14-1.16x of no speculation against fixed K's
  1.29-1.30x; with the worker-wide rate counted in, 87-92% of its steps and 1.24-1.27x). The
  *shadow* drafts: drafts proposed but not verified, scored against the tokens the target then
  produces (for a deterministic draft, matching the target's next token has exactly the
  probability of being accepted). n-gram drafts are free, so a request that verifies none
  proposes shadows every step, backing off to every `MAX_FREE_PROBE_EVERY` steps while they
  lead to no verification (scoring them is what they cost); a drafter model proposes them for
  the whole batch every `PROBE_EVERY` steps, backing off to `MAX_PROBE_EVERY` while its probes
  lead to no verification (its drafts do not pay at this batch size, and probing them costs
  drafter time), and while backing off it probes one draft deep;
- the measured cost of steps: seconds against rows, one line each for plain decode steps (every
  request one row), verification steps (decode rows and drafts) and steps with prompt chunks,
  and one for drafting, seconds against draft tokens and the deepest draft of the call (its
  intercept paid by any step that drafts: a DFlash pass drafts its whole block at once; an
  EAGLE-3 call makes a pass per position deep; the K/V a drafter model writes for verified
  rows in a pass of its own is taken off, since every verified row needs it, drafts or not,
  and only that pass's fixed part, which rows put aside share, is priced as drafting's, from
  a line of its own), all fitted online with forgetting so they follow the machine's load.
  Each line is fitted only on its own kind of step: a prompt chunk's rows cost differently
  from a verification's, and a line through both mispredicts either.
  Where verification runs as decode rows (CPU), plain and verification steps are one kind and
  share one line, which also steps up where the rows open another of the panel kernel's row
  tiles (a pass over every weight: drafts that take a step into a new tile pay for it). A
  plain line measured at one size only (plain steps seen at batch 1, then a batch of 16)
  borrows the per-row slope of the plain and verification lines fitted together; a
  verification or drafting line measured at one size scales in proportion (errors that make
  drafts look dear, never cheap), and a step with drafts is never priced below the plain step
  of the same requests plus its draft rows at the verification line's slope.

The requests chosen are those whose estimated acceptance is highest, and so most often
overestimated (the winner's curse): the policy keeps the acceptance it was promised for the drafts
it chose against what they got (forgetting per step, so a discount it no longer needs wears off)
and, where it chooses among two requests or more, discounts every estimate by that ratio and
asks drafts for `MIN_SPEEDUP`. A lone request is not chosen over anyone: it is judged by its own
outcomes, which its estimate follows (the discount and margin refused drafts there that paid).

While the plans verify nothing, the choice is made again on news (requests that came or left,
a first draft more likely accepted than any was then), at a probe, or `IDLE_REPLAN_EVERY` steps
on, not at every step; and a step of the same requests after a plan that proposed nothing, with
no shadow draft pending, is not planned at all (`rests`: the runner then skips `propose` too).

The choice never changes what is generated: drafts are verified losslessly however many there
are. A request sampled with a seed keeps the full K, because its draws per step depend on how
many drafts it verifies, so a seeded request stays reproducible run to run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

REQUEST_DECAY = 0.9  # weight kept by a request's earlier outcomes at a position at each new one
PRIOR_STRENGTH = 4.0  # outcomes the worker-wide rate counts as in each request's rates
PRIOR_RATE_WEIGHT = 0.02  # how fast the worker-wide rates follow every request's outcomes
INITIAL_RATE = 0.5
PROBE_EVERY = 16  # steps between shadow drafts for a drafter model (n-gram: 1)
MAX_PROBE_EVERY = 64  # ... after backing off
MAX_FREE_PROBE_EVERY = 4  # ... for free drafts (n-gram), whose shadows cost only their scoring
# While a plan verifies nothing, the next is chosen again only on news (another batch, a first
# draft more likely accepted than any was then: the best prefix starts with the best draft), at
# a probe, or after this many steps: choosing costs ~0.2-0.6 ms at batch 16 in Python (1-1.5%
# of a step), and at batch 16 some request's rates move at nearly every step (n-gram shadows),
# mostly by little and often down.
IDLE_REPLAN_EVERY = 4
COST_DECAY = 0.97  # weight kept by older cost observations at each new one
MAX_SHADOWS = 4  # pending shadow drafts per request
# Drafts are verified only when they promise this much more throughput than none: a margin for
# the cost lines' noise. The winner's curse is `calibration`'s, measured; a margin of 1.2 stood in
# for it before (it also refused every draft promising 1.05-1.2x: EAGLE-3 at K=1 pays 1.17x at
# batch 1 on a 2-core CPU). n-gram on ShareGPT at batch 4, same run: 1.01x of no speculation with
# the old margin, 1.035x with this one and the discount (which settled at 0.8 there).
MIN_SPEEDUP = 1.05
# ... both applied only where a step chooses among this many requests or more: a lone request
# has no one to be chosen over. EAGLE-3 K=3 at batch 1 on a 2-core Zen 5 VM, A/B in one process
# against no speculation: 1.23x with them, 1.36x without (4 rounds); 1.44x against 1.50x (8
# rounds, an engine each); verifying in 95% of steps (2.40 drafts a step) against 100% (2.86),
# where fixed K=3 ran 1.51x. n-gram at batch 1: level. At batch 4 three A/Bs disagreed (-4% to
# +7.5%), and at 16 n-gram needs them (0.98x with, 0.96x without), so from two requests on they
# stay.
CURSE_MIN_CANDIDATES = 2
CALIBRATION_DECAY = 0.99  # weight kept by earlier verified drafts at each step
CALIBRATION_PRIOR = 2.0  # accepted drafts assumed as promised before any is seen


class CostLine:
    """Seconds against a size, fitted by least squares with exponential forgetting.

    A line whose sizes barely vary has no slope of its own (`slope()` is None): it predicts its
    mean plus a slope it is given. For plain steps the policy gives the slope of its plain and
    verification lines fitted together: scaling in proportion would price a batch-16 decode
    step at 16 batch-1 steps, when most of a small step is fixed cost (streaming the weights),
    and make every verification look cheap beside it. For verification and drafting it gives
    `per_unit()`, the proportional scale, which errs the other way.

    A line can have a second variable z, a + b x + c z, with `c` (`z_slope`) fitted once the
    window holds two values of z apart from x, and kept after they are forgotten:

    - `tiles` (rows -> the CPU panel kernel's row tiles, `kernels.linear_row_tiles`): each
      further tile is another pass over every weight, a step up that a straight line spreads
      over all rows (16-row tiles on a Zen 4: a 17th row cost +16% of the step, a row inside a
      tile 2-5%);
    - `depth` (drafting): z is the deepest draft of a drafting call, given with each
      observation. An EAGLE-3 pass costs ~1 ms a position deep and ~0.1 ms a token wide (K=3:
      4.8 ms for 3 tokens at batch 1, 5.8 for 12 at batch 4), which a line against tokens alone
      prices 2.5x too high at batch 4 when fitted at batch 1.
    """

    def __init__(
        self,
        decay: float = COST_DECAY,
        tiles: Callable[[int], int] | None = None,
        depth: bool = False,
    ) -> None:
        self.decay = decay
        self.weight = self.sum_x = self.sum_y = self.sum_xx = self.sum_xy = 0.0
        self.tiles = tiles
        self.depth = depth
        self._tiles_of: dict[int, int] = {}
        self.sum_z = self.sum_zz = self.sum_xz = self.sum_zy = 0.0
        self.z_slope = 0.0  # seconds a unit of z adds (0.0 until two values of z are seen)

    @property
    def known(self) -> bool:
        return self.weight > 0.0

    def tiles_at(self, x: float) -> int:
        """The row tiles of a step of `x` rows (0 without `tiles`)."""
        if self.tiles is None:
            return 0
        rows = int(x)
        tiles = self._tiles_of.get(rows)
        if tiles is None:
            tiles = self._tiles_of[rows] = self.tiles(rows)
        return tiles

    def observe(self, x: float, seconds: float, z: float = 0.0) -> None:
        """A step of size `x` took `seconds`; `z`: its depth, for a `depth` line."""
        d = self.decay
        self.weight = self.weight * d + 1.0
        self.sum_x = self.sum_x * d + x
        self.sum_y = self.sum_y * d + seconds
        self.sum_xx = self.sum_xx * d + x * x
        self.sum_xy = self.sum_xy * d + x * seconds
        if self.tiles is not None or self.depth:
            if self.tiles is not None:
                z = self.tiles_at(x)
            self.sum_z = self.sum_z * d + z
            self.sum_zz = self.sum_zz * d + z * z
            self.sum_xz = self.sum_xz * d + x * z
            self.sum_zy = self.sum_zy * d + z * seconds
            self._fit_z_slope()

    def _fit_z_slope(self) -> None:
        """Refit `z_slope` where the window holds two values of z or more, varying apart from
        x (else keep the last one)."""
        w = self.weight
        mean_x, mean_z, mean_y = self.sum_x / w, self.sum_z / w, self.sum_y / w
        var_x = self.sum_xx / w - mean_x * mean_x
        var_z = self.sum_zz / w - mean_z * mean_z
        cov_xz = self.sum_xz / w - mean_x * mean_z
        cov_xy = self.sum_xy / w - mean_x * mean_y
        cov_zy = self.sum_zy / w - mean_z * mean_y
        det = var_x * var_z - cov_xz * cov_xz
        if var_z <= 1e-6 or det <= 1e-6 * var_x * var_z:
            return
        self.z_slope = max((cov_zy * var_x - cov_xy * cov_xz) / det, 0.0)

    def spread(self) -> tuple[float, float]:
        """(weighted variance of sizes, covariance of sizes and seconds less z's part), both
        0.0 while the sizes barely vary: what a slope pooled over several lines sums."""
        w = self.weight
        if w <= 0.0:
            return 0.0, 0.0
        mean_x = self.sum_x / w
        var = self.sum_xx / w - mean_x * mean_x
        if var <= 1e-6 * max(1.0, mean_x * mean_x):
            return 0.0, 0.0
        cov = self.sum_xy / w - mean_x * self.sum_y / w
        if self.z_slope:
            cov -= self.z_slope * (self.sum_xz / w - mean_x * self.sum_z / w)
        return var * w, cov * w

    def slope(self) -> float | None:
        """Seconds per unit, or None while the sizes barely vary."""
        var, cov = self.spread()
        return max(cov / var, 0.0) if var > 0.0 else None

    def per_unit(self) -> float:
        """The slope, else (one size seen) mean seconds per unit, fixed cost included: for a
        cost that must never look cheap, like drafting or verification."""
        slope = self.slope()
        if slope is not None:
            return slope
        return self.sum_y / self.sum_x if self.sum_x > 0 else 0.0

    def predict(self, x: float, borrowed_slope: float = 0.0, z: float | None = None) -> float:
        """Seconds at size `x` (and depth `z`, for a `depth` line: default its mean);
        `borrowed_slope` stands in for a slope this line lacks."""
        return self.fitted(borrowed_slope)(x, z)

    def fitted(self, borrowed_slope: float = 0.0) -> Callable[[float, float | None], float]:
        """`predict` with the fit done once, for many sizes: f(x, z=None)."""
        w = self.weight
        if w <= 0.0:
            return lambda x, z=None: 0.0
        mean_x, mean_y = self.sum_x / w, self.sum_y / w
        slope = self.slope()
        slope = borrowed_slope if slope is None else slope
        if not self.z_slope:
            return lambda x, z=None: max(mean_y + slope * (x - mean_x), 1e-9)
        z_slope, mean_z, tiles = self.z_slope, self.sum_z / w, self.tiles is not None

        def seconds(x: float, z: float | None = None) -> float:
            if tiles:
                z = self.tiles_at(x)
            elif z is None:
                z = mean_z
            return max(mean_y + slope * (x - mean_x) + z_slope * (z - mean_z), 1e-9)

        return seconds


def pooled_slope(lines: Sequence[CostLine]) -> float:
    """One slope fitted through every line with its own intercept (0.0 if none has spread)."""
    spreads = [line.spread() for line in lines]
    var = sum(v for v, _ in spreads)
    return max(sum(c for _, c in spreads) / var, 0.0) if var > 0.0 else 0.0


@dataclass
class _RequestAcceptance:
    rates: list[float]  # P(draft j accepted | drafts before it were), j = 1..K
    accepted: list[float]  # drafts accepted at position j, decayed per outcome there
    tried: list[float]  # drafts scored at position j (the ones before it accepted), decayed
    shadows: list[tuple[int, list[int]]] = field(default_factory=list)  # (position, drafts)


@dataclass(frozen=True)
class Candidate:
    """A request that sampled this step and may propose drafts for the next one."""

    handle: int
    token_ids: Sequence[int]  # every token so far; the next draft is for position len(...)
    fixed: bool = False  # verifies K drafts whatever they cost (a seeded sampled request)


@dataclass(frozen=True)
class DraftPlan:
    verify: dict[int, int]  # handle -> drafts to verify next step
    shadow: frozenset[int]  # handles proposing drafts that are only scored, never verified
    shadow_depth: int | None = None  # drafts per shadow proposal (None: K)

    def num_to_propose(self, handle: int, num_spec_tokens: int) -> int:
        if handle in self.shadow:
            return self.shadow_depth or num_spec_tokens
        return self.verify.get(handle, 0)


@dataclass
class PolicyStats:
    """What the policy decided, per batch size (for benchmarks and metrics)."""

    steps: dict[int, int] = field(default_factory=dict)
    speculating_steps: dict[int, int] = field(default_factory=dict)
    drafts_verified: dict[int, int] = field(default_factory=dict)

    def record(self, batch: int, num_drafts: int) -> None:
        self.steps[batch] = self.steps.get(batch, 0) + 1
        if num_drafts:
            self.speculating_steps[batch] = self.speculating_steps.get(batch, 0) + 1
        self.drafts_verified[batch] = self.drafts_verified.get(batch, 0) + num_drafts


class SpecPolicy:
    """Plans each step's drafts; `adaptive=False` always asks for all K (the fixed policy)."""

    def __init__(
        self,
        num_spec_tokens: int,
        free_drafts: bool,
        adaptive: bool = True,
        verifies_as_decode_rows: bool = False,
        row_tiles: Callable[[int], int] | None = None,
        context_rows_in_pass: int = 0,
    ) -> None:
        """`verifies_as_decode_rows`: a verification step runs as a decode step of as many rows
        (CPU, `torch_backend.token_rows`), so both kinds of step are fitted on one line, whose
        slope the two sizes they come in give; with one size seen, a draft row is priced at
        nothing until a verification measures it. `row_tiles`: there, the panel kernel's row
        tiles per step size, whose steps the line then prices (`CostLine`).
        `context_rows_in_pass`: the speculator's (`Speculator.context_rows_in_pass`)."""
        self.k = num_spec_tokens
        self.context_rows_in_pass = context_rows_in_pass
        self.adaptive = adaptive
        self.free_drafts = free_drafts
        self.base_probe_every = 1 if free_drafts else PROBE_EVERY
        self.max_probe_every = MAX_FREE_PROBE_EVERY if free_drafts else MAX_PROBE_EVERY
        self.probe_every = self.base_probe_every
        self._next_probe = self.probe_every
        self.prior = [INITIAL_RATE] * num_spec_tokens
        self.requests: dict[int, _RequestAcceptance] = {}
        self.plain_step = CostLine(tiles=row_tiles if verifies_as_decode_rows else None)
        # one row per request plus drafts
        self.verify_step = self.plain_step if verifies_as_decode_rows else CostLine()
        self.prefill_step = CostLine()  # any step with a prompt chunk
        self.drafting = CostLine(depth=True)
        # seconds against rows of the drafter's context K/V pass (`ContextWrite`): its fixed
        # part is a cost of drafting every step rather than putting rows aside
        self.context_write = CostLine()
        self.stats = PolicyStats()
        self._steps = 0
        # Acceptance promised against acceptance seen, over the drafts the policy chose to verify
        # (decayed per step): the rates it chose on, handle -> rates of those drafts.
        self._promised: dict[int, list[float]] = {}
        self._accepted = self._expected = 0.0
        # While plans verify nothing: the batch the last choice was made for (the requests, the
        # other rows), the best first-draft rate among them and its step; None after a plan
        # that verified drafts.
        self._idle_since: tuple[tuple, float, int] | None = None
        # Candidates of the last plan where it proposed nothing and no shadow draft is pending
        # (then a step of the same requests that verifies nothing changes nothing it chose on:
        # `rests`); None otherwise.
        self._resting_candidates: int | None = None

    # --- observations ---------------------------------------------------------------------

    def observe_step(self, rows: int, num_drafts: int, prefill: bool, seconds: float) -> None:
        """A target step of `rows` rows, `num_drafts` of them drafts, took `seconds`."""
        line = self.prefill_step if prefill else self.verify_step if num_drafts else self.plain_step
        line.observe(rows, seconds)

    def observe_drafting(self, num_tokens: int, seconds: float, depth: int = 1) -> None:
        """A drafting call drafted `num_tokens`, the most for one request `depth`."""
        self.drafting.observe(num_tokens, seconds, depth)

    def observe_context_write(self, rows: int, seconds: float) -> None:
        """The drafter wrote K/V for `rows` verified rows in a pass of its own (drafting time
        observed without it)."""
        self.context_write.observe(rows, seconds)

    def observe_verified(self, handle: int, num_drafts: int, num_accepted: int) -> None:
        promised = self._promised.pop(handle, None)
        if not num_drafts:
            return
        if promised:
            n, p = min(num_drafts, len(promised)), 1.0
            for rate in promised[:n]:
                p *= rate
                self._expected += p
            self._accepted += min(num_accepted, n)
        self._observe(self._request(handle), num_drafts, num_accepted)

    def calibration(self) -> float:
        """Accepted over promised drafts among those the policy chose (at most 1): chosen for
        their high estimates, they are accepted less often than estimated."""
        return min(1.0, (self._accepted + CALIBRATION_PRIOR) / (self._expected + CALIBRATION_PRIOR))

    def add_shadow(self, handle: int, position: int, drafts: list[int]) -> None:
        shadows = self._request(handle).shadows
        if drafts and len(shadows) < MAX_SHADOWS:
            shadows.append((position, drafts))

    def forget(self, handle: int) -> None:
        self.requests.pop(handle, None)
        self._promised.pop(handle, None)

    # --- the plan ---------------------------------------------------------------------------

    def plan(
        self, candidates: Sequence[Candidate], other_decodes: int = 0, prefill_rows: int = 0
    ) -> DraftPlan:
        """Drafts per candidate for the next step, assumed to hold the same requests: the
        candidates (one row each plus their drafts), `other_decodes` requests that decode
        without drafts and `prefill_rows` rows of prompt chunks."""
        self._count_step()
        self._resting_candidates = None
        for cand in candidates:
            self._score_shadows(cand)
        drafted_line = self.prefill_step if prefill_rows else self.verify_step
        if not self.adaptive or not drafted_line.known:
            # Nothing measured yet: verify everything, which is also how the costs get learnt.
            verify = {c.handle: self.k for c in candidates}
            self.stats.record(len(candidates), self.k * len(candidates))
            return DraftPlan(verify, frozenset())
        probing = self._steps >= self._next_probe
        batch = (tuple(c.handle for c in candidates), other_decodes, prefill_rows)
        best_first = max((self._request(c.handle).rates[0] for c in candidates), default=0.0)
        idle = self._idle_since
        # nothing new since a choice of none: the same choice
        unchanged = (
            idle is not None
            and not probing
            and idle[0] == batch
            and best_first <= idle[1]
            and self._steps - idle[2] < IDLE_REPLAN_EVERY
        )
        verify = {} if unchanged else self._choose(candidates, other_decodes, prefill_rows)
        has_drafts = any(verify.values())
        if not unchanged:
            self._idle_since = None if has_drafts else (batch, best_first, self._steps)
        # Backing off, a probe drafts one token a request: one drafter pass instead of K (at
        # batch 16 a K=3 EAGLE-3 probe cost 60-70 ms, more than a target step). Whether a first
        # draft would pay decides whether any does; deeper rates keep what was learnt. Free
        # drafts (n-gram) are proposed K deep whatever the back-off.
        backing_off = self.probe_every > self.base_probe_every
        probe_depth = 1 if backing_off and not self.free_drafts else None
        if has_drafts:
            self.probe_every = self.base_probe_every
        elif probing:  # the last probes led to no verification: probe less often
            self.probe_every = min(2 * self.probe_every, self.max_probe_every)
        if probing:
            self._next_probe = self._steps + self.probe_every
        shadow = frozenset(
            c.handle
            for c in candidates
            if not verify.get(c.handle)
            and probing
            and len(self._request(c.handle).shadows) < MAX_SHADOWS
        )
        self.stats.record(len(candidates), sum(verify.values()))
        quiet = not (has_drafts or shadow or prefill_rows) and not any(
            self._request(c.handle).shadows for c in candidates
        )
        self._resting_candidates = len(candidates) if quiet else None
        return DraftPlan(verify, shadow, probe_depth)

    def rests(self) -> bool:
        """Whether the next plan is the last one's: none. For a decode step of the requests the
        last plan was made for, with no drafts verified; if so it counts as planned, with no
        `plan` to call. That plan proposed nothing and no shadow draft is pending, so no rate
        has moved since; `plan` would find nothing new unless it probes or chooses again by
        the clock (`IDLE_REPLAN_EVERY`), and `rests` says no to those. A request that left the
        drafter's window meanwhile is seen at the next plan (within those steps)."""
        if self._resting_candidates is None:
            return False
        assert self._idle_since is not None  # a plan of none is idle
        step = self._steps + 1
        if step >= self._next_probe or step - self._idle_since[2] >= IDLE_REPLAN_EVERY:
            return False
        self._count_step()
        self.stats.record(self._resting_candidates, 0)
        return True

    def _count_step(self) -> None:
        """A step planned: the step count and the calibration's forgetting move on."""
        self._steps += 1
        self._accepted *= CALIBRATION_DECAY
        self._expected *= CALIBRATION_DECAY

    def _choose(
        self, candidates: Sequence[Candidate], other_decodes: int, prefill_rows: int
    ) -> dict[int, int]:
        """The prefix of drafts, best first, with the most expected tokens per second."""
        base_rows = len(candidates) + other_decodes + prefill_rows
        verify: dict[int, int] = {}
        forced_drafts = 0
        tokens = float(len(candidates) + other_decodes)
        gains: list[tuple[float, int, int]] = []  # (expected extra tokens, draft index, handle)
        among_many = len(candidates) >= CURSE_MIN_CANDIDATES
        discount = self.calibration() if among_many else 1.0
        for cand in candidates:
            p = 1.0
            rates = self._request(cand.handle).rates
            for j, rate in enumerate(rates, start=1):
                p *= rate
                if cand.fixed:
                    tokens += p
                else:
                    gains.append((p * discount, j, cand.handle))
            if cand.fixed:
                verify[cand.handle] = self.k
                forced_drafts += self.k
        gains.sort(key=lambda g: (-g[0], g[1]))
        # Where a line was measured at one size only, its errors must make drafts look dear,
        # never cheap: a plain step borrows the per-row slope the plain and verification
        # lines show together (none: flat), a verification step or drafting scales in
        # proportion.
        # Drafting costs a pass however few its drafts (a DFlash pass drafts its whole block;
        # an EAGLE-3 pass has its metadata and catch-up): the line's own intercept, paid only
        # where something is drafted.
        drafting = self.drafting.fitted(self.drafting.per_unit())
        # A step that drafts writes its verified rows' drafter K/V each step, where one that
        # does not puts them aside: the context pass's fixed part (a line seen at one size
        # has none) is paid for drafting, unless the rows ride in the drafting pass (at most
        # `context_rows_in_pass` of them; a step's accepted drafts are at most its drafts, and
        # a step with prompt rows brings those too).
        context_pass = 0.0
        if self.context_write.known:
            context_pass = self.context_write.predict(0.0, self.context_write.per_unit())
        drafted_line = self.prefill_step if prefill_rows else self.verify_step
        if drafted_line is self.plain_step:
            # Verification runs as decode rows: one line, and while it has seen one size only
            # (every step plain, say) a draft row is priced at nothing, so that a draft worth
            # it gets verified, which gives the line its slope (and prices the next ones).
            per_row = drafted_line.slope() or 0.0
        else:
            per_row = drafted_line.per_unit()
        drafted_step = drafted_line.fitted(per_row)
        plain = None
        if not prefill_rows and self.plain_step.known:
            plain = self.plain_step.predict(
                base_rows, pooled_slope((self.plain_step, self.verify_step))
            )

        def seconds(num_drafts: int, depth: int) -> float:
            step = drafted_step(base_rows + num_drafts)
            if plain is not None:
                if num_drafts == 0:
                    return plain
                # A draft row costs at least the line's own slope over the plain step: a
                # verification line fitted mostly on small batches can pass below the plain
                # line measured at this batch size.
                step = max(step, plain + per_row * num_drafts)
            if not num_drafts:
                return step
            rides = not prefill_rows and num_drafts <= self.context_rows_in_pass
            return step + drafting(num_drafts, depth) + (0.0 if rides else context_pass)

        depth = self.k if forced_drafts else 0
        plain_rate = tokens / seconds(forced_drafts, depth)
        best_rate, best_n = plain_rate, 0
        last_rate = plain_rate
        tiles = drafted_line.tiles_at
        for n, (gain, j, _) in enumerate(gains, start=1):
            tokens += gain
            rows = base_rows + forced_drafts + n
            deeper = j > depth
            depth = max(depth, j)
            rate = tokens / seconds(forced_drafts + n, depth)
            if rate > best_rate:
                best_rate, best_n = rate, n
            # From the first draft on, each further draft adds no less time than a draft inside
            # a row tile and no deeper than the drafts before it (every line is straight; the
            # larger of two straight lines is convex) and no more tokens (sorted): once the
            # rate falls on such a draft it keeps falling, so no later prefix wins. A draft
            # that opens a tile or a drafting position adds more time than the next one: the
            # rate may fall there and rise again.
            if n > 1 and rate < last_rate and not deeper and tiles(rows) == tiles(rows - 1):
                break
            last_rate = rate
        if among_many and best_rate < plain_rate * MIN_SPEEDUP:
            best_n = 0
        for _, j, handle in gains[:best_n]:
            verify[handle] = max(verify.get(handle, 0), j)
        for cand in candidates:
            if not cand.fixed and verify.get(cand.handle):
                rates = self._request(cand.handle).rates
                self._promised[cand.handle] = rates[: verify[cand.handle]]
        return verify

    # --- acceptance -------------------------------------------------------------------------

    def _request(self, handle: int) -> _RequestAcceptance:
        state = self.requests.get(handle)
        if state is None:
            zeros = [0.0] * self.k
            state = self.requests[handle] = _RequestAcceptance(list(self.prior), zeros, zeros[:])
        return state

    def _observe(self, state: _RequestAcceptance, num_drafts: int, num_accepted: int) -> None:
        """Drafts 1..accepted were accepted and the next one (if any) rejected."""
        for j in range(min(num_accepted + 1, num_drafts, self.k)):
            outcome = 1.0 if j < num_accepted else 0.0
            state.accepted[j] = REQUEST_DECAY * state.accepted[j] + outcome
            state.tried[j] = REQUEST_DECAY * state.tried[j] + 1.0
            self.prior[j] += PRIOR_RATE_WEIGHT * (outcome - self.prior[j])
        state.rates = [
            (accepted + PRIOR_STRENGTH * prior) / (tried + PRIOR_STRENGTH)
            for accepted, tried, prior in zip(state.accepted, state.tried, self.prior, strict=True)
        ]

    def _score_shadows(self, cand: Candidate) -> None:
        state = self.requests.get(cand.handle)
        if state is None or not state.shadows:
            return
        pending = []
        for position, drafts in state.shadows:
            produced = cand.token_ids[position : position + len(drafts)]
            matched = next(
                (i for i, (d, t) in enumerate(zip(drafts, produced, strict=False)) if d != t),
                len(produced),
            )
            if matched < len(produced) or len(produced) == len(drafts):
                self._observe(state, len(drafts), matched)
            else:
                pending.append((position, drafts))
        state.shadows = pending
