"""Rejection sampler: greedy verification, exact target distribution, seeded determinism."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from specserve.shared.protocol import SamplingParams
from specserve.worker.sampler import filtered_probs, make_generator, sample
from specserve.worker.spec_decode import rejection_sampler
from specserve.worker.spec_decode.rejection_sampler import rejection_sample

GREEDY = SamplingParams(temperature=0.0)
V = 8


def _peaked(tokens: Sequence[int], vocab: int = V) -> torch.Tensor:
    """Logit rows whose argmax is the given token (+100 against -100)."""
    logits = torch.full((len(tokens), vocab), -100.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 100.0
    return logits


def _greedy(rows: list[list[int]], drafts: list[list[int]]) -> list[list[int]]:
    """Greedy-verify per-request drafts; `rows[r]` are request r's k_r + 1 target argmaxes."""
    logits = torch.cat([_peaked(r) for r in rows])
    return rejection_sample(logits, drafts, [GREEDY] * len(rows), [None] * len(rows))


# --- greedy -------------------------------------------------------------------------------


def test_greedy_perfect_match_emits_bonus() -> None:
    assert _greedy([[1, 2, 3, 4]], [[1, 2, 3]]) == [[1, 2, 3, 4]]


def test_greedy_early_mismatch_emits_target_choice_and_stops() -> None:
    assert _greedy([[1, 5, 3, 4]], [[1, 2, 3]]) == [[1, 5]]
    assert _greedy([[6, 2, 3, 4]], [[1, 2, 3]]) == [[6]]


def test_greedy_multiple_sequences_with_different_k() -> None:
    rows = [[1, 2, 7], [3], [4, 5, 6, 0], [2, 2]]
    drafts = [[1, 2], [], [4, 1, 6], [3]]
    assert _greedy(rows, drafts) == [[1, 2, 7], [3], [4, 5], [2]]


def test_greedy_placeholder_drafts_are_rejected() -> None:
    rows = [[1, 2, 3], [4, 5], [6, 7], [1, 2, 3]]
    drafts = [[1, -1], [-1], [V + 3], [1, 10**12]]
    assert _greedy(rows, drafts) == [[1, 2], [4], [6], [1, 2]]


def test_greedy_ignores_draft_probs() -> None:
    draft_probs = torch.softmax(torch.randn(2, V), dim=-1)
    out = rejection_sample(_peaked([1, 2, 3]), [[1, 2]], [GREEDY], [None], draft_probs)
    assert out == [[1, 2, 3]]


def test_mixed_batch_keeps_greedy_requests_greedy() -> None:
    logits = torch.cat([_peaked([1, 2, 3]), torch.randn(3, V), _peaked([4, 0])])
    params = [GREEDY, SamplingParams(temperature=1.0), GREEDY]
    out = rejection_sample(logits, [[1, 2], [0, 1], [5]], params, [None, None, None])
    assert out[0] == [1, 2, 3] and out[2] == [4]
    assert 1 <= len(out[1]) <= 3


# --- random: unit behaviour ---------------------------------------------------------------


def test_random_placeholder_is_rejected_and_recovered_from_p() -> None:
    """A placeholder never indexes a tensor (10**12 would raise) and q counts as zero."""
    logits = torch.cat([_peaked([3, 4]), _peaked([5, 6])])
    draft_probs = torch.full((2, V), 1.0 / V)
    params = [SamplingParams(temperature=1.0)] * 2
    for probs in (None, draft_probs):
        out = rejection_sample(logits, [[-1], [10**12]], params, [None, None], probs)
        assert out == [[3], [5]]


def test_recovered_token_falls_back_to_p_when_the_residual_is_empty() -> None:
    """q >= p everywhere (over-unit drafter mass) leaves max(p - q, 0) all zero on rejection.

    Racing all zeros would give id 0, which top-k filtered out; the fallback samples from p.
    """
    vocab, n = 12, 2000
    logits = torch.arange(vocab, dtype=torch.float32)  # token 0 least likely, outside top-4
    params = SamplingParams(temperature=1.0, top_k=4)
    p = filtered_probs(logits[None], [params])[0]
    drafts = torch.multinomial(p, n, replacement=True)
    out = rejection_sample(
        logits.repeat(2 * n, 1),
        [[d] for d in drafts.tolist()],
        [params] * n,
        [None] * n,
        (1.5 * p).repeat(n, 1),
    )
    rejected = [o for o in out if len(o) == 1]
    assert len(rejected) > n // 5  # accept w.p. 2/3, so about a third are rejected
    assert all(o[-1] >= vocab - 4 for o in out)


