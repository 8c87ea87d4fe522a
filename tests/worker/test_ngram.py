"""Prompt-lookup proposer: exact proposals, and the incremental index agreeing with the function."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import numpy as np
import pytest

from specserve.worker.spec_decode.ngram import NgramIndex, NgramProposer


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """The stateless reference the incremental index must agree with: up to `k` tokens that
    followed the most recent earlier copy of the longest suffix n-gram (numpy, O(max_n * len)).

    n runs from `max_n` down to `min_n`; an "earlier" copy ends before the last token, so it
    may overlap the suffix but is never the suffix itself. Empty when nothing matches.
    """
    NgramProposer(k, min_n, max_n)  # the proposer's own argument checks
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = tokens.shape[0]
    if k == 0 or length < 2:
        return []
    # ends[e]: candidate copies ending at e (0..length-2); run[e]: how many trailing tokens match.
    ends = np.arange(length - 1)
    run = np.zeros(length - 1, dtype=np.int64)
    alive = np.ones(length - 1, dtype=bool)
    for j in range(min(max_n, length - 1)):
        at = ends - j
        alive &= at >= 0
        alive[alive] = tokens[at[alive]] == tokens[length - 1 - j]
        run += alive
        if not alive.any():
            break
    best = int(run.max())
    if best < min_n:
        return []
    end = int(np.flatnonzero(run >= best)[-1])
    return tokens[end + 1 : end + 1 + k].tolist()


@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        # suffix [2, 3] occurred at 1..2: propose what followed it
        ([1, 2, 3, 4, 5, 9, 2, 3], 3, [4, 5, 9]),
        # k truncates
        ([1, 2, 3, 4, 5, 9, 2, 3], 1, [4]),
        # the end of the sequence truncates: only [8, 5] follows the earlier [5]
        ([7, 5, 8, 5], 4, [8, 5]),
        # no earlier copy of even the last token
        ([1, 2, 3, 4], 3, []),
        ([5], 3, []),
        ([], 3, []),
        # longest n wins: [1, 2, 3] (n=3, at 4..6) beats the more recent [3] alone (at 8)
        ([9, 9, 9, 9, 1, 2, 3, 7, 3, 8, 1, 2, 3], 2, [7, 3]),
        # among copies of the same n-gram the most recent wins
        ([4, 5, 1, 4, 5, 2, 4, 5], 2, [2, 4]),
        # a copy overlapping the suffix counts; it proposes what remains before the end
        ([1, 1, 1, 1], 5, [1]),
        ([1, 2, 1, 2, 1, 2], 5, [1, 2]),
    ],
)
def test_proposals(tokens: list[int], k: int, expected: list[int]) -> None:
    assert propose_ngram(tokens, k) == expected
    index = NgramIndex()
    index.extend(tokens)
    assert index.propose(k) == expected


def test_n_bounds() -> None:
    tokens = [1, 2, 3, 4, 2, 3, 9, 3]
    # max_n=4: the longest repeated suffix is [3] (n=1): most recent earlier 3 at 5 -> [9, 3]
    assert propose_ngram(tokens, 2) == [9, 3]
    # min_n=2: [3] alone is too short, and [9, 3] never occurred before
    assert propose_ngram(tokens, 2, min_n=2) == []
    # max_n caps the match: with max_n=1 the most recent single-token match is used
    tokens = [5, 6, 7, 0, 6, 7, 1, 7]
    assert propose_ngram(tokens, 1, max_n=1) == [1]
    assert propose_ngram(tokens, 1, max_n=2) == [1]
    tokens = [5, 6, 7, 0, 8, 7, 1, 6, 7]
    assert propose_ngram(tokens, 1, max_n=1) == [1]  # most recent 7 (at 5)
    assert propose_ngram(tokens, 1, max_n=2) == [0]  # [6, 7] (at 1..2) is longer


def test_k_zero_and_invalid_arguments() -> None:
    assert propose_ngram([1, 2, 1], 0) == []
    with pytest.raises(ValueError):
        propose_ngram([1, 2, 1], -1)
    with pytest.raises(ValueError):
        propose_ngram([1, 2, 1], 2, min_n=3, max_n=2)
    with pytest.raises(ValueError):
        propose_ngram([1, 2, 1], 2, min_n=0)


def test_incremental_index_matches_the_function() -> None:
    rng = random.Random(0)
    for trial in range(60):
        vocab = rng.choice([2, 3, 5, 20])
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        proposer = NgramProposer(k=rng.randint(1, 6), min_n=min_n, max_n=max_n)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
        proposer.add_request(trial, tokens)
        for _ in range(40):
            expected = propose_ngram(tokens, proposer.k, min_n, max_n)
            assert proposer.propose(trial) == expected, (tokens, min_n, max_n)
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
            tokens += new
            proposer.extend(trial, new)
        proposer.remove(trial)
        assert trial not in proposer


def test_fast_on_long_sequences() -> None:
    """Reference lookups over a few thousand tokens stay well under a millisecond each."""
    rng = random.Random(1)
    tokens = [rng.randrange(1000) for _ in range(4000)]
    tokens += tokens[1000:1010]  # a repeat to find
    start = time.perf_counter()
    for _ in range(50):
        assert propose_ngram(tokens, 5) == tokens[1010:1015]
    assert (time.perf_counter() - start) / 50 < 5e-3  # generous: loaded CI hosts
