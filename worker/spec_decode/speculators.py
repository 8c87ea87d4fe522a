"""Draft proposal after each target step: n-gram, EAGLE-3 and DFlash behind one interface.

After the target verified a step, each request has `num_valid` rows (positions `start ..
start + num_valid - 1`) whose tokens are now final, and one newly sampled token at position
`start + num_valid`. Hidden-state drafters consume those rows (EAGLE-3 writes its own KV at the
same positions; DFlash writes the rows' fused features as context K/V), then propose K tokens
for requests that sampled. Every slot a drafter writes is checked against the request's block
table: a write past the lookahead the scheduler reserved would land in someone else's block.
"""

from __future__ import annotations

import functools
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, NamedTuple, TypeVar

import torch

from specserve.shared.config import SpecConfig, SpecMethod
from specserve.shared.protocol import is_greedy
from specserve.worker.attention.base import SequenceStep
from specserve.worker.attention.torch_backend import verifies_as_decode_rows
from specserve.worker.cpu import kernels
from specserve.worker.kv_cache import PagedKVCache
from specserve.worker.loader import resolve_dtype
from specserve.worker.model_registry import model_dtype
from specserve.worker.models import DecoderModel
from specserve.worker.sampler import argmax_rows, tempered
from specserve.worker.spec_decode.dflash import DFlashDrafter, load_dflash
from specserve.worker.spec_decode.eagle3 import Eagle3Drafter, load_eagle3
from specserve.worker.spec_decode.ngram import NgramProposer


class DraftSlotError(RuntimeError):
    """A drafter would write outside the blocks allocated to its request."""


@dataclass(frozen=True)
class Draft:
    """Proposed tokens, with the distributions they were sampled from (None: chosen greedily
    or deterministically, which verification treats as one-hot)."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab]


@dataclass(frozen=True)
class DraftInput:
    """One request's share of a verified step, as the drafters see it."""

    handle: int
    token_ids: list[int]  # every verified token, the newly sampled one included
    block_table: list[int]  # the target's full-attention table (drafter KV uses the same ids)
    row_start: int  # first row of the request in the step's flattened batch
    start: int  # first position processed this step
    num_valid: int  # rows whose tokens are verified: the drafter's new context
    num_drafts: int  # drafts to propose (0: none); the request sampled and fits the window
    # The request decoded without drafts this step: a drafter model may put its rows aside
    # and take them with a later step's (`_DrafterSpeculator` explains when).
    defer: bool = False
    temperature: float = 0.0  # the request's; used when drafts are sampled
    generator: torch.Generator | None = None


class VerifiedRows(NamedTuple):
    """A request's rows of a step whose tokens are now final: positions `start ..
    start + num_valid - 1`, rows `row_start ..` of the step's flattened batch."""

    handle: int
    start: int
    row_start: int
    num_valid: int


@dataclass(frozen=True)
class _DraftRows:
    """One request's drafts as a drafter model produces them, one depth at a time."""

    tokens: list[int]
    probs: list[torch.Tensor | None]

    def add(self, token: int, probs: torch.Tensor | None) -> None:
        self.tokens.append(token)
        self.probs.append(probs)

    def draft(self) -> Draft:
        """Greedy requests may get q at some depths only (when a sampled request drafted
        beside them); verification ignores their q, so they get none."""
        if any(p is None for p in self.probs):
            return Draft(self.tokens)
        return Draft(self.tokens, torch.stack(self.probs))  # type: ignore[arg-type]


