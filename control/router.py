"""Picks the worker for a new request: the longest cached prefix, balanced against load.

score(w) = cached_fraction(w) - load_weight * load(w), where cached_fraction is the share of the
prompt already in w's KV cache and load(w) = max(queued requests / max_num_seqs, KV usage).
A hot prefix therefore draws its requests to the worker that holds it until that worker is
loaded enough that recomputing the prefix elsewhere is the better deal (load_weight sets the
exchange rate); then a second worker caches it too. Ties go to the less loaded worker, then
round-robin, so an idle pool spreads cold requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum


class Routing(StrEnum):
    PREFIX = "prefix"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    load: float  # 0 idle .. 1 full (may exceed 1 with a backlog)


@dataclass(frozen=True)
class RouteDecision:
    worker_id: str
    cached_tokens: int  # the estimate the choice was based on


class Router:
    def __init__(self, routing: Routing | str = Routing.PREFIX, load_weight: float = 1.0) -> None:
        self.routing = Routing(routing)
        if load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {load_weight}")
        self.load_weight = load_weight
        self._turn = itertools.count()

    def choose(
        self,
        candidates: Sequence[Candidate],
        num_prompt_tokens: int,
        cached_tokens: Mapping[str, int],
    ) -> RouteDecision:
        if not candidates:
            raise ValueError("no worker to route to")
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        turn = next(self._turn)
        if self.routing == Routing.ROUND_ROBIN:
            pick = ordered[turn % len(ordered)]
            return RouteDecision(pick.worker_id, cached_tokens.get(pick.worker_id, 0))
        n = len(ordered)

        def key(i: int) -> tuple[float, float, int]:
            c = ordered[i]
            cached = cached_tokens.get(c.worker_id, 0) / max(num_prompt_tokens, 1)
            score = cached - self.load_weight * c.load
            return (-score, c.load, (i - turn) % n)

        pick = ordered[min(range(n), key=key)]
        return RouteDecision(pick.worker_id, cached_tokens.get(pick.worker_id, 0))
