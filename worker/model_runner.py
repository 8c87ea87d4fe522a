"""Applies step batches to persistent per-request state and runs one forward pass per step.

The worker keeps each request's tokens, block tables and sampling generator between steps; a
step batch only says what changed. Tokens a request needs this step are its known tokens from
`num_computed_tokens` on (a prefill chunk, or the newest sampled token in decode).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import torch

from specserve.shared.config import AttentionType
from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    KeptRequest,
    NewRequest,
    RequestResult,
    SamplingParams,
    StepBatch,
    StepResult,
    TokenLogprobs,
    check_token_ids,
)
from specserve.worker.attention.base import AttentionMetadata, SequenceStep
from specserve.worker.attention.torch_backend import verifies_as_decode_rows
from specserve.worker.cpu import fused_decode
from specserve.worker.kv_cache import PagedKVCache
from specserve.worker.models import DecoderModel, ReadOut
from specserve.worker.sampler import (
    SamplerOutput,
    apply_penalties,
    make_generator,
    reseed_for_position,
    sample,
    token_logprobs,
)
from specserve.worker.spec_decode.policy import Candidate, DraftPlan, SpecPolicy
from specserve.worker.spec_decode.rejection_sampler import greedy_verify, rejection_sample
from specserve.worker.spec_decode.speculators import DraftInput, Speculator, VerifiedRows


def forward_step(
    model: DecoderModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    metadata: AttentionMetadata,
    kv_cache: PagedKVCache,
    aux_layers: Sequence[int],
    read_out: ReadOut | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The target's forward for one step: a CPU decode step in one kernel call where it
    applies (`fused_decode`), else layer by layer; the same results either way. With
    `read_out` (never a decode step: it reads fewer rows than the step has), the final hidden
    states of its rows only."""
    if read_out is None:
        fused = fused_decode.decode_step(
            model, input_ids, positions, metadata, kv_cache, aux_layers
        )
        if fused is not None:
            return fused
    return model.forward_with_aux(input_ids, positions, metadata, kv_cache, aux_layers, read_out)


PROMPT_LOGPROB_ROWS = 256  # prompt rows whose logits are held at once (49k floats each)


@dataclass
class RequestState:
    handle: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_tables: list[list[int]]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    cache_salt: str | None = None
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(draft_token_ids), vocab] when sampled


class HiddenStateRecorder(Protocol):
    """Receives the target's hidden states of every row a step computes (drafter training).

    `aux` holds the outputs of `layers` concatenated (`[n, len(layers) * hidden]`), `final`
    the normed final hidden states (`[n, hidden]`), for `n` rows at positions `start..`: float32
    on the model's device, never written again, so the recorder may keep them as they are.
    """

    layers: tuple[int, ...]

    def record(
        self, request_id: str, start: int, aux: torch.Tensor, final: torch.Tensor
    ) -> None: ...


@dataclass(frozen=True)
class _Sampled:
    """The requests a step samples from, each from its last k+1 rows (k its drafts)."""

    rows: list[int]  # the step's rows sampled from, request by request
    states: list[RequestState]
    drafts: list[list[int]]
    items: list[int]  # each request's index in the step