def test_no_drafts_samples_exactly_like_the_sampler() -> None:
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0.7, top_k=10, seed=1),
        SamplingParams(temperature=1.0, top_p=0.8, seed=2),
        SamplingParams(temperature=1.3, min_p=0.05, seed=3),
        SamplingParams(temperature=0.0),
    ]
    expected = sample(logits, params, [make_generator(p.seed or 0) for p in params])
    gens = [make_generator(p.seed or 0) for p in params]
    out = rejection_sample(logits, [[], [], [], []], params, gens)
    assert [o[0] for o in out] == expected.token_ids.tolist()
    for gen, param in zip(gens, params, strict=True):  # and the same draws were consumed
        after_sample = make_generator(param.seed or 0)
        sample(logits[:1], [param], [after_sample])
        assert torch.equal(gen.get_state(), after_sample.get_state())


def test_drafts_from_the_target_itself_are_always_accepted() -> None:
    """q == p makes min(1, p/q) = 1: every draft survives and the bonus is emitted."""
    vocab, k, n = 16, 3, 200
    params = SamplingParams(temperature=0.9, top_k=10)
    logits = torch.randn(k + 1, vocab)
    p = filtered_probs(logits, [params] * (k + 1))
    drafts = torch.multinomial(p[:k], n, replacement=True).T.tolist()
    out = rejection_sample(
        logits.repeat(n, 1), drafts, [params] * n, [None] * n, p[:k].repeat(n, 1)
    )
    assert all(o[:k] == d and len(o) == k + 1 for o, d in zip(out, drafts, strict=True))


def test_empty_batch() -> None:
    assert rejection_sample(torch.zeros(0, V), [], [], []) == []


@pytest.mark.parametrize(
    ("shape", "drafts", "n_params", "probs_rows"),
    [((5, V), [[1, 2]], 1, None), ((3, V), [[1, 2]], 2, None), ((3, V), [[1, 2]], 1, 3)],
)
def test_inconsistent_shapes_raise(
    shape: tuple[int, int], drafts: list[list[int]], n_params: int, probs_rows: int | None
) -> None:
    probs = None if probs_rows is None else torch.full((probs_rows, V), 1.0 / V)
    with pytest.raises(ValueError):
        rejection_sample(torch.randn(shape), drafts, [GREEDY] * n_params, [None], probs)


# --- seeded determinism -------------------------------------------------------------------


@dataclass(eq=False)  # compared by identity: find it in a shuffled batch
class _Req:
    logits: torch.Tensor  # [k + 1, V]
    drafts: list[int]
    draft_probs: torch.Tensor  # [k, V]
    params: SamplingParams


def _random_request(rng: random.Random, k: int, params: SamplingParams, vocab: int) -> _Req:
    logits = torch.randn(k + 1, vocab) * 2
    q = torch.softmax(logits[:k] + torch.randn(k, vocab), dim=-1)
    drafts = [int(torch.multinomial(q[i], 1)) for i in range(k)]
    if k and rng.random() < 0.2:
        drafts[rng.randrange(k)] = -1
    return _Req(logits, drafts, q, params)


def _run_batch(reqs: list[_Req], gens: list[torch.Generator | None], with_q: bool) -> list:
    logits = torch.cat([r.logits for r in reqs])
    probs = torch.cat([r.draft_probs for r in reqs]) if with_q else None
    return rejection_sample(logits, [r.drafts for r in reqs], [r.params for r in reqs], gens, probs)


