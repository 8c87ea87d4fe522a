"""The speculation policy: cost lines, acceptance learnt from verified and shadow drafts, and the
choice of drafts, checked against brute force over every possible choice."""

from __future__ import annotations

import itertools

import pytest

from specserve.worker.spec_decode import policy as policy_module
from specserve.worker.spec_decode.policy import (
    CURSE_MIN_CANDIDATES,
    IDLE_REPLAN_EVERY,
    INITIAL_RATE,
    MAX_FREE_PROBE_EVERY,
    MIN_SPEEDUP,
    PRIOR_RATE_WEIGHT,
    PRIOR_STRENGTH,
    REQUEST_DECAY,
    Candidate,
    CostLine,
    SpecPolicy,
)

K = 3


def _costs(
    policy: SpecPolicy,
    plain: tuple[float, float],
    mixed: tuple[float, float],
    prefill: tuple[float, float] = (0.02, 0.0006),
) -> None:
    """Feed exact lines: seconds = a + b * rows (plain, verification and prefill steps), drafting
    free."""
    for rows in (1, 2, 4, 8, 16, 32, 64):
        policy.observe_step(rows, 0, False, plain[0] + plain[1] * rows)
        policy.observe_step(rows, 1, False, mixed[0] + mixed[1] * rows)
        policy.observe_step(rows, 0, True, prefill[0] + prefill[1] * rows)
        policy.observe_drafting(rows, 0.0)


def _set_rates(policy: SpecPolicy, handle: int, rates: list[float]) -> None:
    policy._request(handle).rates = list(rates)


def test_cost_line_fits_a_line_and_follows_a_change():
    line = CostLine(decay=0.9)
    assert not line.known
    for x in (1, 3, 7, 20):
        line.observe(x, 0.002 + 0.0005 * x)
    assert line.predict(10) == pytest.approx(0.007)
    assert line.slope() == pytest.approx(0.0005)
    for _ in range(200):  # the machine got twice as slow: old points are forgotten
        for x in (2, 9):
            line.observe(x, 2 * (0.002 + 0.0005 * x))
    assert line.predict(10) == pytest.approx(0.014, rel=1e-3)


def test_cost_line_of_one_size_borrows_a_slope():
    line = CostLine()
    for _ in range(5):
        line.observe(4, 0.008)
    assert line.slope() is None
    assert line.predict(4) == pytest.approx(0.008)
    assert line.predict(16) == pytest.approx(0.008)
    assert line.predict(16, borrowed_slope=0.001) == pytest.approx(0.020)
    assert line.per_unit() == pytest.approx(0.002)  # drafting: never free