@dataclass(frozen=True)
class _Scheduled:
    state: RequestState
    num_tokens: int  # scheduled this step, drafts included
    num_spec: int  # drafts to verify


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_cache: PagedKVCache,
        device: torch.device | str,
        speculator: Speculator | None = None,
        adaptive_spec: bool = True,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.config = model.config
        self.speculator = speculator
        self.spec_policy = None
        if speculator is not None:
            as_rows = verifies_as_decode_rows(
                model.backend, self.device, speculator.num_spec_tokens + 1
            )
            self.spec_policy = SpecPolicy(
                speculator.num_spec_tokens,
                speculator.drafts_are_free,
                adaptive_spec,
                as_rows,
                row_tiles=model.row_tiles() if as_rows else None,
                context_rows_in_pass=speculator.context_rows_in_pass,
            )
        self.recorder: HiddenStateRecorder | None = None  # set for drafter training only
        self._planned_for: tuple[int, ...] = ()  # the requests of the last plan's step
        self.requests: dict[int, RequestState] = {}
        groups = self.config.kv_groups
        if (
            speculator is not None
            and speculator.aux_layer_ids
            and (groups[0].attention != AttentionType.FULL)
        ):
            raise ValueError("a hidden-state drafter needs a target with full-attention layers")
        model.greedy_screen()  # made at load (~0.1 s for SmolLM2), not in the first step

    def execute(self, batch: StepBatch) -> StepResult:
        """Run one step. A request with bad input fails alone; the rest of the batch runs."""
        for handle in (*batch.preempted, *batch.finished):
            self._drop(handle)
        failed: list[RequestResult] = []
        scheduled: list[_Scheduled] = []
        for new in batch.new_requests:
            try:
                scheduled.append(_Scheduled(self._add_request(new), new.num_scheduled_tokens, 0))
            except ValueError as exc:
                failed.append(RequestResult(new.handle, [], error=str(exc)))
        for delta in batch.running:
            state = self.requests.get(delta.handle)
            error = None
            if state is None:
                error = f"unknown request handle {delta.handle}"
            elif delta.num_spec_tokens > len(state.draft_token_ids):
                error = (
                    f"{delta.num_spec_tokens} drafts scheduled but only "
                    f"{len(state.draft_token_ids)} were proposed"
                )
            if error is not None:
                self._drop(delta.handle)
                failed.append(RequestResult(delta.handle, [], error=error))
                continue
            assert state is not None
            if delta.new_block_ids:
                for table, new_ids in zip(state.block_tables, delta.new_block_ids, strict=True):
                    table.extend(new_ids)
            state.num_computed_tokens = delta.num_computed_tokens
            scheduled.append(_Scheduled(state, delta.num_scheduled_tokens, delta.num_spec_tokens))
        results = self._run(scheduled) if scheduled else []
        return StepResult(PROTOCOL_VERSION, batch.step_id, results + failed)

    def kept_requests(self) -> list[KeptRequest]:
        """The KV this runner holds, for a control plane to adopt as cached prefixes: per
        request, its tokens whose KV is computed (never an unverified draft's) and the blocks
        holding their full blocks. Only full-attention models report any: a sliding window's
        older blocks may already hold another request's KV."""
        groups = self.config.kv_groups
        if any(g.attention != AttentionType.FULL for g in groups):
            return []
        block_size = self.kv_cache.block_size
        kept = []
        for state in self.requests.values():
            num_full = state.num_computed_tokens // block_size
            if num_full == 0:
                continue
            kept.append(
                KeptRequest(
                    token_ids=state.token_ids[: num_full * block_size],
                    block_ids=[table[:num_full] for table in state.block_tables],
                    cache_salt=state.cache_salt,
                )
            )
        return kept

    def drop_all(self) -> None:
        """Forget every request, e.g. when a new scheduler takes over with an empty block pool."""
        self.drop(list(self.requests))

    def drop(self, handles: list[int]) -> None:
        for handle in handles:
            self._drop(handle)

    def _drop(self, handle: int) -> None:
        self.requests.pop(handle, None)
        if self.speculator is not None:
            self.speculator.forget(handle)
        if self.spec_policy is not None:
            self.spec_policy.forget(handle)

    def _add_request(self, new: NewRequest) -> RequestState:
        vocab = self.config.vocab_size
        check_token_ids(new.token_ids, vocab, "token ids")
        if len(new.block_ids) != len(self.config.kv_groups):
            raise ValueError(
                f"{len(new.block_ids)} block tables for {len(self.config.kv_groups)} KV groups"
            )
        new.sampling.validate(vocab)
        generator = None
        if new.sampling.seed is not None:
            generator = make_generator(new.sampling.seed, self.device)
        state = RequestState(
            handle=new.handle,
            request_id=new.request_id,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            sampling=new.sampling,
            block_tables=[list(t) for t in new.block_ids],
            num_computed_tokens=new.num_computed_tokens,
            generator=generator,
            cache_salt=new.cache_salt,
        )
        self.requests[new.handle] = state
        return state

    def _run(self, scheduled: Sequence[_Scheduled]) -> list[RequestResult]:
        """One target forward for the whole batch, then verification, then drafting."""
        started = time.perf_counter()
        input_ids: list[int] = []
        positions: list[int] = []
        steps: list[SequenceStep] = []
        row_starts: list[int] = []
        for item in scheduled:
            state, n, k = item.state, item.num_tokens, item.num_spec
            start = state.num_computed_tokens
            known = state.token_ids[start : start + n - k]
            if len(known) != n - k:
                raise ValueError(
                    f"request {state.request_id}: {n} tokens scheduled from position {start} "
                    f"but only {len(state.token_ids)} are known"
                )
            row_starts.append(len(input_ids))
            input_ids.extend(known)
            input_ids.extend(state.draft_token_ids[:k])
            positions.extend(range(start, start + n))
            steps.append(SequenceStep(n, start + n, state.block_tables))

        metadata = self.model.backend.build_metadata(
            steps, self.config.kv_groups, self.kv_cache.block_size, self.device
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        aux_layers = self.speculator.aux_layer_ids if self.speculator else ()
        if self.recorder is not None:
            if self.speculator is not None:
                raise ValueError("hidden states are recorded only without speculation")
            aux_layers = self.recorder.layers
        sampled = _sampled(scheduled, row_starts)
        read_out = self._read_out(scheduled, steps, sampled, len(input_ids), aux_layers)
        hidden, aux = forward_step(
            self.model, ids, pos, metadata, self.kv_cache, aux_layers, read_out
        )
        if self.recorder is not None:
            self._record(scheduled, row_starts, hidden, aux)

        prompt_logprobs = self._prompt_logprobs(scheduled, row_starts, hidden)
        if read_out is None and sampled.rows:
            hidden = hidden[torch.tensor(sampled.rows, device=self.device)]
        emitted, logprobs = self._sample(sampled, hidden)
        results = []
        valid: list[int] = []  # rows per request whose tokens are now final
        for item in scheduled:
            state, n, k = item.state, item.num_tokens, item.num_spec
            tokens = emitted.get(state.handle, [])
            num_valid = n - k + max(len(tokens) - 1, 0)  # known tokens plus accepted drafts
            valid.append(num_valid)
            state.num_computed_tokens += num_valid
            state.token_ids.extend(tokens)
            state.draft_token_ids = []
            state.draft_probs = None
            first, prompt = prompt_logprobs.get(state.handle, (0, None))
            results.append(
                RequestResult(
                    state.handle,
                    tokens,
                    logprobs=logprobs.get(state.handle),
                    prompt_logprobs=prompt,
                    prompt_logprobs_from=first,
                )
            )
        if self.speculator is None:
            return results
        assert self.spec_policy is not None
        verified = time.perf_counter()
        num_drafts = sum(item.num_spec for item in scheduled)
        prefill = any(item.num_tokens - item.num_spec > 1 for item in scheduled)
        self.spec_policy.observe_step(len(input_ids), num_drafts, prefill, verified - started)
        handles = tuple(item.state.handle for item in scheduled)
        if not num_drafts and self._rests(handles, scheduled, results, row_starts, aux):
            return results
        plan = self._plan_drafts(scheduled, results)
        self._planned_for = handles
        draft_inputs = []
        for item, row_start, result, num_valid in zip(
            scheduled, row_starts, results, valid, strict=True
        ):
            state = item.state
            draft_inputs.append(
                DraftInput(
                    handle=state.handle,
                    token_ids=state.token_ids,
                    block_table=state.block_tables[0],
                    row_start=row_start,
                    start=state.num_computed_tokens - num_valid,
                    num_valid=num_valid,
                    num_drafts=plan.num_to_propose(state.handle, self.speculator.num_spec_tokens),
                    defer=self.spec_policy.adaptive and bool(result.sampled_token_ids),
                    temperature=state.sampling.temperature,
                    generator=state.generator,
                )
            )
        aux_hidden = torch.cat(aux, dim=-1) if aux else None
        drafts = self.speculator.propose(draft_inputs, aux_hidden)
        seconds = time.perf_counter() - verified
        num_drafted = sum(len(d.tokens) for d in drafts.values())
        context = self.speculator.context_write
        if context is not None:
            self.spec_policy.observe_context_write(context.rows, context.seconds)
        if num_drafted and (context is not None or not self.speculator.backlog_rows_taken):
            # What drafts cost: not a call that drafted nothing (putting rows aside is paid
            # whether or not drafts are verified, and a line fed mostly those forgets the cost
            # of a draft), and not the context K/V written for verified rows, paid either way:
            # a prompt's rows (a batch-4 call after the prompts took 8.9 ms, 4.9 of them
            # context) or rows put aside and caught up (after a back-off, a one-token EAGLE-3
            # probe at batch 1 took 4 ms, a draft ~2). Where the context went through the
            # drafting pass itself, a call that caught up rows is not timed at all.
            depth = max(len(d.tokens) for d in drafts.values())
            drafting = seconds - (context.seconds if context is not None else 0.0)
            self.spec_policy.observe_drafting(num_drafted, drafting, depth)
        for i, result in enumerate(results):
            proposed = drafts.get(result.handle)
            if proposed is None or not proposed.tokens:
                continue
            state = self.requests[result.handle]
            if result.handle in plan.shadow:
                self.spec_policy.add_shadow(result.handle, len(state.token_ids), proposed.tokens)
            num_verify = plan.verify.get(result.handle, 0)
            if num_verify:
                state.draft_token_ids = proposed.tokens[:num_verify]
                state.draft_probs = None if proposed.probs is None else proposed.probs[:num_verify]
                results[i] = RequestResult(
                    result.handle, result.sampled_token_ids, state.draft_token_ids, result.logprobs
                )
        return results

    def _rests(
        self,
        handles: tuple[int, ...],
        scheduled: Sequence[_Scheduled],
        results: Sequence[RequestResult],
        row_starts: Sequence[int],
        aux: Sequence[torch.Tensor],
    ) -> bool:
        """Take a decode step that verified nothing with no plan and no `propose`, where the
        plan would be the last one's, none (`SpecPolicy.rests`), for the same requests: the
        drafter puts their rows aside as `propose` would have (`Speculator.rest`). Planning,
        the per-request draft inputs and joining the captures were most of such a step's
        speculation: 0.12 ms of a 9 ms DFlash step at batch 1, 0.02 ms resting."""
        assert self.speculator is not None and self.spec_policy is not None
        if handles != self._planned_for or not all(
            item.num_tokens == 1 and result.sampled_token_ids
            for item, result in zip(scheduled, results, strict=True)
        ):
            return False  # other requests, or a prompt's rows (never put aside)
        rows = [
            VerifiedRows(item.state.handle, item.state.num_computed_tokens - 1, row_start, 1)
            for item, row_start in zip(scheduled, row_starts, strict=True)
        ]
        if not self.speculator.can_rest(rows) or not self.spec_policy.rests():
            return False
        self.speculator.rest(rows, aux)
        return True

    def _plan_drafts(
        self, scheduled: Sequence[_Scheduled], results: Sequence[RequestResult]
    ) -> DraftPlan:
        """Learn from this step's verified drafts, then ask the policy for the next step's."""
        assert self.speculator is not None and self.spec_policy is not None
        candidates: list[Candidate] = []
        other_decodes = prefill_rows = 0
        for item, result in zip(scheduled, results, strict=True):
            state, tokens = item.state, result.sampled_token_ids
            if not tokens:
                prefill_rows += item.num_tokens
                continue
            self.spec_policy.observe_verified(state.handle, item.num_spec, len(tokens) - 1)
            if state.sampling.has_penalties or not self.speculator.window_allows(
                len(state.token_ids)
            ):
                other_decodes += 1  # never speculated
                continue
            seeded = state.generator is not None and not state.sampling.greedy
            candidates.append(Candidate(state.handle, state.token_ids, fixed=seeded))
        return self.spec_policy.plan(candidates, other_decodes, prefill_rows)

    def _record(
        self,
        scheduled: Sequence[_Scheduled],
        row_starts: Sequence[int],
        hidden: torch.Tensor,
        aux: Sequence[torch.Tensor],
    ) -> None:
        assert self.recorder is not None
        # one float32 copy of the step's rows, of which each request keeps its views
        features = torch.cat(list(aux), dim=-1).to(torch.float32)
        final = hidden.to(torch.float32, copy=True)
        for item, row_start in zip(scheduled, row_starts, strict=True):
            rows = slice(row_start, row_start + item.num_tokens)
            self.recorder.record(
                item.state.request_id,
                item.state.num_computed_tokens,
                features[rows],
                final[rows],
            )

    def _prompt_logprobs(
        self, scheduled: Sequence[_Scheduled], row_starts: Sequence[int], hidden: torch.Tensor
    ) -> dict[int, tuple[int, TokenLogprobs]]:
        """For each request that asked: the logprobs of the prompt tokens this step's rows
        predict (row p predicts token p + 1), with the index of the first, and the top N at
        each. The LM head runs on those rows in slices, so a long chunk never holds all its
        logits at once."""
        out: dict[int, tuple[int, TokenLogprobs]] = {}
        for item, row_start in zip(scheduled, row_starts, strict=True):
            state, n_top = item.state, item.state.sampling.prompt_logprobs
            start = state.num_computed_tokens
            end = min(start + item.num_tokens - item.num_spec, state.num_prompt_tokens - 1)
            if n_top is None or end <= start:
                continue
            params = [msgspec.structs.replace(state.sampling, logprobs=n_top)]
            joined = TokenLogprobs([], [], [])
            for lo in range(start, end, PROMPT_LOGPROB_ROWS):
                hi = min(lo + PROMPT_LOGPROB_ROWS, end)
                rows = torch.arange(row_start + lo - start, row_start + hi - start)
                logits = self.model.compute_logits(hidden[rows.to(self.device)]).float()
                targets = torch.tensor(state.token_ids[lo + 1 : hi + 1], device=self.device)
                got = token_logprobs(logits, targets, params * (hi - lo))
                part = _rows_logprobs(got, slice(0, hi - lo), n_top)
                joined.chosen.extend(part.chosen)
                joined.top_ids.extend(part.top_ids)
                joined.top_logprobs.extend(part.top_logprobs)
            out[state.handle] = (start + 1, joined)
        return out

    def _read_out(
        self,
        scheduled: Sequence[_Scheduled],
        steps: Sequence[SequenceStep],
        sampled: _Sampled,
        num_rows: int,
        aux_layers: Sequence[int],
    ) -> ReadOut | None:
        """The sampled rows as the last layer's only outputs, where the step reads no other
        row's final hidden state (no prompt logprobs, no recorder, the last layer not
        captured) and at least half its rows are not sampled: a step with prompt rows."""
        if (
            2 * len(sampled.rows) > num_rows
            or self.recorder is not None
            or self.config.num_layers - 1 in aux_layers
            or any(item.state.sampling.prompt_logprobs is not None for item in scheduled)
        ):
            return None
        metadata = None
        if sampled.items:  # each request's sampled rows as the queries of its sequence
            read_steps = [
                SequenceStep(scheduled[i].num_spec + 1, steps[i].seq_len, steps[i].block_tables)
                for i in sampled.items
            ]
            metadata = self.model.backend.build_metadata(
                read_steps, self.config.kv_groups, self.kv_cache.block_size, self.device
            )
        rows = torch.tensor(sampled.rows, dtype=torch.int64, device=self.device)
        return ReadOut(rows, metadata)

    def _sample(
        self, sampled: _Sampled, selected: torch.Tensor
    ) -> tuple[dict[int, list[int]], dict[int, TokenLogprobs]]:
        """Tokens per request that reached the end of its known tokens (plus their logprobs),
        from `selected`, the final hidden states of `sampled.rows`.

        A request verifying k drafts samples from its last k+1 rows through the rejection
        sampler; a batch with no drafts at all takes the plain sampler.
        """
        sampling, drafts = sampled.states, sampled.drafts
        if not sampling:
            return {}, {}
        if all(_argmax_only(s.sampling) for s in sampling):
            argmax = self.model.greedy_tokens(selected)
            if argmax is not None:
                verified = greedy_verify(argmax.tolist(), drafts)
                return {s.handle: t for s, t in zip(sampling, verified, strict=True)}, {}
        logits = self.model.compute_logits(selected)
        params = [s.sampling for s in sampling]
        generators = [s.generator for s in sampling]
        for state in sampling:
            if state.generator is not None:
                assert state.sampling.seed is not None
                num_output = len(state.token_ids) - state.num_prompt_tokens
                reseed_for_position(state.generator, state.sampling.seed, num_output)
        if not any(drafts):
            penalized = _penalized(logits, sampling, [1] * len(sampling))
            out = sample(logits if penalized is None else penalized, params, generators)
            if penalized is not None and any(p.logprobs is not None for p in params):
                # logprobs are the model's own (as vLLM reports them), not the penalized ones
                out = token_logprobs(logits.float(), out.token_ids, params)
            token_ids = out.token_ids.tolist()
            emitted = {s.handle: [token_ids[i]] for i, s in enumerate(sampling)}
            return emitted, _logprobs_by_request(out, sampling, [1] * len(sampling))
        # Requests with penalties propose no drafts (one row each): penalized here, while the
        # others' drafts are verified as usual; logprobs below stay the model's own.
        penalized = _penalized(logits, sampling, [len(d) + 1 for d in drafts])
        verify = logits if penalized is None else penalized
        per_request = rejection_sample(
            verify, drafts, params, generators, self._draft_probs(sampling, drafts, verify)
        )
        emitted = {s.handle: tokens for s, tokens in zip(sampling, per_request, strict=True)}
        if all(s.sampling.logprobs is None for s in sampling):
            return emitted, {}
        # Each emitted token was produced by the row at its own offset in the request's k+1 rows.
        rows, row_params = [], []
        start = 0
        for state, scheduled, tokens in zip(sampling, drafts, per_request, strict=True):
            rows.extend(range(start, start + len(tokens)))
            row_params.extend([state.sampling] * len(tokens))
            start += len(scheduled) + 1
        flat = torch.tensor([t for tokens in per_request for t in tokens], device=logits.device)
        out = token_logprobs(
            logits[torch.tensor(rows, device=logits.device)].float(), flat, row_params
        )
        return emitted, _logprobs_by_request(out, sampling, [len(t) for t in per_request])

    def _draft_probs(
        self,
        sampling: Sequence[RequestState],
        drafts: Sequence[Sequence[int]],
        logits: torch.Tensor,
    ) -> torch.Tensor | None:
        """q for every scheduled draft when any was sampled (one-hot rows for the others)."""
        if all(s.draft_probs is None for s in sampling):
            return None
        rows = []
        for state, scheduled in zip(sampling, drafts, strict=True):
            k = len(scheduled)
            if not k:
                continue
            if state.draft_probs is not None:
                rows.append(state.draft_probs[:k].to(logits.device, torch.float32))
            else:
                ids = torch.tensor(scheduled, device=logits.device)
                rows.append(torch.nn.functional.one_hot(ids, logits.shape[-1]).float())
        return torch.cat(rows)


def _sampled(scheduled: Sequence[_Scheduled], row_starts: Sequence[int]) -> _Sampled:
    """The requests that reach the end of their known tokens this step, and their rows."""
    sampled = _Sampled([], [], [], [])
    for i, (item, row_start) in enumerate(zip(scheduled, row_starts, strict=True)):
        state, n, k = item.state, item.num_tokens, item.num_spec
        if state.num_computed_tokens + n - k < len(state.token_ids):
            continue  # a prefill chunk: nothing to sample yet
        sampled.rows.extend(range(row_start + n - k - 1, row_start + n))
        sampled.states.append(state)
        sampled.drafts.append(state.draft_token_ids[:k])
        sampled.items.append(i)
    return sampled


def _argmax_only(sampling: SamplingParams) -> bool:
    """Whether a request's token is the argmax of the model's own logits and nothing else is
    read from them (greedy, no logprobs, no penalties)."""
    return sampling.greedy and sampling.logprobs is None and not sampling.has_penalties


def _penalized(
    logits: torch.Tensor, sampling: Sequence[RequestState], rows_per_request: Sequence[int]
) -> torch.Tensor | None:
    """`logits` with each request's penalties applied to its rows (None: no request has any)."""
    if not any(state.sampling.has_penalties for state in sampling):
        return None
    params: list[SamplingParams] = []
    histories: list[tuple[list[int], list[int]]] = []
    for state, n in zip(sampling, rows_per_request, strict=True):
        params += [state.sampling] * n
        if not state.sampling.has_penalties:
            histories += [([], [])] * n  # its rows are left as they are: no copy of its tokens
            continue
        assert n == 1, "a request with penalties has drafts"
        split = state.num_prompt_tokens
        histories.append((state.token_ids[:split], state.token_ids[split:]))
    return apply_penalties(logits, params, histories)


def _logprobs_by_request(
    out: SamplerOutput, states: Sequence[RequestState], rows_per_request: Sequence[int]
) -> dict[int, TokenLogprobs]:
    """Split sampler output rows into each request's `TokenLogprobs` (requests that asked)."""
    result: dict[int, TokenLogprobs] = {}
    row = 0
    for state, n in zip(states, rows_per_request, strict=True):
        n_top = state.sampling.logprobs
        if n_top is not None and out.logprobs is not None:
            result[state.handle] = _rows_logprobs(out, slice(row, row + n), n_top)
        row += n
    return result


def _rows_logprobs(out: SamplerOutput, rows: slice, n_top: int) -> TokenLogprobs:
    """The chosen logprobs of sampler output `rows`, with the top `n_top` of each."""
    assert out.logprobs is not None
    n = rows.stop - rows.start
    top_ids, top_lps = out.top_token_ids, out.top_logprobs
    has_top = n_top > 0 and top_ids is not None and top_lps is not None
    return TokenLogprobs(
        out.logprobs[rows].tolist(),
        top_ids[rows, :n_top].tolist() if has_top else [[] for _ in range(n)],
        top_lps[rows, :n_top].tolist() if has_top else [[] for _ in range(n)],
    )