@pytest.mark.parametrize("with_q", [True, False])
def test_seeded_requests_are_reproducible_whatever_the_batch(with_q: bool) -> None:
    vocab = 20
    rng = random.Random(0)
    torch.manual_seed(0)
    outputs = set()
    for trial in range(20):
        k = rng.choice([0, 1, 3, 5])
        params = SamplingParams(temperature=rng.choice([0.7, 1.0, 1.5]), top_k=15, seed=trial)
        target = _random_request(rng, k, params, vocab)
        alone_gen = make_generator(trial)
        alone = _run_batch([target], [alone_gen], with_q)[0]

        others = [
            _random_request(rng, rng.choice([0, 2, 4]), p, vocab)
            for p in (GREEDY, SamplingParams(temperature=1.0), SamplingParams(seed=77, top_p=0.9))
            for _ in range(2)
        ]
        batch = [*others, target]
        rng.shuffle(batch)
        gens = [make_generator(r.params.seed) if r.params.seed is not None else None for r in batch]
        mixed = _run_batch(batch, gens, with_q)[batch.index(target)]

        assert mixed == alone
        target_gen = gens[batch.index(target)]
        assert torch.equal(target_gen.get_state(), alone_gen.get_state())  # same draws consumed
        outputs.add((k, tuple(alone)))
    assert len(outputs) > 10  # really random, not a constant


# --- distribution -------------------------------------------------------------------------

# Per chi-square test, the probability of failing on a correct sampler (false alarm) is at most
# ALPHA, up to the chi-square approximation, which the >= 5 expected-count binning keeps good.
ALPHA = 1e-6
SAMPLES = 100_000


@dataclass(frozen=True)
class _Case:
    vocab: int
    k: int
    params: SamplingParams
    with_q: bool  # draft_probs given; else deterministic drafts (one-hot q)
    placeholder_rate: float = 0.0

    def __str__(self) -> str:
        q = "q" if self.with_q else "onehot"
        return f"V{self.vocab}-k{self.k}-{q}-T{self.params.temperature}"


CASES = [
    _Case(10, 2, SamplingParams(temperature=1.0), with_q=True),
    _Case(50, 4, SamplingParams(temperature=0.7), with_q=False),
    _Case(30, 3, SamplingParams(temperature=0.8, top_k=20, top_p=0.95), with_q=True),
    _Case(20, 3, SamplingParams(temperature=1.5, top_k=8, min_p=0.02), with_q=False),
    _Case(40, 2, SamplingParams(temperature=1.0, top_p=0.95), with_q=True, placeholder_rate=0.1),
]


def _simulate(case: _Case, seed: int) -> tuple[list[list[int]], torch.Tensor]:
    """SAMPLES independent requests sharing one target/draft model; returns outputs and p rows.

    Drafts are drawn from the drafter's q (passed as draft_probs, or withheld so the sampler
    treats each draft as deterministic). Each target row has a favourite token and q is a noisy
    copy of the target, so drafts are accepted often enough for every position to be tested.
    """
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the sampler's unseeded draws
    vocab, k = case.vocab, case.k
    logits = torch.randn(k + 1, vocab, generator=gen) * 1.5
    favourite = torch.randint(vocab, (k + 1,), generator=gen)
    logits[torch.arange(k + 1), favourite] += math.log(vocab) + 1
    drafter_logits = logits[:k] + 0.5 * torch.randn(k, vocab, generator=gen)
    # A deterministic drafter mostly proposes its own argmax: sharpen its draws.
    q = torch.softmax(drafter_logits * (1 if case.with_q else 4), dim=-1)
    drafts = torch.multinomial(q, SAMPLES, replacement=True, generator=gen).T.contiguous()
    holes = torch.rand(SAMPLES, k, generator=gen) < case.placeholder_rate
    drafts[holes] = torch.where(torch.rand(int(holes.sum()), generator=gen) < 0.5, -1, vocab)
    out = rejection_sample(
        logits.repeat(SAMPLES, 1),
        drafts.tolist(),
        [case.params] * SAMPLES,
        [None] * SAMPLES,
        q.repeat(SAMPLES, 1) if case.with_q else None,
    )
    return out, filtered_probs(logits, [case.params] * (k + 1))


