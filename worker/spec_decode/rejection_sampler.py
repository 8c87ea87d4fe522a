"""Verify draft tokens against the target model: speculative (rejection) sampling.

For each request the target scored `k` draft positions plus one bonus position. Greedy requests
(temperature 0) keep drafts while they equal the target's argmax and then emit the argmax.
Random requests accept draft `d` with probability `min(1, p(d) / q(d))`, where `p` is the
target's distribution after the sampler's own filtering (`filtered_probs`) and `q` the drafter's
(one-hot at `d` when no draft probabilities are given); the first rejection emits a recovered
token from `max(p - q, 0)` and stops, and if every draft is accepted a bonus token is drawn from
the bonus row's `p`. Every emitted token is then distributed exactly as the (filtered) target
would have sampled it, and a request with no drafts samples exactly as `sampler.sample`.

Draw order (what keeps seeded requests reproducible whatever else is in the batch): a random
request draws, from its own generator, `k` uniforms (one per draft position, all of them even
when an early rejection leaves later ones unused) and then one `Exp(1)` vector of vocabulary
size, used for the recovered or bonus token's exponential race. Its generator therefore advances
by the same amount every step for a given `k`. Greedy requests draw nothing. Unseeded requests
share the global RNG: first the uniforms of all their drafts, then their exponential vectors.

A placeholder draft (-1, or any id outside the vocabulary) is rejected without ever being used as
an index; its recovered token is sampled from `p` (its `q` counts as zero).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.shared.protocol import is_greedy
from specserve.worker.sampler import (
    SamplingLike,
    argmax_rows,
    filtered_probs,
    unseeded_exponential,
    validate_sampling,
)


@dataclass(frozen=True)
class _Layout:
    """Where each request's drafts and rows sit in the flattened inputs."""

    num_drafts: torch.Tensor  # [R] k_r
    first_row: torch.Tensor  # [R] target-logits row of the request's first position
    first_draft: torch.Tensor  # [R] index of the request's first draft in the flat drafts
    draft_ids: torch.Tensor  # [D] flat draft ids, as given (may hold placeholders)
    draft_req: torch.Tensor  # [D] request of each draft
    draft_pos: torch.Tensor  # [D] position of each draft inside its request
    valid: torch.Tensor  # [D] draft id inside [0, V)
    safe_ids: torch.Tensor  # [D] draft ids with placeholders replaced by 0, safe to index with

    @property
    def num_requests(self) -> int:
        return self.num_drafts.shape[0]

    @property
    def draft_row(self) -> torch.Tensor:
        """[D] target-logits row scoring each draft."""
        return self.first_row[self.draft_req] + self.draft_pos


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    params: Sequence[SamplingLike],
    generators: Sequence[torch.Generator | None],
    draft_probs: torch.Tensor | None = None,
) -> list[list[int]]:
    """Per request, the accepted drafts then one recovered or bonus token (1..k+1 tokens).

    `target_logits [sum_r (k_r + 1), V]` holds, per request, its `k_r` draft-position rows then
    its bonus row. `draft_probs [sum_r k_r, V]`, when given, are the distributions the drafts
    were sampled from; None means deterministic drafts (one-hot `q`).
    """
    vocab = target_logits.shape[-1]
    device = target_logits.device
    layout = _build_layout(draft_token_ids, vocab, device)
    _check_inputs(target_logits, layout, params, generators, draft_probs)
    logits = target_logits.float()
    emitted: list[list[int]] = [[] for _ in params]

    greedy = [r for r, p in enumerate(params) if is_greedy(p.temperature)]
    randoms = [r for r, p in enumerate(params) if not is_greedy(p.temperature)]
    if greedy:
        first_rows = layout.first_row.tolist()
        rows = [
            row
            for r in greedy
            for row in range(first_rows[r], first_rows[r] + len(draft_token_ids[r]) + 1)
        ]
        argmax = argmax_rows(logits[torch.tensor(rows, device=device)]).tolist()
        verified = greedy_verify(argmax, [draft_token_ids[r] for r in greedy])
        for r, tokens in zip(greedy, verified, strict=True):
            emitted[r] = tokens
    if randoms:
        state = _RandomState.build(logits, layout, params, generators, randoms, draft_probs)
        accepted = torch.zeros(layout.draft_ids.shape[0], dtype=torch.bool, device=device)
        accepted[state.drafts] = state.accept()
        num_accepted = _num_accepted(layout, accepted)
        finals = state.final_tokens(num_accepted).tolist()
        counts = num_accepted.tolist()
        for r, final in zip(randoms, finals, strict=True):
            emitted[r] = [*draft_token_ids[r][: counts[r]], final]
    return emitted


