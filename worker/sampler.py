"""Sampling from `[N, V]` logits with per-row parameters and per-request generators.

Order of operations per row: temperature, then top-k, then top-p on the renormalised top-k
distribution, then min-p (relative to the most likely token). Rows with temperature 0, or below
float32's smallest normal number (`is_greedy`), are greedy. Logits are shifted by their maximum
before the division by temperature, so a small temperature cannot overflow them, and top-p always
keeps the most likely token, so a tiny top-p is the argmax rather than an empty distribution.
Sampling uses the exponential-race trick (`argmax(p / E)`, `E ~ Exp(1)`), with each row's noise
drawn from that row's own generator, so a seeded request gets the same tokens whatever else
shares its batch. Reported logprobs are of the raw model distribution
(`log_softmax(logits)`), before temperature and filtering.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.shared.protocol import is_greedy, validate_sampling
from specserve.worker.cpu import ops as cpu_ops


class SamplingLike(Protocol):
    """The fields the sampler reads (`specserve.shared.protocol.SamplingParams` has them)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def logprobs(self) -> int | None: ...


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N] logprob of each chosen token; None if no row asked
    top_token_ids: torch.Tensor | None  # [N, K] with K the largest N asked for
    top_logprobs: torch.Tensor | None  # [N, K]
    num_top_logprobs: list[int]  # per row, how many of the K columns it asked for


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own generator; keep it with the request so its draws never interleave."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def reseed_for_position(generator: torch.Generator, seed: int, num_output_tokens: int) -> None:
    """Seed a request's draws for the step that samples its output token `num_output_tokens`.

    Keying the stream on (seed, position) rather than letting one generator run on makes a
    seeded request's tokens independent of where it was preempted, or of a resumption on another
    worker from the tokens it had so far: the draws at each position are the same either way.
    """
    x = (seed + (num_output_tokens + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF  # splitmix64 finaliser
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    generator.manual_seed((x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest entry (the first one on ties), as `argmax(dim=-1)` gives.

    On CPU, `[N, V]` float32/bfloat16 rows go through `cpu_ops.argmax_rows` (16 x 49152:
    ~0.07 ms against ~0.65 ms); elsewhere `max(dim=-1)`, which has the same tie rule and is
    faster than `argmax` over vocabulary-wide rows.
    """
    picked = cpu_ops.argmax_rows(x)
    return x.max(dim=-1).indices if picked is None else picked


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingLike],
    generators: Sequence[torch.Generator | None] | None = None,
) -> SamplerOutput:
    """Sample one token per row of `logits [N, V]`.

    `generators[i]` is row i's generator (None: unseeded, uses the global RNG). Several rows of
    one request (e.g. verified positions) may share a generator; they draw in row order.
    """
    n = logits.shape[0]
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} logit rows")
    generators = generators if generators is not None else [None] * n
    for p in params:
        validate_sampling(p.temperature, p.top_p, p.top_k, p.min_p, p.logprobs)

    token_ids = argmax_rows(logits)  # exact in any float dtype: float32 keeps the order
    random_rows = [i for i, p in enumerate(params) if not is_greedy(p.temperature)]
    if random_rows or any(p.logprobs is not None for p in params):
        logits = logits.float()
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = filtered_probs(logits[rows], [params[i] for i in random_rows])
        token_ids[rows] = _draw_tokens(probs, [generators[i] for i in random_rows])
    return token_logprobs(logits, token_ids, params)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingLike]) -> torch.Tensor:
    """`[N, V]` renormalised probabilities after temperature, top-k, top-p and min-p."""
    device = logits.device
    logits = tempered(logits, torch.tensor([p.temperature for p in params], device=device))
    if any(p.top_k > 0 for p in params):
        logits = _apply_top_k(logits, [p.top_k for p in params])
    probs = torch.softmax(logits, dim=-1)
    top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if top_p_rows:
        top_p = torch.tensor([params[i].top_p for i in top_p_rows], device=device)
        probs = _with_rows(probs, top_p_rows, _apply_top_p(_rows(probs, top_p_rows), top_p))
    min_p_rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if min_p_rows:
        min_p = torch.tensor([params[i].min_p for i in min_p_rows], device=device)[:, None]
        kept = _rows(probs, min_p_rows)
        threshold = min_p * kept.max(dim=-1, keepdim=True).values
        kept = torch.where(kept >= threshold, kept, 0.0)
        probs = _with_rows(probs, min_p_rows, kept / kept.sum(dim=-1, keepdim=True))
    return probs


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows `rows` of `x` (`x` itself where they are all of them)."""
    if len(rows) == x.shape[0]:
        return x
    return x[torch.tensor(rows, device=x.device)]


def _with_rows(x: torch.Tensor, rows: list[int], values: torch.Tensor) -> torch.Tensor:
    """`x` with its rows `rows` replaced by `values`, in place (`values` itself where they are
    all of them)."""
    if len(rows) == x.shape[0]:
        return values
    x[torch.tensor(rows, device=x.device)] = values
    return x


def tempered(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """`logits [N, V] / temperature [N]`, each row first shifted so its maximum is 0.

    The shift leaves the softmax unchanged and keeps every quotient <= 0, so no temperature
    (>= MIN_TEMPERATURE) overflows a logit to inf and softmax never sees inf - inf. Temperatures
    past float32's range are clamped to its largest finite value, which keeps -inf logits -inf.
    """
    finfo = torch.finfo(torch.float32)
    temps = temperature.to(torch.float32).clamp(min=finfo.tiny, max=finfo.max)[:, None]
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    return shifted / temps


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep logits >= each row's k-th largest (ties at the k-th value are all kept); a row with
    k = 0, or k >= the vocabulary, keeps all. The k-th values come from `topk` over the largest k
    asked rather than a sort of the vocabulary (16 rows of 49,152: 30 ms on 2 cores)."""
    vocab = logits.shape[-1]
    limited = [i for i, k in enumerate(top_k) if 0 < k < vocab]
    if not limited:
        return logits
    ks = torch.tensor([top_k[i] for i in limited], device=logits.device)
    largest = _rows(logits, limited).topk(int(ks.max()), dim=-1).values
    kth = torch.full((logits.shape[0], 1), -math.inf, dtype=logits.dtype, device=logits.device)
    kth = _with_rows(kth, limited, largest.gather(-1, (ks - 1)[:, None]))
    return torch.where(logits >= kth, logits, -math.inf)


# A row's top-p set is looked for among its 64, then 1,024, then 8,192 most likely tokens
# (`topk`: 0.1, 0.35 and 0.8 ms a row of 49,152) before a stable sort of the whole row (4 ms).
TOP_P_CANDIDATES = (64, 1024, 8192)
# The candidates' mass must pass top_p by this much to prove that every other token is dropped:
# each token's mass before it is a float32 rounding (two, 2^-23 at most) of the exact sum.
TOP_P_MARGIN = 1e-6


def _apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p, then renormalise.

    A token is dropped when the mass of the tokens before it (in a stable sort, most likely
    first) already reaches top_p, so the most likely token always survives. Each row's set comes
    from its most likely tokens (`_top_p_among`) where it provably lies among them, the same set
    a sort of the whole row gives, else from that sort.
    """
    keep = torch.zeros_like(probs, dtype=torch.bool)
    pending = list(range(probs.shape[0]))
    for size in TOP_P_CANDIDATES:
        if not pending or size >= probs.shape[-1]:
            break
        found, index, kept = _top_p_among(_rows(probs, pending), _rows(top_p, pending), size)
        hits = found.nonzero().squeeze(-1)
        if len(hits):
            marks = torch.zeros(len(hits), probs.shape[-1], dtype=torch.bool, device=probs.device)
            marks.scatter_(-1, index[hits], kept[hits])
            keep = _with_rows(keep, [pending[i] for i in hits.tolist()], marks)
        pending = [row for row, ok in zip(pending, found.tolist(), strict=True) if not ok]
    if pending:
        sorted_probs, order = _rows(probs, pending).sort(dim=-1, descending=True, stable=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = mass_before < _rows(top_p, pending)[:, None]
        keep_sorted[:, 0] = True  # even a top_p that float32 rounds to 0 keeps the top token
        marks = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        keep = _with_rows(keep, pending, marks)
    kept_probs = torch.where(keep, probs, 0.0)
    return kept_probs / kept_probs.sum(dim=-1, keepdim=True)


def _top_p_among(
    probs: torch.Tensor, top_p: torch.Tensor, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's top-p set among its `size` most likely tokens: (found [N], index [N, size],
    kept [N, size]), token `index[i, j]` kept where `kept[i, j]`, for the rows `found`.

    The candidates are put in the order a stable sort of the whole row gives them (most likely
    first, then lowest index), and on CPU float32 `cumsum` is a sequential sum (in float64), so
    each candidate's mass before it is the whole row's, bit for bit, for every candidate more
    likely than the least likely one (others may tie with tokens outside the candidates). A row
    is found where those candidates' mass reaches top_p with `TOP_P_MARGIN` to spare: every
    token after them (among the candidates or not) is then dropped however its mass is rounded.
    (A CUDA `cumsum` is a parallel float32 scan: the set is still a top-p set, its last token
    decided within float32 rounding rather than as the sort decides it.)
    """
    values, index = probs.topk(size, dim=-1)
    index, by_index = index.sort(dim=-1)
    values = values.gather(-1, by_index)
    values, order = values.sort(dim=-1, descending=True, stable=True)
    index = index.gather(-1, order)
    kept = (values.cumsum(dim=-1) - values) < top_p[:, None]
    kept[:, 0] = True
    ahead = values > values[:, -1:]  # ahead of every token outside the candidates
    ahead_mass = torch.where(ahead, values, 0.0).sum(dim=-1, dtype=torch.float64)
    found = ahead_mass >= top_p.to(torch.float64) + TOP_P_MARGIN
    return found, index, kept


def unseeded_exponential(rows: int, vocab: int, device: torch.device | str) -> torch.Tensor:
    """`[rows, vocab]` Exp(1) draws (float32) from the default generator, as `-log(U)` for
    uniforms U in [0, 1) drawn in float64 (a U of 0 gives inf, a token that cannot win).

    `Tensor.exponential_` draws one value at a time on CPU: 23 ms for 32 x 49,152 draws (a
    batch of 32 requests over SmolLM2's vocabulary), against 8 ms here."""
    uniform = torch.rand(rows, vocab, dtype=torch.float64, device=device)
    return uniform.log_().neg_().to(torch.float32)


def _draw_tokens(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs [N, V]`. A seeded row runs an exponential race (argmax of
    p / Exp(1) noise) on its own generator, so its tokens do not depend on the batch; the others
    invert their CDF at one uniform each (float64 sums), which costs one draw per row instead of
    one per vocabulary entry."""
    token_ids = torch.empty(len(generators), dtype=torch.int64, device=probs.device)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        cdf = probs[unseeded].cumsum(dim=-1, dtype=torch.float64)
        point = torch.rand(len(unseeded), 1, dtype=torch.float64, device=probs.device)
        picked = torch.searchsorted(cdf, point * cdf[:, -1:], right=True)  # first cdf > point
        token_ids[unseeded] = picked.squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    for i in seeded:
        noise = torch.empty_like(probs[i]).exponential_(generator=generators[i])
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # p / 0 would win every race
        token_ids[i] = argmax_rows((probs[i] / noise)[None])[0]
    return token_ids


class PenaltyLike(Protocol):
    """The penalty fields (`specserve.shared.protocol.SamplingParams` has them)."""

    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def has_penalties(self) -> bool: ...


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[PenaltyLike],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]],
) -> torch.Tensor:
    """`logits [N, V]` (float32, a copy) with each row's penalties applied, given its
    (prompt ids, output ids) so far: first the repetition penalty over prompt and output (a
    positive logit divided by it, a negative one multiplied), then the frequency penalty times
    each token's count in the output and the presence penalty once per token that occurs in it
    (vLLM's order; HF's repetition penalty is the same formula)."""
    out = logits.float().clone()
    vocab = out.shape[-1]
    for row, (p, (prompt_ids, output_ids)) in enumerate(zip(params, histories, strict=True)):
        if not p.has_penalties:
            continue
        values = out[row]
        output = torch.tensor(list(output_ids), dtype=torch.int64, device=out.device)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=out.device)
            seen[torch.tensor(list(prompt_ids), dtype=torch.int64, device=out.device)] = True
            seen[output] = True
            penalized = torch.where(
                values > 0, values / p.repetition_penalty, values * p.repetition_penalty
            )
            values = torch.where(seen, penalized, values)
        if p.frequency_penalty or p.presence_penalty:
            counts = torch.bincount(output, minlength=vocab)[:vocab].to(values.dtype)
            values = values - p.frequency_penalty * counts
            values = values - p.presence_penalty * (counts > 0).to(values.dtype)
        out[row] = values
    return out


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingLike]
) -> SamplerOutput:
    """`token_ids` with the raw-distribution logprobs of each, and the top N per row that asks."""
    counts = [p.logprobs if p.logprobs is not None else 0 for p in params]
    if all(p.logprobs is None for p in params):
        return SamplerOutput(token_ids, None, None, None, counts)
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
    k = max(counts)
    top_ids, top_values = None, None
    if k > 0:
        top_values, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return SamplerOutput(token_ids, chosen, top_ids, top_values, counts)
