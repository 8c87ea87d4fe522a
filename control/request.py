"""The scheduler's view of one request."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from specserve.shared.hashing import BlockHash
from specserve.shared.protocol import SamplingParams, TokenLogprobs


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS or a stop token
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The client-facing reason: stop, length, abort or error (None while unfinished)."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_counts[a]: draft rounds that accepted exactly `a` drafts. A histogram keeps
    # `observe` O(1) on the per-request hot path; per-position rates are derived from it.
    accepted_counts: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        counts = self.accepted_counts
        if len(counts) <= num_draft_tokens:
            counts.extend([0] * (num_draft_tokens + 1 - len(counts)))
        counts[num_accepted] += 1

    def merge(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        counts = self.accepted_counts
        if len(counts) < len(other.accepted_counts):
            counts.extend([0] * (len(other.accepted_counts) - len(counts)))
        for a, n in enumerate(other.accepted_counts):
            counts[a] += n

    @property
    def accepted_per_position(self) -> list[int]:
        """Draft rounds whose draft at position i was accepted (every draft before it was too)."""
        out, total = [], 0
        for n in reversed(self.accepted_counts[1:]):
            total += n
            out.append(total)
        return out[::-1]

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted/drafts: tokens emitted per draft round, the bonus token included."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [n / self.num_drafts for n in self.accepted_per_position] if self.num_drafts else []


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0  # lower runs first under the priority policy
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(init=False)
    spec_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_preemptions: int = 0
    handle: int = -1  # the integer id the worker knows this request by
    spec_stats: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    prefix_stats_recorded: bool = False
    # Prompt logprobs received from the worker, for prompt tokens 1, 2, ... (when asked for);
    # sent with the first output tokens
    prompt_logprobs: TokenLogprobs | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs that are not all in: its prompt is computed, not cached."""
        if self.sampling.prompt_logprobs is None:
            return False
        have = 0 if self.prompt_logprobs is None else len(self.prompt_logprobs.chosen)
        return have < self.num_prompt_tokens - 1

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]
