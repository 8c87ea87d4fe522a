"""The router's choice: longest cached prefix, balanced against load, then round-robin."""

from __future__ import annotations

import pytest

from specserve.control.router import Candidate, Router


def test_the_worker_holding_the_prefix_wins_while_it_is_not_overloaded():
    router = Router("prefix", load_weight=1.0)
    idle = [Candidate("a", 0.0), Candidate("b", 0.0)]
    assert router.choose(idle, 100, {"b": 80}).worker_id == "b"
    assert router.choose(idle, 100, {"b": 80}).cached_tokens == 80
    # 80% cached on b, b 50% loaded, a idle: 0.8 - 0.5 = 0.3 > 0 - 0 -> still b.
    assert (
        router.choose([Candidate("a", 0.0), Candidate("b", 0.5)], 100, {"b": 80}).worker_id == "b"
    )
    # b saturated (1.0): 0.8 - 1.0 < 0 -> the hot prefix spills to a.
    assert (
        router.choose([Candidate("a", 0.0), Candidate("b", 1.0)], 100, {"b": 80}).worker_id == "a"
    )


def test_load_weight_sets_the_exchange_rate():
    workers = [Candidate("a", 0.1), Candidate("b", 0.6)]
    assert Router("prefix", load_weight=0.5).choose(workers, 10, {"b": 6}).worker_id == "b"
    assert Router("prefix", load_weight=2.0).choose(workers, 10, {"b": 6}).worker_id == "a"
    assert Router("prefix", load_weight=0.0).choose(workers, 10, {"b": 1}).worker_id == "b"


def test_cold_requests_go_to_the_less_loaded_then_rotate():
    router = Router("prefix")
    assert router.choose([Candidate("a", 0.3), Candidate("b", 0.1)], 10, {}).worker_id == "b"
    idle = [Candidate("a", 0.0), Candidate("b", 0.0), Candidate("c", 0.0)]
    picks = [router.choose(idle, 10, {}).worker_id for _ in range(6)]
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]


def test_round_robin_ignores_the_cache():
    router = Router("round-robin")
    workers = [Candidate("b", 0.9), Candidate("a", 0.0)]
    picks = [router.choose(workers, 10, {"b": 9}).worker_id for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]


def test_bad_configuration_and_empty_pools_are_errors():
    with pytest.raises(ValueError, match="load_weight"):
        Router("prefix", load_weight=-1)
    with pytest.raises(ValueError):
        Router("random")
    with pytest.raises(ValueError, match="no worker"):
        Router().choose([], 10, {})
