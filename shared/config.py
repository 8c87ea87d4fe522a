"""Configuration shared by the control plane and the workers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

import msgspec

from specserve.shared.hashing import DEFAULT_HASH_SEED, HASH_ALGORITHMS


class AttentionType(StrEnum):
    FULL = "full"
    SLIDING = "sliding"


class KVGroupSpec(msgspec.Struct, frozen=True):
    """Layers that share one block table: one attention type, one block size."""

    attention: AttentionType
    block_size: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.attention == AttentionType.SLIDING:
            if self.sliding_window is None or self.sliding_window <= 0:
                raise ValueError("a sliding-window KV group needs a positive sliding_window")
        elif self.sliding_window is not None:
            raise ValueError("only sliding-window KV groups take a sliding_window")


class SpecMethod(StrEnum):
    NONE = "none"
    NGRAM = "ngram"
    EAGLE3 = "eagle3"
    DFLASH = "dflash"


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings and what they imply for KV allocation."""

    method: SpecMethod = SpecMethod.NONE
    num_spec_tokens: int = 0
    drafter_max_model_len: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", SpecMethod(self.method))
        if self.method == SpecMethod.NONE:
            if self.num_spec_tokens:
                raise ValueError("num_spec_tokens needs a speculative method")
        elif self.num_spec_tokens <= 0:
            raise ValueError(f"{self.method} needs num_spec_tokens >= 1")

    @property
    def enabled(self) -> bool:
        return self.method != SpecMethod.NONE

    @property
    def lookahead_tokens(self) -> int:
        """KV slots past the scheduled tokens that the drafter writes in the same step.

        EAGLE-3 writes K positions ahead; DFlash writes a block `[next token, MASK x K]`, so K+1.
        Both also apply to the first prefill, where the drafter already runs.
        """
        if self.method == SpecMethod.DFLASH:
            return self.num_spec_tokens + 1
        if self.method == SpecMethod.EAGLE3:
            return self.num_spec_tokens
        return 0

    def admission_lookahead_tokens(self, *, kv_arrives_async: bool) -> int:
        """Lookahead slots for a request's first allocation (seed 001).

        The drafter already runs in the first prefill's step and writes KV past the prompt, so a
        normal first prefill gets the full lookahead. Only a request whose KV arrives from
        elsewhere (prefill/decode disaggregation), with a drafter that needs target hidden states
        it cannot have, may skip it.
        """
        if kv_arrives_async and self.reads_target_hidden_states:
            return 0
        return self.lookahead_tokens

    @property
    def reads_target_hidden_states(self) -> bool:
        """Drafters that read the target's hidden states (EAGLE-3, DFlash)."""
        return self.method in (SpecMethod.EAGLE3, SpecMethod.DFLASH)

    @property
    def drafter_input_slots(self) -> int:
        """Extra drafter query tokens per scheduled request counted against the input budget."""
        return self.num_spec_tokens if self.method == SpecMethod.DFLASH else 0

    @property
    def drafter_window_extra(self) -> int:
        """Positions past `max_seq_len` that one draft round reaches (DFlash adds the bonus)."""
        if not self.enabled:
            return 0
        return self.num_spec_tokens + (1 if self.method == SpecMethod.DFLASH else 0)


@dataclass(frozen=True)
class CacheConfig:
    num_blocks: int
    kv_groups: tuple[KVGroupSpec, ...] = (KVGroupSpec(AttentionType.FULL, 16),)
    enable_prefix_caching: bool = True
    hash_algo: str = "sha256"
    hash_seed: str = DEFAULT_HASH_SEED

    def __post_init__(self) -> None:
        if not self.kv_groups:
            raise ValueError("at least one KV group is needed")
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is the null block)")
        if self.hash_algo not in HASH_ALGORITHMS:
            raise ValueError(f"hash_algo must be one of {HASH_ALGORITHMS}, got {self.hash_algo!r}")

    @property
    def scheduler_block_size(self) -> int:
        """Hybrid hits are aligned to the lcm of the groups' block sizes."""
        return math.lcm(*(g.block_size for g in self.kv_groups))

    @property
    def hash_block_size(self) -> int:
        """Requests are hashed at the gcd of the groups' block sizes; coarser groups view it."""
        return math.gcd(*(g.block_size for g in self.kv_groups))


class SchedulingPolicy(StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", SchedulingPolicy(self.policy))
        if self.max_model_len <= 0 or self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_model_len, max_num_batched_tokens and max_num_seqs must be > 0")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0 disables it)")
        if self.max_num_batched_tokens <= self.spec.drafter_input_slots:
            raise ValueError("max_num_batched_tokens must exceed the drafter's input slots")