def greedy_verify(
    argmax: Sequence[int], draft_token_ids: Sequence[Sequence[int]]
) -> list[list[int]]:
    """Greedy verification from the target's argmax of each row, laid out as
    `rejection_sample`'s logits (`k_r` draft rows then the bonus row, request after request):
    a request keeps its drafts while they equal the argmax and then emits the argmax of the
    row where they stop (a placeholder never equals one)."""
    emitted = []
    row = 0
    for drafts in draft_token_ids:
        n = 0
        while n < len(drafts) and drafts[n] == argmax[row + n]:
            n += 1
        emitted.append([*drafts[:n], argmax[row + n]])
        row += len(drafts) + 1
    return emitted


def _build_layout(
    draft_token_ids: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> _Layout:
    counts = [len(d) for d in draft_token_ids]
    num_drafts = torch.tensor(counts, dtype=torch.long, device=device)
    first_row = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
    first_draft = torch.cumsum(num_drafts, 0) - num_drafts
    flat = list(itertools.chain.from_iterable(draft_token_ids))
    draft_ids = torch.tensor(flat, dtype=torch.long, device=device)
    draft_req = torch.repeat_interleave(torch.arange(len(counts), device=device), num_drafts)
    draft_pos = torch.arange(len(flat), device=device) - first_draft[draft_req]
    valid = (draft_ids >= 0) & (draft_ids < vocab)
    safe_ids = torch.where(valid, draft_ids, 0)
    return _Layout(
        num_drafts, first_row, first_draft, draft_ids, draft_req, draft_pos, valid, safe_ids
    )


def _check_inputs(
    target_logits: torch.Tensor,
    layout: _Layout,
    params: Sequence[SamplingLike],
    generators: Sequence[torch.Generator | None],
    draft_probs: torch.Tensor | None,
) -> None:
    """Raise ValueError on shapes that would silently mis-assign rows to requests."""
    num_requests = layout.num_requests
    if len(params) != num_requests or len(generators) != num_requests:
        raise ValueError(
            f"{num_requests} draft lists, {len(params)} sampling params, "
            f"{len(generators)} generators: one each per request"
        )
    num_drafts = layout.draft_ids.shape[0]
    expected_rows = num_drafts + num_requests
    if target_logits.dim() != 2 or target_logits.shape[0] != expected_rows:
        raise ValueError(
            f"target_logits must be [{expected_rows}, V] (k_r + 1 rows per request), "
            f"got {tuple(target_logits.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (num_drafts, target_logits.shape[1]):
        raise ValueError(
            f"draft_probs must be [{num_drafts}, {target_logits.shape[1]}], "
            f"got {tuple(draft_probs.shape)}"
        )
    for p in {id(p): p for p in params}.values():  # requests often share one params object
        validate_sampling(p.temperature, p.top_p, p.top_k, p.min_p)


def _drafts_of(layout: _Layout, requests: list[int]) -> torch.Tensor:
    """Flat indices of the drafts belonging to `requests`, in request then position order."""
    device = layout.draft_ids.device
    if not requests:
        return torch.zeros(0, dtype=torch.long, device=device)
    reqs = torch.tensor(requests, dtype=torch.long, device=device)
    counts = layout.num_drafts[reqs]
    starts = torch.repeat_interleave(layout.first_draft[reqs], counts)
    run_starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return starts + torch.arange(int(counts.sum()), device=device) - run_starts


def _num_accepted(layout: _Layout, accepted: torch.Tensor) -> torch.Tensor:
    """[R] length of each request's run of accepted drafts from position 0."""
    max_k = int(layout.num_drafts.max()) if layout.num_requests else 0
    grid = torch.zeros(layout.num_requests, max_k, dtype=torch.long, device=accepted.device)
    grid[layout.draft_req, layout.draft_pos] = accepted.long()
    return grid.cumprod(dim=1).sum(dim=1)


def _accept(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept w.p. min(1, p/q): `u < p/q` without dividing (q = 0 counts as an infinite ratio)."""
    return u * q_draft < p_draft


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalised recovered-token distribution; the exponential race needs no normalising."""
    return (p - q).clamp_(min=0.0)


@dataclass
class _RandomState:
    """Target probabilities and random draws of the random (temperature > 0) requests."""

    layout: _Layout
    requests: torch.Tensor  # [Rr] request indices
    drafts: torch.Tensor  # [Dr] flat draft indices of those requests
    probs: torch.Tensor  # [Nr, V] filtered target probs of those requests' rows
    row_to_prob: torch.Tensor  # [N] index into `probs` of a target row (-1: greedy row)
    uniforms: torch.Tensor  # [Dr] one per draft, aligned with `drafts`
    noise: torch.Tensor  # [Rr, V] Exp(1) per request, aligned with `requests`
    draft_probs: torch.Tensor | None

    @classmethod
    def build(
        cls,
        logits: torch.Tensor,
        layout: _Layout,
        params: Sequence[SamplingLike],
        generators: Sequence[torch.Generator | None],
        randoms: list[int],
        draft_probs: torch.Tensor | None,
    ) -> _RandomState:
        device = logits.device
        requests = torch.tensor(randoms, dtype=torch.long, device=device)
        counts = layout.num_drafts[requests]
        rows = torch.repeat_interleave(layout.first_row[requests], counts + 1)
        run_starts = torch.repeat_interleave(torch.cumsum(counts + 1, 0) - (counts + 1), counts + 1)
        rows = rows + torch.arange(rows.shape[0], device=device) - run_starts
        row_params = [
            params[r] for r, c in zip(randoms, counts.tolist(), strict=True) for _ in range(c + 1)
        ]
        probs = filtered_probs(logits[rows], row_params)
        row_to_prob = torch.full((logits.shape[0],), -1, dtype=torch.long, device=device)
        row_to_prob[rows] = torch.arange(rows.shape[0], device=device)
        uniforms, noise = _draw(counts.tolist(), [generators[r] for r in randoms], probs)
        drafts = _drafts_of(layout, randoms)
        if draft_probs is not None:
            draft_probs = draft_probs.float()
        return cls(layout, requests, drafts, probs, row_to_prob, uniforms, noise, draft_probs)

    def accept(self) -> torch.Tensor:
        """[Dr] which of these requests' drafts pass the min(1, p/q) test."""
        layout, drafts = self.layout, self.drafts
        ids = layout.safe_ids[drafts]
        p_rows = self.row_to_prob[layout.draft_row[drafts]]
        p_draft = self.probs[p_rows, ids]
        if self.draft_probs is None:
            q_draft = torch.ones_like(p_draft)
        else:
            q_draft = self.draft_probs[drafts, ids]
        return layout.valid[drafts] & _accept(p_draft, q_draft, self.uniforms)

    def final_tokens(self, num_accepted: torch.Tensor) -> torch.Tensor:
        """[Rr] recovered token where a draft was rejected, else the bonus token."""
        layout = self.layout
        n_acc = num_accepted[self.requests]
        p = self.probs[self.row_to_prob[layout.first_row[self.requests] + n_acc]]
        rejected = n_acc < layout.num_drafts[self.requests]
        dist = p.clone()
        if bool(rejected.any()):
            draft = layout.first_draft[self.requests[rejected]] + n_acc[rejected]
            residual = _residual(p[rejected], self._draft_dist(draft, p.shape[-1]))
            # p == q on the support leaves nothing: fall back to p rather than race all zeros.
            empty = residual.sum(dim=-1) <= 0
            dist[rejected] = torch.where(empty[:, None], p[rejected], residual)
        return argmax_rows(dist / self.noise)

    def _draft_dist(self, drafts: torch.Tensor, vocab: int) -> torch.Tensor:
        """[n, V] q of the given drafts: draft probs or one-hot, all zero for placeholders."""
        layout = self.layout
        valid = layout.valid[drafts]
        if self.draft_probs is not None:
            q = self.draft_probs[drafts]
        else:
            q = torch.nn.functional.one_hot(layout.safe_ids[drafts], vocab).to(self.probs.dtype)
        return q * valid[:, None]


def _draw(
    counts: list[int], generators: list[torch.Generator | None], probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms (one per draft) and Exp(1) vectors (one per request), in the documented order."""
    device, vocab = probs.device, probs.shape[-1]
    uniforms = torch.empty(sum(counts), device=device)
    noise = torch.empty(len(counts), vocab, device=device)
    unseeded = [g is None for g in generators]
    if any(unseeded):
        per_request = torch.tensor(unseeded, device=device)
        per_draft = torch.repeat_interleave(per_request, torch.tensor(counts, device=device))
        uniforms[per_draft] = torch.rand(int(per_draft.sum()), device=device)
        noise[per_request] = unseeded_exponential(sum(unseeded), vocab, device)
    start = 0
    for i, (count, generator) in enumerate(zip(counts, generators, strict=True)):
        if generator is not None:
            uniforms[start : start + count] = torch.rand(count, device=device, generator=generator)
            noise[i].exponential_(generator=generator)
        start += count
    return uniforms, noise.clamp_(min=torch.finfo(noise.dtype).tiny)