def _tiles_of(size: int):
    return lambda rows: -(-rows // size)


def test_cost_line_with_row_tiles_fits_their_step_and_keeps_it():
    """a + b rows + c tiles, exactly; once every step the window holds is of one tile count,
    the step last fitted still prices the next tile."""
    line = CostLine(decay=0.9, tiles=_tiles_of(16))
    for _ in range(3):
        for rows in (1, 4, 9, 16, 17, 20, 28, 33):
            line.observe(rows, 0.010 + 0.001 * rows + 0.004 * -(-rows // 16))
    assert line.z_slope == pytest.approx(0.004)
    assert line.slope() == pytest.approx(0.001)
    assert line.predict(16) == pytest.approx(0.030)
    assert line.predict(17) == pytest.approx(0.035)
    for _ in range(300):  # batch 16 decoding alone: the two-tile steps are forgotten
        for rows in (15, 16):
            line.observe(rows, 0.014 + 0.001 * rows)
    assert line.z_slope == pytest.approx(0.004)
    assert line.predict(17) == pytest.approx(0.035, rel=1e-6)
    plain = CostLine(decay=0.9)  # a straight line through the same steps spreads the jump
    for rows in (1, 4, 9, 16, 17, 20, 28, 33):
        plain.observe(rows, 0.010 + 0.001 * rows + 0.004 * -(-rows // 16))
    assert plain.predict(17) - plain.predict(16) < 0.002


@pytest.mark.parametrize(("tile", "verified"), [(16, 0), (28, K)])
def test_a_draft_that_opens_another_row_tile_pays_for_its_pass(tile: int, verified: int):
    """Batch 16 on CPU, one request accepting 90% of its drafts: inside the tile a draft row
    costs 1 ms of a 26 ms step and three drafts pay (18.44 tokens in 29 ms against 16 in 26);
    where the 17th row opens a second tile (+4 ms) none does (18.44 in 33 ms)."""
    policy = SpecPolicy(
        K, free_drafts=True, verifies_as_decode_rows=True, row_tiles=_tiles_of(tile)
    )
    for _ in range(5):
        for rows in (1, 2, 4, 8, 16, 17, 20, 24, 28, 29, 32, 40, 56, 57, 64):
            tiles = -(-rows // tile)
            policy.observe_step(rows, 0, False, 0.006 + 0.001 * rows + 0.004 * tiles)
    _set_rates(policy, 0, [0.9, 0.9, 0.9])
    plan = policy.plan([Candidate(0, [])], other_decodes=15)
    assert plan.verify.get(0, 0) == verified


def _eagle3_drafting(tokens: int, depth: int) -> float:
    """An EAGLE-3 drafting call on a 2-core CPU, as measured: ~1.7 ms, ~1 ms a position deep
    and ~0.1 ms a token wide (K=3: 4.8 ms for 3 tokens at batch 1, 5.8 ms for 12 at batch 4)."""
    return 0.0017 + 0.001 * depth + 0.0001 * tokens


def test_drafting_line_fits_depth_and_width():
    line = CostLine(depth=True)
    for tokens, depth in ((1, 1), (3, 3), (4, 1), (12, 3), (2, 2)):
        line.observe(tokens, _eagle3_drafting(tokens, depth), depth)
    assert line.z_slope == pytest.approx(0.001)
    assert line.slope() == pytest.approx(0.0001)
    assert line.predict(12, z=3) == pytest.approx(_eagle3_drafting(12, 3))
    assert line.predict(16, z=1) == pytest.approx(_eagle3_drafting(16, 1))


@pytest.mark.parametrize("by_depth", [True, False])
def test_a_wide_drafting_pass_is_priced_by_its_depth(by_depth: bool):
    """Batch 4 (an 18 ms step, 1 ms a row), each request accepting half its first drafts:
    a first draft for all four, one pass one position deep (3.1 ms), pays 1.076x (6 tokens in
    25.1 ms against 4 in 18). Drafting was seen at batch 1 (1 and 3 tokens, as deep) and at
    batch 4 three deep (12 tokens): against tokens alone that line prices the four at 4.3 ms,
    1.027x, under the margin, and they are refused."""
    policy = SpecPolicy(K, free_drafts=False, verifies_as_decode_rows=True)
    if not by_depth:
        policy.drafting = CostLine()  # seconds against draft tokens alone
    for _ in range(5):
        for rows in (1, 2, 4, 8, 16):
            policy.observe_step(rows, 0, False, 0.014 + 0.001 * rows)
        for tokens, depth in ((1, 1), (3, 3), (12, 3)):
            policy.observe_drafting(tokens, _eagle3_drafting(tokens, depth), depth)
    assert policy.drafting.predict(4, z=1) == pytest.approx(
        _eagle3_drafting(4, 1) if by_depth else 0.00427, rel=1e-2
    )
    for h in range(4):
        _set_rates(policy, h, [0.5, 0.4, 0.3])
    verify = policy.plan([Candidate(h, []) for h in range(4)]).verify
    assert verify == (dict.fromkeys(range(4), 1) if by_depth else {})


@pytest.mark.parametrize(
    ("context_pass", "rows_in_pass"), [(False, 0), (True, 0), (True, 3), (True, 4)]
)
def test_the_drafters_context_pass_prices_its_fixed_part_into_drafting(
    context_pass: bool, rows_in_pass: int
):
    """The batch-4 case above, where the drafter also writes its verified rows' K/V in a pass
    of its own, 0.8 ms plus 0.02 ms a row: a step that drafts pays that 0.8 ms every step, one
    that does not puts its rows aside for a later pass. The first draft for all four, 1.076x
    without it, is 1.042x with it (6 tokens in 25.9 ms against 4 in 18), under the margin.
    Seen at one size only, the pass has no fixed part to price. Where up to 4 rows ride in the
    drafting pass (`context_rows_in_pass`), 4 drafts (at most 4 accepted rows) pay no context
    pass, and are verified again; up to 3, they would not ride."""
    policy = SpecPolicy(
        K, free_drafts=False, verifies_as_decode_rows=True, context_rows_in_pass=rows_in_pass
    )
    for _ in range(5):
        for rows in (1, 2, 4, 8, 16):
            policy.observe_step(rows, 0, False, 0.014 + 0.001 * rows)
        for tokens, depth in ((1, 1), (3, 3), (12, 3)):
            policy.observe_drafting(tokens, _eagle3_drafting(tokens, depth), depth)
        for rows in (4, 16, 40) if context_pass else (4,):
            policy.observe_context_write(rows, 0.0008 + 0.00002 * rows)
    for h in range(4):
        _set_rates(policy, h, [0.5, 0.4, 0.3])
    verify = policy.plan([Candidate(h, []) for h in range(4)]).verify
    priced = context_pass and rows_in_pass < 4
    assert verify == ({} if priced else dict.fromkeys(range(4), 1))


def test_plain_steps_seen_at_batch_1_are_not_priced_in_proportion_at_batch_16():
    """Plain steps measured only at batch 1 (30 ms) and verification steps at batch 1 with 1-3
    drafts (48 ms, +2.5 ms a row): at batch 16 a plain step is not 16 x 30 ms. With the slope
    of the verification line, drafts accepted at 0.35-0.5 do not pay there (they did at 480
    ms a plain step), and drafts accepted at 0.95 still do."""
    policy = SpecPolicy(K, free_drafts=False)
    for _ in range(20):
        policy.observe_step(1, 0, False, 0.030)
        for drafts in (1, 2, 3):
            policy.observe_step(1 + drafts, drafts, False, 0.048 + 0.0025 * (drafts - 1))
        policy.observe_drafting(0, 0.0)
        policy.observe_drafting(3, 0.0)
    candidates = [Candidate(h, [1, 2, 3]) for h in range(16)]
    for h in range(16):
        _set_rates(policy, h, [0.35, 0.4, 0.5])
    assert not any(policy.plan(candidates).verify.values())
    for h in range(16):
        _set_rates(policy, h, [0.95, 0.95, 0.95])
    assert sum(policy.plan(candidates).verify.values()) > 0


def test_a_verification_step_is_never_priced_below_the_plain_step():
    """Plain steps seen at batch 16 (40 ms, one fused call), verification steps mostly at batch 1
    (4 rows, 13 ms) and once in a while at 64 rows (90 ms): the verification line passes below
    the plain one just above 16 rows, where a few drafts accepted at 0.3 would look like a 1.4x
    gain. Priced at the plain step plus their rows at the line's slope, they do not pay."""
    policy = SpecPolicy(K, free_drafts=False)
    for _ in range(20):
        policy.observe_step(16, 0, False, 0.040)
        policy.observe_step(4, 3, False, 0.013)
        policy.observe_step(64, 48, False, 0.090)
        policy.observe_drafting(0, 0.0)
        policy.observe_drafting(16, 0.0)
    assert policy.verify_step.predict(17) < policy.plain_step.predict(16)
    candidates = [Candidate(h, []) for h in range(16)]
    for h in range(16):
        _set_rates(policy, h, [0.3] * K)
    assert not any(policy.plan(candidates).verify.values())
    for h in range(16):
        _set_rates(policy, h, [0.9] * K)  # drafts that do pay are still verified
    assert sum(policy.plan(candidates).verify.values()) > 0


@pytest.mark.parametrize("as_decode_rows", [False, True])
def test_verification_run_as_decode_rows_is_priced_on_the_plain_line(as_decode_rows):
    """Batch 1 on CPU: plain steps 22 ms, 4-row verification steps 22.9 ms (decode rows in the
    fused kernel), drafting 2.5 ms a draft. On one line, a draft row costs its 0.3 ms slope and
    a request accepting 35% of its drafts gains 1.2x from one; a verification line of one size
    in proportion prices a row at 5.7 ms, and the same draft is refused."""
    policy = SpecPolicy(K, free_drafts=False, verifies_as_decode_rows=as_decode_rows)
    for _ in range(20):
        policy.observe_step(1, 0, False, 0.022)
        policy.observe_step(4, 3, False, 0.0229)
        policy.observe_drafting(3, 0.0075)
    assert (policy.verify_step is policy.plain_step) == as_decode_rows
    _set_rates(policy, 0, [0.35, 0.1, 0.05])
    verify = policy.plan([Candidate(0, [1, 2, 3])]).verify
    assert verify.get(0, 0) == (1 if as_decode_rows else 0)


def test_one_line_seen_at_one_size_prices_draft_rows_at_nothing_until_measured():
    """Every step plain for a while (the verification points forgotten): the shared line has no
    slope, and a draft worth verifying at no row cost is verified, which measures it."""
    policy = SpecPolicy(K, free_drafts=False, verifies_as_decode_rows=True)
    for _ in range(50):
        policy.observe_step(1, 0, False, 0.022)
        policy.observe_drafting(3, 0.0075)
    assert policy.plain_step.slope() is None
    _set_rates(policy, 0, [0.6, 0.2, 0.1])
    assert policy.plan([Candidate(0, [1, 2, 3])]).verify == {0: 1}
    _set_rates(policy, 0, [0.1, 0.1, 0.1])  # 1.1 tokens for 1.11x the time: below the margin
    assert not any(policy.plan([Candidate(0, [1, 2, 3])]).verify.values())


def _estimate(accepted: float, tried: float, prior: float) -> float:
    return (accepted + PRIOR_STRENGTH * prior) / (tried + PRIOR_STRENGTH)


def test_verified_outcomes_move_request_rates_and_the_prior():
    policy = SpecPolicy(K, free_drafts=True)
    policy.observe_verified(7, num_drafts=3, num_accepted=1)  # draft 1 accepted, 2 rejected
    assert policy.prior == pytest.approx(
        [INITIAL_RATE + PRIOR_RATE_WEIGHT * 0.5, INITIAL_RATE - PRIOR_RATE_WEIGHT * 0.5, 0.5]
    )
    prior = policy.prior
    assert policy.requests[7].rates == pytest.approx(  # the 3rd draft not seen: the prior
        [_estimate(1, 1, prior[0]), _estimate(0, 1, prior[1]), INITIAL_RATE]
    )
    policy.observe_verified(8, num_drafts=2, num_accepted=2)  # all accepted: nothing rejected
    assert policy.requests[8].rates[2] == policy.prior[2] == INITIAL_RATE
    policy.forget(7)
    assert 7 not in policy.requests


def test_a_request_rate_holds_through_a_few_rejections_and_follows_a_run_of_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request's rate counts the worker-wide rate in: two rejections of drafts the worker
    sees accepted 55% of the time leave it near 0.37 (an average moving 0.3 a step fell to
    0.27), ten in a row take it to 0.21, ten acceptances to 0.83."""
    monkeypatch.setattr(policy_module, "PRIOR_RATE_WEIGHT", 0.0)  # held by many other requests
    policy = SpecPolicy(1, free_drafts=True)
    policy.prior = [0.55]
    tried = 0.0
    for n in range(1, 11):
        policy.observe_verified(1, num_drafts=1, num_accepted=0)
        policy.observe_verified(2, num_drafts=1, num_accepted=1)
        tried = REQUEST_DECAY * tried + 1.0
        if n == 2:
            assert policy.requests[1].rates[0] == pytest.approx(_estimate(0, tried, 0.55))
            assert 0.36 < policy.requests[1].rates[0] < 0.38
    assert 0.20 < policy.requests[1].rates[0] < 0.22
    assert policy.requests[2].rates[0] == pytest.approx(_estimate(tried, tried, 0.55))
    assert 0.82 < policy.requests[2].rates[0] < 0.84


def test_shadow_drafts_are_scored_against_the_tokens_the_target_produced():
    policy = SpecPolicy(K, free_drafts=True)
    policy.add_shadow(1, position=10, drafts=[5, 6, 7])
    tokens = [*range(10), 5, 6]  # positions 10, 11 known: both match, 12 not yet
    policy.plan([Candidate(1, tokens)])
    assert policy.requests[1].shadows == [(10, [5, 6, 7])]  # still pending
    assert policy.requests[1].rates == [INITIAL_RATE] * K
    policy.plan([Candidate(1, [*tokens, 9])])  # position 12 is 9: 2 accepted, the 3rd rejected
    assert policy.requests[1].shadows == []
    prior = list(policy.prior)  # where a new request starts (moved by request 1's outcome)
    assert policy.requests[1].rates == pytest.approx(
        [_estimate(1, 1, prior[0]), _estimate(1, 1, prior[1]), _estimate(0, 1, prior[2])]
    )
    policy.add_shadow(2, position=3, drafts=[1, 2])
    policy.plan([Candidate(2, [0, 0, 0, 4])])  # the first draft already missed: scored at once
    first = _estimate(0, 1, policy.prior[0])
    assert policy.requests[2].rates == pytest.approx([first, prior[1], prior[2]])


def _throughput(
    policy: SpecPolicy, rates: dict[int, list[float]], verify: dict[int, int], prefill: int
) -> float:
    """Expected tokens per second of one choice, from the policy's own cost lines."""
    tokens = 0.0
    drafts = sum(verify.values())
    for handle, k in verify.items():
        p, tokens = 1.0, tokens + 1.0
        for rate in rates[handle][:k]:
            p *= rate
            tokens += p
    rows = len(verify) + prefill
    if prefill:
        seconds = policy.prefill_step.predict(rows + drafts) + policy.drafting.slope() * drafts
    elif drafts == 0:
        seconds = policy.plain_step.predict(rows)
    else:
        floor = policy.plain_step.predict(rows) + policy.verify_step.slope() * drafts
        step = max(policy.verify_step.predict(rows + drafts), floor)
        seconds = step + policy.drafting.slope() * drafts
    return tokens / seconds


@pytest.mark.parametrize(
    ("plain", "mixed", "prefill"),
    [
        ((0.0075, 0.0008), (0.011, 0.0008), 0),  # CPU batch 1-16: verification leaves fused decode
        ((0.005, 0.0001), (0.005, 0.0001), 0),  # a GPU-like step: rows are nearly free
        ((0.001, 0.004), (0.001, 0.004), 0),  # every row costs a lot: drafts rarely pay
        ((0.0075, 0.0008), (0.011, 0.0008), 40),  # a prefill chunk rides along
    ],
)
@pytest.mark.parametrize("many", [False, True])
def test_the_choice_is_the_best_of_every_possible_one(plain, mixed, prefill, many):
    """For a lone request the best choice, however small its gain; among several (where the
    winner's curse is discounted), the best only if it promises MIN_SPEEDUP."""
    policy = SpecPolicy(K, free_drafts=True)
    _costs(policy, plain, mixed)
    rates = {
        1: [0.9, 0.8, 0.7],
        2: [0.5, 0.5, 0.5],
        3: [0.2, 0.1, 0.1],
        4: [0.7, 0.2, 0.9],
    }
    if not many:
        rates = {3: rates[3]}
    assert (len(rates) >= CURSE_MIN_CANDIDATES) == many
    for handle, r in rates.items():
        _set_rates(policy, handle, r)
    plan = policy.plan([Candidate(h, []) for h in rates], prefill_rows=prefill)
    chosen = {h: plan.verify.get(h, 0) for h in rates}
    best = max(
        _throughput(policy, rates, dict(zip(rates, ks, strict=True)), prefill)
        for ks in itertools.product(range(K + 1), repeat=len(rates))
    )
    plain = _throughput(policy, rates, dict.fromkeys(rates, 0), prefill)
    if many and best < plain * MIN_SPEEDUP:  # not worth leaving decoding without drafts
        assert not any(chosen.values())
    else:
        assert _throughput(policy, rates, chosen, prefill) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("jump", [0.0005, 0.003, 0.02])
def test_the_choice_is_the_best_of_every_possible_one_across_row_tiles(jump: float):
    """Steps rising by `jump` every 4 rows (a tile): the rate can fall on a draft that opens a
    tile and rise on the next ones, so the search must not stop there."""
    policy = SpecPolicy(K, free_drafts=True, verifies_as_decode_rows=True, row_tiles=_tiles_of(4))
    for _ in range(5):
        for rows in range(1, 33):
            policy.observe_step(rows, 0, False, 0.008 + 0.0004 * rows + jump * -(-rows // 4))
    assert policy.plain_step.z_slope == pytest.approx(jump)
    rates = {1: [0.95, 0.9, 0.9], 2: [0.9, 0.8, 0.5], 3: [0.6, 0.5, 0.5], 4: [0.3, 0.9, 0.9]}
    for handle, r in rates.items():
        _set_rates(policy, handle, r)
    plan = policy.plan([Candidate(h, []) for h in rates], other_decodes=1)
    chosen = {h: plan.verify.get(h, 0) for h in rates}

    def throughput(verify: dict[int, int]) -> float:
        tokens = 1.0
        for handle, k in verify.items():
            p, tokens = 1.0, tokens + 1.0
            for rate in rates[handle][:k]:
                p *= rate
                tokens += p * policy.calibration()
        return tokens / policy.plain_step.predict(1 + len(verify) + sum(verify.values()))

    best = max(
        throughput(dict(zip(rates, ks, strict=True)))
        for ks in itertools.product(range(K + 1), repeat=len(rates))
    )
    if best < throughput(dict.fromkeys(rates, 0)) * MIN_SPEEDUP:
        assert not any(chosen.values())
    else:
        assert throughput(chosen) == pytest.approx(best, rel=1e-9)


def test_cheap_rows_verify_everything_and_costly_rows_nothing():
    policy = SpecPolicy(K, free_drafts=True)
    _costs(policy, plain=(0.005, 0.0001), mixed=(0.005, 0.0001))
    candidates = [Candidate(h, []) for h in range(16)]
    for h in range(16):
        _set_rates(policy, h, [0.8] * K)
    assert policy.plan(candidates).verify == {h: K for h in range(16)}
    policy = SpecPolicy(K, free_drafts=True)
    _costs(policy, plain=(0.0066, 0.00076), mixed=(0.011, 0.00083))  # measured on a 2-core CPU
    for h in range(16):
        _set_rates(policy, h, [0.4] * K)
    plan = policy.plan(candidates)
    assert plan.verify == {}
    assert plan.shadow == frozenset(range(16))  # n-gram drafts are free: scored in the shadow
    assert plan.num_to_propose(3, K) == K


def test_a_drafting_pass_costs_its_fixed_part_however_few_its_drafts():
    """A DFlash pass drafts its whole block at once: the drafting line is flat, and a draft that
    would pay if drafting were priced by its slope alone (nothing) does not pay its pass."""
    policy = SpecPolicy(K, free_drafts=False, verifies_as_decode_rows=True)
    for rows in (1, 2, 4):  # a 20 ms step, 1 ms a row; a drafting pass 4 ms at any size
        policy.observe_step(rows, rows - 1, False, 0.019 + 0.001 * rows)
    for drafts in (1, 2, 3):
        policy.observe_drafting(drafts, 0.004)
    _set_rates(policy, 1, [0.2, 0.1, 0.1])  # one draft: 1.2 tokens in 25 ms, below plain's 1 in 20
    assert policy.plan([Candidate(1, [])]).verify == {}
    _set_rates(policy, 1, [0.5, 0.1, 0.1])  # 1.5 tokens in 25 ms: pays
    assert policy.plan([Candidate(1, [])]).verify == {1: 1}


def test_a_seeded_sampled_request_always_verifies_k_and_others_adapt_around_it():
    policy = SpecPolicy(K, free_drafts=False)
    _costs(policy, plain=(0.0066, 0.00076), mixed=(0.011, 0.00083))
    for h in range(4):
        _set_rates(policy, h, [0.05] * K)
    plan = policy.plan([Candidate(0, [], fixed=True), *(Candidate(h, []) for h in (1, 2, 3))])
    assert plan.verify == {0: K}
    assert plan.shadow == frozenset()  # a drafter model probes only every PROBE_EVERY steps


def test_fixed_policy_and_cold_start_verify_k_everywhere():
    fixed = SpecPolicy(K, free_drafts=True, adaptive=False)
    _costs(fixed, plain=(0.001, 0.004), mixed=(0.001, 0.004))
    assert fixed.plan([Candidate(1, []), Candidate(2, [])]).verify == {1: K, 2: K}
    cold = SpecPolicy(K, free_drafts=True)  # no step measured yet: verify, and learn the costs
    assert cold.plan([Candidate(1, [])]).verify == {1: K}
    assert fixed.stats.steps == {2: 1} and fixed.stats.drafts_verified == {2: 2 * K}


def test_a_drafter_model_probes_less_often_while_its_drafts_do_not_pay():
    policy = SpecPolicy(K, free_drafts=False)
    _costs(policy, plain=(0.0066, 0.00076), mixed=(0.011, 0.00083))
    candidates = [Candidate(h, []) for h in range(8)]
    probes, depths = [], []
    for step in range(1, 200):
        for h in range(8):
            _set_rates(policy, h, [0.05] * K)
            policy.requests[h].shadows.clear()
        plan = policy.plan(candidates)
        if plan.shadow:
            probes.append(step)
            depths.append(plan.num_to_propose(0, K))
    assert probes[:4] == [16, 48, 112, 176]  # every 16 steps, then 32, 64, 64
    assert depths[:4] == [K, 1, 1, 1]  # K deep, then one draft deep while backing off
    # Free drafts (n-gram): shadows at the first step, then two steps on, then every
    # MAX_FREE_PROBE_EVERY steps, always K deep.
    ngram = SpecPolicy(K, free_drafts=True)
    _costs(ngram, plain=(0.0066, 0.00076), mixed=(0.011, 0.00083))
    for h in range(8):
        _set_rates(ngram, h, [0.05] * K)
    plans = [ngram.plan(candidates) for _ in range(20)]
    probes = [step for step, plan in enumerate(plans, start=1) if plan.shadow]
    assert probes == [1, 3, 7, 11, 15, 19]
    assert MAX_FREE_PROBE_EVERY == 4
    assert all(plans[step - 1].num_to_propose(0, K) == K for step in probes)
    for h in range(8):
        _set_rates(ngram, h, [0.99] * K)  # the requests start repeating: verified at once
    assert ngram.plan(candidates).verify == dict.fromkeys(range(8), K)
    for h in range(8):
        _set_rates(ngram, h, [0.05] * K)
    # verification reset the back-off: after the probe already due (step 23), shadows at the
    # base rate again, then backing off
    assert [bool(ngram.plan(candidates).shadow) for _ in range(4)] == [False, True, False, True]


def test_a_plan_of_no_drafts_is_chosen_again_on_news_or_every_few_steps():
    """While nothing pays, choosing again each step would mostly give the same answer at 1-1.5%
    of a step: the choice is made again for another batch, for a first draft more likely
    accepted than the best was, at a probe, or IDLE_REPLAN_EVERY steps on."""
    policy = SpecPolicy(K, free_drafts=False)
    _costs(policy, plain=(0.0066, 0.00076), mixed=(0.011, 0.00083))
    candidates = [Candidate(h, []) for h in range(8)]
    for h in range(8):
        _set_rates(policy, h, [0.05] * K)
    chosen = []
    real_choose = policy._choose

    def counting_choose(*args):
        chosen.append(policy._steps)
        return real_choose(*args)

    policy._choose = counting_choose
    for _ in range(12):
        assert not policy.plan(candidates).verify
    assert IDLE_REPLAN_EVERY == 4
    assert chosen == [1, 5, 9]
    assert not policy.plan(candidates[:7]).verify  # a request left: chosen again
    assert chosen[-1] == 13
    _set_rates(policy, 0, [0.01, 0.9, 0.9])  # rates that moved, the best first one did not
    assert not policy.plan(candidates[:7]).verify
    assert chosen[-1] == 13
    for h in range(7):
        _set_rates(policy, h, [0.95] * K)  # first drafts more likely accepted: chosen again
    assert policy.plan(candidates[:7]).verify == dict.fromkeys(range(7), K)
    assert chosen[-1] == 15
    assert policy.plan(candidates[:7]).verify  # verifying: chosen every step
    assert chosen[-1] == 16
    for h in range(8):
        _set_rates(policy, h, [0.05] * K)
    plans = [policy.plan(candidates) for _ in range(16)]  # steps 17..32, a probe at 32
    assert chosen[-5:] == [17, 21, 25, 29, 32]
    assert [step for step, p in enumerate(plans, start=17) if p.shadow] == [32]


def test_promises_that_verified_drafts_do_not_keep_are_discounted():
    """The winner's curse: among several requests, those chosen for verification are the ones whose
    estimates are highest, so most often too high. The policy compares the acceptance it was
    promised with what the verified drafts got and discounts its estimates by that: requests
    whose estimates stay at 0.4 a draft while nothing is accepted are verified only now and
    then (the comparison forgets, so the policy tries again); ones that get what was promised
    go on."""
    handles = range(4)
    candidates = [Candidate(h, [1, 2, 3]) for h in handles]
    for accepted in (0, None):  # None: as many as promised, on average
        policy = SpecPolicy(K, free_drafts=False)
        _costs(policy, plain=(0.015, 0.0005), mixed=(0.015, 0.0005))
        assert policy.calibration() == 1.0
        verified = []
        for step in range(200):
            for h in handles:
                _set_rates(policy, h, [0.4, 0.4, 0.4])  # the requests' own estimates stay high
            plan = policy.plan(candidates)
            verified.append(sum(plan.verify.values()))
            for h in handles:
                got = accepted if accepted is not None else [0, 1, 0, 0, 2][(step + h) % 5]
                n = plan.verify.get(h, 0)
                policy.observe_verified(h, n, min(got, n))
        if accepted == 0:
            assert policy.calibration() < 0.6
            assert verified[0] and not any(verified[3:10])  # promised until the outcomes are in
            assert 1 <= sum(map(bool, verified[10:])) <= 25  # then tried again now and then
        else:
            assert policy.calibration() > 0.9
            assert all(v >= len(handles) for v in verified)  # every request, every step


def test_a_lone_request_is_judged_by_its_own_outcomes():
    """With one request there is no one to be chosen over: no discount and no margin, the
    request's estimate follows its outcomes. Its drafts stop once it fails them and are tried
    again by shadows (here none: the estimate only falls)."""
    policy = SpecPolicy(K, free_drafts=False)
    _costs(policy, plain=(0.015, 0.002), mixed=(0.015, 0.002))
    _set_rates(policy, 0, [0.4, 0.4, 0.4])
    # Promised far more than it gets: a discount among many would shrink it, a lone request's
    # estimate is what it is (0.4 a draft pays with rows at 2 ms against a 17 ms step).
    policy._accepted, policy._expected = 0.0, 50.0
    assert policy.calibration() < 0.1  # discounted, 0.4 would be 0.04: no draft would pay
    assert policy.plan([Candidate(0, [1, 2, 3])]).verify.get(0, 0) >= 1
    verified = []
    for _ in range(40):
        n = policy.plan([Candidate(0, [1, 2, 3])]).verify.get(0, 0)
        verified.append(n)
        policy.observe_verified(0, n, 0)
    assert verified[0] >= 1 and verified[-1] == 0  # its own misses stop it