def choose_drafts(
    logits: torch.Tensor, inputs: Sequence[DraftInput], sample: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per row of `logits` (row i belongs to `inputs[i]`).

    Greedy by default. With `sample`, a row of a request that is not greedy is drawn from
    softmax(logits / temperature) with the request's generator, and the distributions come back
    for exact verification; greedy requests keep argmax (their verification ignores q).
    """
    tokens = argmax_rows(logits)
    if not samples_drafts(inputs, sample):
        return tokens, None
    probs = torch.nn.functional.one_hot(tokens, logits.shape[-1]).float()
    for i, inp in enumerate(inputs):
        if not is_greedy(inp.temperature):
            temperature = torch.tensor([inp.temperature], device=logits.device)
            probs[i] = torch.softmax(tempered(logits[i : i + 1].float(), temperature)[0], dim=-1)
            tokens[i] = torch.multinomial(probs[i], 1, generator=inp.generator)[0]
    return tokens, probs


def samples_drafts(inputs: Sequence[DraftInput], sample: bool) -> bool:
    """Whether `choose_drafts` draws any row (else every draft is its row's argmax)."""
    return sample and not all(is_greedy(inp.temperature) for inp in inputs)


def draft_slots(
    table: Sequence[int], positions: Sequence[int], block_size: int, handle: int
) -> list[int]:
    """Slots of `positions` in `table`, refusing any outside the request's allocated blocks."""
    slots = []
    for pos in positions:
        index = pos // block_size
        if index >= len(table) or table[index] == 0:
            raise DraftSlotError(
                f"request {handle}: drafter writes position {pos}, outside its {len(table)} "
                f"allocated blocks of {block_size}; the scheduler's lookahead is too small"
            )
        slots.append(table[index] * block_size + pos % block_size)
    return slots


@dataclass(frozen=True)
class ContextWrite:
    """Drafter K/V written for verified rows in a pass of its own: every verified row needs
    it whether or not drafts are verified, so its time is not a draft's cost, except for the
    pass's fixed part, which a step that drafts pays every step and one that puts its rows
    aside once for many steps' rows."""

    rows: int
    seconds: float


class Speculator(ABC):
    method: SpecMethod
    num_spec_tokens: int
    aux_layer_ids: tuple[int, ...] = ()  # target layers whose outputs the drafter reads
    max_model_len: int | None = None  # the drafter's own position limit, if any
    drafts_are_free: bool = False  # proposing costs next to nothing (shadow drafts every step)
    # Rows put aside at earlier steps that the last `propose` caught up: their cost is no
    # draft's (the drafter writes them whether or not drafts are verified).
    backlog_rows_taken: int = 0
    # The last `propose`'s context K/V pass, where it ran apart from the drafting (None where
    # there was none, or the rows went through the drafting pass itself): what to take off
    # the call's time to leave the drafts' cost, rows put aside included.
    context_write: ContextWrite | None = None
    # A drafting call whose verified rows number at most this writes their K/V in its own pass:
    # no context pass to pay (0: every call with such rows runs one).
    context_rows_in_pass: int = 0

    @functools.cached_property
    def window_extra(self) -> int:
        """Positions past the sequence one draft round reaches (`SpecConfig` decides)."""
        return SpecConfig(self.method, self.num_spec_tokens).drafter_window_extra

    def window_allows(self, seq_len: int) -> bool:
        """Draft only if one round stays inside the drafter's window (DFlash counts the bonus)."""
        if self.max_model_len is None:
            return True
        return seq_len + self.window_extra <= self.max_model_len

    @abstractmethod
    def propose(
        self, inputs: Sequence[DraftInput], aux_hidden: torch.Tensor | None
    ) -> dict[int, Draft]:
        """Up to `num_drafts` drafts per handle (inputs with none get no entry); may update
        drafter KV for every input."""

    def forget(self, handle: int) -> None:  # noqa: B027 - most speculators keep no state
        """The request left this worker (finished or preempted): drop any per-request state."""

    def can_rest(self, rows: Sequence[VerifiedRows]) -> bool:
        """Whether a decode step that proposes nothing may skip `propose` for these rows
        (`rest`): n-gram's index takes the new tokens when it next proposes."""
        return True

    def rest(self, rows: Sequence[VerifiedRows], aux: Sequence[torch.Tensor]) -> None:  # noqa: B027
        """Take a decode step that proposes nothing (`can_rest` said so) without `propose`:
        `aux` are the step's captures of `aux_layer_ids`."""


class NgramSpeculator(Speculator):
    """Prompt lookup over each request's own tokens, with an incremental per-request index."""

    method = SpecMethod.NGRAM
    drafts_are_free = True

    def __init__(self, num_spec_tokens: int, min_n: int = 1, max_n: int = 4) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.proposer = NgramProposer(num_spec_tokens, min_n, max_n)

    def propose(
        self, inputs: Sequence[DraftInput], aux_hidden: torch.Tensor | None
    ) -> dict[int, Draft]:
        drafts = {}
        for inp in inputs:
            if inp.handle not in self.proposer:
                self.proposer.add_request(inp.handle, inp.token_ids)
            else:
                seen = len(self.proposer.indexes[inp.handle].tokens)
                self.proposer.extend(inp.handle, inp.token_ids[seen:])
            if inp.num_drafts:
                drafts[inp.handle] = Draft(self.proposer.propose(inp.handle)[: inp.num_drafts])
        return drafts

    def forget(self, handle: int) -> None:
        self.proposer.remove(handle)


_D = TypeVar("_D", Eagle3Drafter, DFlashDrafter)

MAX_DEFERRED_ROWS = 64  # verified rows per request a drafter model may put aside
# Verified rows whose drafter outputs nobody reads (all but each drafting request's last) may
# ride in the drafting pass, up to this many, where that pass runs as decode rows (one kernel
# call on CPU): a K/V pass of their own costs a dozen small ops. On a 2-core Zen 5, EAGLE-3 K=3
# at batch 1 (2-4 such rows a step) ran 4.4% faster this way (6 alternating rounds, outputs
# equal); batch 4 and 16 (adaptive) were level.
CONTEXT_ROWS_IN_PASS = 16


@dataclass
class _Deferred:
    start: int  # position of the first row put aside
    # the target features of positions start.., as (tensors, first row, rows): the tensors
    # that `_put_aside` kept for a step, the step's captures of the aux layers or one tensor
    # of them joined; sliced and joined only when taken
    rows: list[tuple[Sequence[torch.Tensor], int, int]]
    num_rows: int  # their rows, counted as they are put aside (asked for every step)

    def features(self) -> torch.Tensor:
        """The rows put aside, `[num_rows, aux features]`: the captures layer by layer, then
        side by side (a join per step cost ~20 us of a 7 ms batch-1 step)."""
        parts = [[kept[first : first + n] for kept in tensors] for tensors, first, n in self.rows]
        if all(len(part) == len(parts[0]) for part in parts):
            return torch.cat([torch.cat(layer) for layer in zip(*parts, strict=True)], dim=-1)
        return torch.cat([torch.cat(part, dim=-1) for part in parts])


@dataclass(frozen=True)
class _Context:
    """Rows a drafter model takes this step for one request: positions start..end-1."""

    inp: DraftInput
    start: int
    features: torch.Tensor  # [end - start, aux features]

    @property
    def end(self) -> int:
        return self.start + self.features.shape[0]


class _DrafterSpeculator(Speculator, Generic[_D]):
    """What the hidden-state speculators share: a drafter, its own KV cache, a device."""

    def __init__(
        self,
        drafter: _D,
        kv_cache: PagedKVCache,
        num_spec_tokens: int,
        aux_layer_ids: Sequence[int],
        max_model_len: int | None,
        device: torch.device,
        sample_drafts: bool = False,
    ) -> None:
        self.drafter = drafter
        self.kv_cache = kv_cache
        self.num_spec_tokens = num_spec_tokens
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.max_model_len = max_model_len
        self.device = device
        self.sample_drafts = sample_drafts

        self.deferred: dict[int, _Deferred] = {}

    def _tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def forget(self, handle: int) -> None:
        self.deferred.pop(handle, None)

    def _contexts(self, inputs: Sequence[DraftInput], aux_hidden: torch.Tensor) -> list[_Context]:
        """The verified rows the drafter takes now, per request: rows put aside first.

        A request decoding without drafts (`defer`) keeps its rows aside, up to
        `MAX_DEFERRED_ROWS`, so that while the policy verifies no drafts the drafter runs once
        over many steps' rows instead of once per step; drafting, or a full backlog, takes them
        all. Prompt chunks are never put aside: a request sharing their blocks through the
        prefix cache reads their drafter KV. A request that finishes with rows put aside leaves
        those positions (at most MAX_DEFERRED_ROWS) without drafter KV; a later request that
        reuses the blocks drafts worse from them, never wrongly (verification is lossless).
        """
        contexts = []
        self.backlog_rows_taken = 0
        self.context_write = None
        aside: list[DraftInput] = []
        for inp in inputs:
            backlog = self.deferred.get(inp.handle)
            if inp.defer and not inp.num_drafts and self._fits(inp.handle, inp.num_valid):
                aside.append(inp)
                continue
            start = inp.start
            rows = aux_hidden[inp.row_start : inp.row_start + inp.num_valid]
            if backlog is not None:
                del self.deferred[inp.handle]
                self.backlog_rows_taken += backlog.num_rows
                start = backlog.start
                rows = torch.cat([backlog.features(), rows])
            if rows.shape[0]:
                contexts.append(_Context(inp, start, rows))
        if aside:
            rows = [VerifiedRows(i.handle, i.start, i.row_start, i.num_valid) for i in aside]
            self._put_aside(rows, aux_hidden)
        return contexts

    def _fits(self, handle: int, num_rows: int) -> bool:
        """Whether `num_rows` more rows fit beside those `handle` has put aside."""
        backlog = self.deferred.get(handle)
        return (backlog.num_rows if backlog is not None else 0) + num_rows <= MAX_DEFERRED_ROWS

    def can_rest(self, rows: Sequence[VerifiedRows]) -> bool:
        return all(self._fits(row.handle, row.num_valid) for row in rows)

    def rest(self, rows: Sequence[VerifiedRows], aux: Sequence[torch.Tensor]) -> None:
        """The step's captures are kept as they are: `rows` are all their rows."""
        self._keep(rows, tuple(aux))

    def _put_aside(self, rows: Sequence[VerifiedRows], aux_hidden: torch.Tensor) -> None:
        """Keep `rows` for a later step, in one copy for all of them (a request's rows are
        slices of it: at batch 16 a copy each cost ~0.1 ms a step). `aux_hidden` is the step's
        own (`torch.cat` of its captures): where `rows` are all of it, it is kept as it is."""
        index: list[int] = []
        for row in rows:
            index.extend(range(row.row_start, row.row_start + row.num_valid))
        if index == list(range(aux_hidden.shape[0])):
            kept = aux_hidden
        elif index and index[-1] - index[0] + 1 == len(index):  # one run, as decodes are
            kept = aux_hidden[index[0] : index[-1] + 1].clone()
        else:
            kept = aux_hidden.index_select(0, torch.tensor(index, device=aux_hidden.device))
        self._keep(rows, (kept,))

    def _keep(self, rows: Sequence[VerifiedRows], tensors: tuple[torch.Tensor, ...]) -> None:
        """Add `rows`, one after another in `tensors`' rows, to their requests' backlogs."""
        first = 0
        for row in rows:
            backlog = self.deferred.get(row.handle)
            if backlog is None:
                backlog = self.deferred[row.handle] = _Deferred(row.start, [], 0)
            backlog.rows.append((tensors, first, row.num_valid))
            backlog.num_rows += row.num_valid
            first += row.num_valid


class Eagle3Speculator(_DrafterSpeculator[Eagle3Drafter]):
    """First pass over the verified rows with shifted tokens, then K-1 one-token steps."""

    method = SpecMethod.EAGLE3

    def __init__(
        self,
        drafter: Eagle3Drafter,
        kv_cache: PagedKVCache,
        num_spec_tokens: int,
        num_target_layers: int,
        max_model_len: int | None,
        device: torch.device,
        sample_drafts: bool = False,
    ) -> None:
        aux_layer_ids = drafter.aux_layer_ids(num_target_layers)
        super().__init__(
            drafter, kv_cache, num_spec_tokens, aux_layer_ids, max_model_len, device, sample_drafts
        )
        block = num_spec_tokens + 1  # a request's verified rows after a round: at most K + 1
        if drafter.context_rows_are_kv and verifies_as_decode_rows(drafter.backend, device, block):
            self.context_rows_in_pass = CONTEXT_ROWS_IN_PASS

    def propose(
        self, inputs: Sequence[DraftInput], aux_hidden: torch.Tensor | None
    ) -> dict[int, Draft]:
        assert aux_hidden is not None
        drafter, bs = self.drafter, self.kv_cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        steps: list[SequenceStep] = []
        last_rows: list[int] = []
        proposing: list[DraftInput] = []
        slots: list[int] = []
        last_steps: list[SequenceStep] = []  # the proposing rows alone, one query each
        contexts = self._contexts(inputs, aux_hidden)
        for ctx in contexts:
            inp, end = ctx.inp, ctx.end
            span = range(ctx.start, end)
            slots.extend(draft_slots(inp.block_table, span, bs, inp.handle))
            # Row p reads (token p+1, target hidden at p): the token ids shift left by one.
            ids.extend(inp.token_ids[ctx.start + 1 : end + 1])
            positions.extend(span)
            steps.append(SequenceStep(end - ctx.start, end, [inp.block_table]))
            if inp.num_drafts:
                last_rows.append(len(ids) - 1)
                last_steps.append(SequenceStep(1, end, [inp.block_table]))
                proposing.append(inp)
        if not steps:
            return {}
        started = time.perf_counter()
        hidden = drafter.combine_hidden_states(torch.cat([ctx.features for ctx in contexts]))
        if self._context_pass_alone(steps, len(ids) - len(proposing)):
            # Only the proposing rows' outputs are read: the rest need their K/V alone, and a
            # full pass runs on those rows only (one query each, over the K/V just written).
            ids_t, positions_t = self._tensor(ids), self._tensor(positions)
            drafter.write_context_kv(ids_t, hidden, positions_t, self._tensor(slots), self.kv_cache)
            self.context_write = ContextWrite(len(ids), time.perf_counter() - started)
            if not proposing:
                return {}
            last = self._tensor(last_rows)
            normed, hidden = drafter(
                ids_t[last],
                hidden[last],
                positions_t[last],
                drafter.build_attn_metadata(last_steps, bs, self.device),
                self.kv_cache,
            )
        else:
            normed, prenorm = drafter(
                self._tensor(ids),
                hidden,
                self._tensor(positions),
                drafter.build_attn_metadata(steps, bs, self.device),
                self.kv_cache,
            )
            if not proposing:
                return {}
            last = self._tensor(last_rows)
            normed, hidden = normed[last], prenorm[last]
        tokens, probs = self._drafts(normed, proposing)
        drafts = {inp.handle: _DraftRows([], []) for inp in proposing}
        active = proposing  # requests still drafting; each stops at its own num_drafts
        pos = [inp.start + inp.num_valid - 1 for inp in proposing]
        deepest = max(inp.num_drafts for inp in proposing)
        chained = self._greedy_chain(proposing, tokens, hidden, pos, deepest, probs is None)
        if chained is not None:
            for depth_tokens in [tokens, *chained]:
                for inp, token in zip(proposing, depth_tokens.tolist(), strict=True):
                    drafts[inp.handle].add(token, None)
            return {handle: rows.draft() for handle, rows in drafts.items()}
        for depth in range(1, deepest + 1):
            for i, (inp, token) in enumerate(zip(active, tokens.tolist(), strict=True)):
                drafts[inp.handle].add(token, None if probs is None else probs[i])
            if depth == deepest:
                break
            keep = [i for i, inp in enumerate(active) if inp.num_drafts > depth]
            if len(keep) < len(active):
                index = self._tensor(keep)
                active = [active[i] for i in keep]
                tokens, hidden = tokens[index], hidden[index]
                pos = [pos[i] for i in keep]
            pos = [p + 1 for p in pos]
            for inp, p in zip(active, pos, strict=True):
                draft_slots(inp.block_table, [p], bs, inp.handle)
            steps = [
                SequenceStep(1, p + 1, [inp.block_table])
                for inp, p in zip(active, pos, strict=True)
            ]
            normed, hidden = drafter(
                tokens,
                hidden,
                self._tensor(pos),
                drafter.build_attn_metadata(steps, bs, self.device),
                self.kv_cache,
            )
            tokens, probs = self._drafts(normed, active)
        return {handle: rows.draft() for handle, rows in drafts.items()}

    def _greedy_chain(
        self,
        proposing: Sequence[DraftInput],
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        pos: Sequence[int],
        deepest: int,
        greedy: bool,
    ) -> list[torch.Tensor] | None:
        """Depths 2..deepest in one `Eagle3Drafter.greedy_chain` where every request drafts
        that deep, greedily (else None: the depth-by-depth loop, which drops each request at
        its own depth and samples drafts). Every position is checked against the block
        tables first."""
        if not greedy or deepest < 2 or any(inp.num_drafts != deepest for inp in proposing):
            return None
        bs = self.kv_cache.block_size
        steps = []
        for depth in range(1, deepest):
            for inp, p in zip(proposing, pos, strict=True):
                draft_slots(inp.block_table, [p + depth], bs, inp.handle)
                steps.append(SequenceStep(1, p + depth + 1, [inp.block_table]))
        return self.drafter.greedy_chain(tokens, hidden, steps, self.kv_cache)

    def _context_pass_alone(self, steps: Sequence[SequenceStep], context_rows: int) -> bool:
        """Whether `context_rows` rows that need only their drafter K/V get a pass of their own
        (`write_context_kv`) rather than riding in the drafting pass over `steps`."""
        if not self.drafter.context_rows_are_kv or not context_rows:
            return False
        longest = max(step.query_len for step in steps)
        return context_rows > self.context_rows_in_pass or not verifies_as_decode_rows(
            self.drafter.backend, self.device, longest
        )

    def _drafts(
        self, normed: torch.Tensor, inputs: Sequence[DraftInput]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`choose_drafts` on the drafter's logits; greedy rows from its draft vocabulary."""
        if samples_drafts(inputs, self.sample_drafts):
            return choose_drafts(self.drafter.compute_logits(normed), inputs, True)
        return self.drafter.greedy_drafts(normed), None


class DFlashSpeculator(_DrafterSpeculator[DFlashDrafter]):
    """Context K/V for the verified rows, then one non-causal pass over [next, MASK x K]."""

    method = SpecMethod.DFLASH

    def __init__(
        self,
        drafter: DFlashDrafter,
        kv_cache: PagedKVCache,
        num_spec_tokens: int,
        max_model_len: int | None,
        device: torch.device,
        sample_drafts: bool = False,
    ) -> None:
        aux_layer_ids = drafter.aux_layer_ids()
        super().__init__(
            drafter, kv_cache, num_spec_tokens, aux_layer_ids, max_model_len, device, sample_drafts
        )

    def propose(
        self, inputs: Sequence[DraftInput], aux_hidden: torch.Tensor | None
    ) -> dict[int, Draft]:
        assert aux_hidden is not None
        drafter, bs, k = self.drafter, self.kv_cache.block_size, self.num_spec_tokens
        positions: list[int] = []
        slots: list[int] = []
        contexts = self._contexts(inputs, aux_hidden)
        for ctx in contexts:
            span = range(ctx.start, ctx.end)
            positions.extend(span)
            slots.extend(draft_slots(ctx.inp.block_table, span, bs, ctx.inp.handle))
        if contexts:
            started = time.perf_counter()
            drafter.write_context_kv(
                drafter.combine_hidden_states(torch.cat([ctx.features for ctx in contexts])),
                self._tensor(positions),
                self._tensor(slots),
                self.kv_cache,
            )
            self.context_write = ContextWrite(len(positions), time.perf_counter() - started)
        proposing = [inp for inp in inputs if inp.num_drafts]
        if not proposing:
            return {}
        ids: list[int] = []
        positions = []
        steps = []
        for inp in proposing:
            first = inp.start + inp.num_valid  # the newly sampled token's position
            draft_slots(inp.block_table, [first + k], bs, inp.handle)
            ids.extend([inp.token_ids[first], *[drafter.mask_token_id] * k])
            positions.extend(range(first, first + k + 1))
            steps.append(SequenceStep(k + 1, first + k + 1, [inp.block_table], causal=False))
        hidden = drafter(
            self._tensor(ids),
            self._tensor(positions),
            drafter.build_attn_metadata(steps, bs, self.device),
            self.kv_cache,
        )
        # Each MASK row predicts the token at its own position; the first row is not sampled.
        # The block is the drafter's trained size; a request asking for fewer keeps a prefix,
        # and rows past the deepest request's are not read out: the full-vocabulary head is
        # most of a pass (a one-deep probe at batch 1 reads one row of three).
        depth = max(inp.num_drafts for inp in proposing)
        mask_rows = [r * (k + 1) + j for r in range(len(proposing)) for j in range(1, depth + 1)]
        row_inputs = [inp for inp in proposing for _ in range(depth)]
        logits = drafter.compute_logits(hidden[self._tensor(mask_rows)])
        tokens, probs = choose_drafts(logits, row_inputs, self.sample_drafts)
        per_request = tokens.view(len(proposing), depth).tolist()
        return {
            inp.handle: Draft(
                d[: inp.num_drafts],
                None if probs is None else probs[i * depth : i * depth + inp.num_drafts],
            )
            for i, (inp, d) in enumerate(zip(proposing, per_request, strict=True))
        }


Drafter = Eagle3Drafter | DFlashDrafter


BUNDLED_DRAFTERS = Path(__file__).with_name("bundled")  # <model>-<method>/ checkpoint dirs


def resolve_drafter(method: SpecMethod, model: str, path: str | None) -> str | None:
    """The drafter checkpoint to load: the one given, else the one shipped for a bundled
    model (`specserve train-drafter` made them; their config says how)."""
    if path is not None or method not in (SpecMethod.EAGLE3, SpecMethod.DFLASH):
        return path
    shipped = BUNDLED_DRAFTERS / f"{model}-{method.value}"
    return str(shipped) if (shipped / "config.json").is_file() else None


NGRAM_NUM_SPEC_TOKENS = 4  # n-gram's K when none is given (the adaptive policy trims it)


def default_num_spec_tokens(method: SpecMethod, path: str | None) -> int:
    """K when none is given: `NGRAM_NUM_SPEC_TOKENS` for n-gram; for a drafter, what it was
    trained with (a `specserve train-drafter` checkpoint records it; a DFlash block of B tokens
    means K = B - 1), else 0."""
    if method == SpecMethod.NGRAM:
        return NGRAM_NUM_SPEC_TOKENS
    if path is None or method not in (SpecMethod.EAGLE3, SpecMethod.DFLASH):
        return 0
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0  # the loader reports an unreadable checkpoint
    trained = (config.get("specserve_training") or {}).get("num_spec_tokens")
    if trained:
        return int(trained)
    block = config.get("block_size") if method == SpecMethod.DFLASH else None
    return int(block) - 1 if block else 0


def drafter_dtype(choice: str, path: str, target: DecoderModel) -> torch.dtype:
    """The dtype a drafter runs in: `choice`, or for "auto" the target's, except that beside a
    float32 target on a CPU with bfloat16 arithmetic a drafter saved in 16 bits runs in
    bfloat16. At batch 1 a draft streams the drafter's weights as a decode step streams the
    target's (37 MB in float32 for the bundled EAGLE-3 drafter, 19 of them its draft LM head),
    and a 16-bit checkpoint loses nothing in bfloat16 but the rounding of its activations;
    drafts stay verified by the target, so what is generated does not change. Where the panels
    widen bfloat16 to float32 (AVX2, AVX-512 without AVX512_BF16) the drafter keeps the
    target's dtype: bfloat16 would not be multiplied faster there, and a float32 drafter saved
    in 16 bits reads its 16-bit panels (`narrow_panels`), half its bytes, exactly; `load_drafter`
    then reads its layers as 8-bit blocks (`read_as_8bit_blocks`), half of that again."""
    if choice != "auto":
        return resolve_dtype(choice)
    device = target.embed_tokens.weight.device
    if target.dtype != torch.float32 or device.type != "cpu":
        return target.dtype
    if torch.bfloat16 not in kernels.linear_dtypes() or kernels.linear_widens_bfloat16():
        return target.dtype
    # the checkpoint's own dtype as `--dtype auto` reads it (float16 is bfloat16 on CPU)
    saved = model_dtype(path, "auto", device)
    return torch.bfloat16 if saved == torch.bfloat16 else target.dtype


def load_drafter(
    method: SpecMethod, path: str | None, target: DecoderModel, dtype: str = "auto"
) -> Drafter | None:
    """The drafter model for hidden-state methods (None for n-gram and no speculation), in
    `drafter_dtype(dtype, ...)`."""
    if method in (SpecMethod.NONE, SpecMethod.NGRAM):
        if path is not None:
            raise ValueError(f"--drafter is not used with spec method {method.value!r}")
        return None
    if path is None:
        raise ValueError(
            f"spec method {method.value!r} needs --drafter PATH (a checkpoint dir); only the "
            "bundled models ship one"
        )
    chosen = drafter_dtype(dtype, path, target)
    if method == SpecMethod.EAGLE3:
        drafter: Drafter = load_eagle3(path, target, chosen)
    else:
        drafter = load_dflash(path, target, chosen)
    on_cpu = target.embed_tokens.weight.device.type == "cpu"
    if dtype == "auto" and chosen == torch.float32 and on_cpu and kernels.linear_narrow_max_rows(8):
        drafter.read_as_8bit_blocks()
    return drafter


def drafter_max_model_len(drafter: Drafter | None, explicit: int | None, target_len: int) -> int:
    """The drafter's window: an explicit limit, else its checkpoint's, never above the target's."""
    limit = explicit if explicit is not None else target_len
    if drafter is not None:
        limit = min(limit, drafter.config.layer.max_position_embeddings)
    return min(limit, target_len)


def make_speculator(
    method: SpecMethod,
    num_spec_tokens: int,
    drafter: Drafter | None,
    target: DecoderModel,
    num_blocks: int,
    block_size: int,
    max_model_len: int | None,
    device: torch.device | str,
    sample_drafts: bool = False,
) -> Speculator | None:
    device = torch.device(device)
    if method == SpecMethod.NONE:
        return None
    if method == SpecMethod.NGRAM:
        return NgramSpeculator(num_spec_tokens)
    assert drafter is not None
    kv_cache = drafter.make_kv_cache(num_blocks, block_size, device)
    if isinstance(drafter, Eagle3Drafter):
        return Eagle3Speculator(
            drafter, kv_cache, num_spec_tokens, target.config.num_layers, max_model_len, device,
            sample_drafts,
        )  # fmt: skip
    return DFlashSpeculator(
        drafter, kv_cache, num_spec_tokens, max_model_len, device, sample_drafts
    )
