"""Applies step batches to persistent per-request state and runs one forward pass per step.

The worker keeps each request's tokens, block tables and sampling generator between steps; a
step batch only says what changed. Tokens a request needs this step are its known tokens from
`num_computed_tokens` on (a prefill chunk, or the newest sampled token in decode).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    NewRequest,
    RequestResult,
    SamplingParams,
    StepBatch,
    StepResult,
    TokenLogprobs,
)
from specserve.worker.attention.base import SequenceStep
from specserve.worker.kv_cache import PagedKVCache
from specserve.worker.models import DecoderModel
from specserve.worker.sampler import SamplerOutput, make_generator, sample


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
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Scheduled:
    state: RequestState
    num_tokens: int  # scheduled this step, drafts included
    num_spec: int  # drafts to verify


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_cache: PagedKVCache, device: torch.device | str):
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.config = model.config
        self.requests: dict[int, RequestState] = {}

    def execute(self, batch: StepBatch) -> StepResult:
        """Run one step. A request with bad input fails alone; the rest of the batch runs."""
        for handle in (*batch.preempted, *batch.finished):
            self.requests.pop(handle, None)
        failed: list[RequestResult] = []
        scheduled: list[_Scheduled] = []
        for new in batch.new_requests:
            try:
                scheduled.append(_Scheduled(self._add_request(new), new.num_scheduled_tokens, 0))
            except ValueError as exc:
                failed.append(RequestResult(new.handle, [], error=str(exc)))
        for delta in batch.running:
            state = self.requests.get(delta.handle)
            if state is None:
                failed.append(
                    RequestResult(delta.handle, [], error=f"unknown request handle {delta.handle}")
                )
                continue
            if delta.new_block_ids:
                for table, new_ids in zip(state.block_tables, delta.new_block_ids, strict=True):
                    table.extend(new_ids)
            state.num_computed_tokens = delta.num_computed_tokens
            if delta.num_spec_tokens:
                self.requests.pop(delta.handle)
                failed.append(
                    RequestResult(delta.handle, [], error="this worker has no drafter to verify")
                )
                continue
            scheduled.append(_Scheduled(state, delta.num_scheduled_tokens, 0))
        results = self._run(scheduled) if scheduled else []
        return StepResult(PROTOCOL_VERSION, batch.step_id, results + failed)

    def _add_request(self, new: NewRequest) -> RequestState:
        vocab = self.config.vocab_size
        bad = [t for t in new.token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (size {vocab})")
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
        )
        self.requests[new.handle] = state
        return state

    def _run(self, scheduled: Sequence[_Scheduled]) -> list[RequestResult]:
        input_ids: list[int] = []
        positions: list[int] = []
        steps: list[SequenceStep] = []
        sample_rows: list[int] = []
        sampling_requests: list[RequestState] = []
        for item in scheduled:
            state, n = item.state, item.num_tokens
            start = state.num_computed_tokens
            tokens = state.token_ids[start : start + n]
            if len(tokens) != n:
                raise ValueError(
                    f"request {state.request_id}: {n} tokens scheduled from position {start} "
                    f"but only {len(state.token_ids)} are known"
                )
            row0 = len(input_ids)
            input_ids.extend(tokens)
            positions.extend(range(start, start + n))
            steps.append(SequenceStep(n, start + n, state.block_tables))
            if start + n == len(state.token_ids):  # the prompt (or decode) is done: sample
                sample_rows.append(row0 + n - 1)
                sampling_requests.append(state)

        metadata = self.model.backend.build_metadata(
            steps, self.config.kv_groups, self.kv_cache.block_size, self.device
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, pos, metadata, self.kv_cache)
        for item in scheduled:
            item.state.num_computed_tokens += item.num_tokens

        sampled: dict[int, tuple[int, TokenLogprobs | None]] = {}
        if sample_rows:
            rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
            logits = self.model.compute_logits(hidden[rows])
            out = sample(
                logits,
                [s.sampling for s in sampling_requests],
                [s.generator for s in sampling_requests],
            )
            token_ids = out.token_ids.tolist()
            for i, state in enumerate(sampling_requests):
                state.token_ids.append(token_ids[i])
                sampled[state.handle] = (token_ids[i], _row_logprobs(out, i, state.sampling))
        results = []
        for item in scheduled:
            handle = item.state.handle
            if handle in sampled:
                token, logprobs = sampled[handle]
                results.append(RequestResult(handle, [token], logprobs=logprobs))
            else:
                results.append(RequestResult(handle, []))
        return results


def _row_logprobs(out: SamplerOutput, row: int, sampling: SamplingParams) -> TokenLogprobs | None:
    if sampling.logprobs is None or out.logprobs is None:
        return None
    k = sampling.logprobs
    top_ids: list[int] = []
    top_lps: list[float] = []
    if k and out.top_token_ids is not None and out.top_logprobs is not None:
        top_ids = out.top_token_ids[row, :k].tolist()
        top_lps = out.top_logprobs[row, :k].tolist()
    return TokenLogprobs([float(out.logprobs[row])], [top_ids], [top_lps])