def _chi_square_pvalue(tokens: list[int], probs: torch.Tensor) -> float:
    """Goodness-of-fit p-value of `tokens` against `probs`; 0 if any token has probability 0.

    Categories expecting fewer than 5 draws are pooled (into one bin, itself folded into the
    smallest bin if still under 5) so the chi-square approximation holds.
    """
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.shape[0]).double()
    probs = probs.double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = counts.sum() * probs
    small = (expected < 5) & (probs > 0)
    keep = (expected >= 5).nonzero().squeeze(-1)
    obs, exp = counts[keep].clone(), expected[keep].clone()
    if small.any():
        pooled_obs, pooled_exp = counts[small].sum(), expected[small].sum()
        if pooled_exp >= 5:
            obs, exp = torch.cat([obs, pooled_obs[None]]), torch.cat([exp, pooled_exp[None]])
        else:
            smallest = exp.argmin()
            obs[smallest] += pooled_obs
            exp[smallest] += pooled_exp
    stat = ((obs - exp) ** 2 / exp).sum()
    if obs.shape[0] < 2:  # one category holds all the mass: nothing left to fit
        return 1.0
    df = torch.tensor(obs.shape[0] - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def _position_pvalues(out: list[list[int]], p: torch.Tensor) -> list[tuple[int, float]]:
    """Per output position i: (draws, p-value of the emitted token against p_i).

    Position i is emitted exactly when drafts 0..i-1 were accepted; given that prefix, the
    token there must be distributed as the (filtered) target p_i, so each position is tested
    on the samples that reached it.
    """
    result = []
    for i in range(p.shape[0]):
        tokens = [o[i] for o in out if len(o) > i]
        result.append((len(tokens), _chi_square_pvalue(tokens, p[i])))
    return result


@pytest.mark.parametrize("case", CASES, ids=str)
def test_output_is_distributed_as_the_target(case: _Case) -> None:
    """Each emitted position's token ~ filtered target p given the accepted prefix.

    False-alarm rate: <= 1e-6 per position (chi-square p-value threshold ALPHA), hence
    <= 5e-6 per case (k + 1 <= 5 positions) and <= 2.5e-5 for the whole parametrisation.
    """
    out, p = _simulate(case, seed=1)
    assert all(1 <= len(o) <= case.k + 1 for o in out)
    results = _position_pvalues(out, p)
    for position, (draws, pvalue) in enumerate(results):
        assert draws >= 500, f"position {position} reached only {draws} times"
        assert pvalue >= ALPHA, f"position {position}: p-value {pvalue:.3g} ({draws} draws)"


def _residual_is_p(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p.clone()


def _accept_ignores_q(p: torch.Tensor, q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return u < p


@pytest.mark.parametrize(
    ("case", "name", "bug"),
    [
        (CASES[0], "_residual", _residual_is_p),
        (CASES[1], "_residual", _residual_is_p),
        (CASES[0], "_accept", _accept_ignores_q),
    ],
    ids=["recover-from-p-with-q", "recover-from-p-onehot", "accept-ignores-q"],
)
def test_distribution_test_detects_a_biased_sampler(
    case: _Case, name: str, bug: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same chi-square test must reject deliberately broken samplers at position 0."""
    monkeypatch.setattr(rejection_sampler, name, bug)
    out, p = _simulate(case, seed=1)
    draws, pvalue = _position_pvalues(out, p)[0]
    assert pvalue < ALPHA, f"biased sampler passed: p-value {pvalue:.3g} ({draws} draws)"


def test_a_below_normal_temperature_verifies_greedily() -> None:
    # Random rows would accept a draft whose target probability is 1e-40-ish only by luck, and
    # an overflowed row would recover token 0; greedy verification takes the argmax.
    tiny = SamplingParams(temperature=1e-39)
    logits = torch.cat([_peaked([1, 5, 3]), _peaked([6])])
    for seed in range(4):
        gens = [make_generator(seed), make_generator(seed + 10)]
        out = rejection_sample(logits, [[1, 2], []], [tiny, tiny], gens)
        assert out == [[1, 5], [6]]
