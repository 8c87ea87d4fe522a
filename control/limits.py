"""What one peer may make the control plane spend: the bounds on frames, prompts, requests in
flight and worker registrations (`specserve control --max-...`).

Every check here is cheap (a length, a count, a comparison) and runs before the work it guards:
decoding, range checks, hashing, Redis, or building a scheduler with a Python object per block.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specserve.shared.protocol import (
    MAX_NESTING_DEPTH,
    KeptRequest,
    WorkerInfo,
    check_token_ids,
)
from specserve.shared.socket_limits import DEFAULT_HWM, DEFAULT_MAX_MESSAGE_BYTES

MAX_VOCAB = 1 << 31
MAX_KV_GROUPS = 64  # per registering worker; real models have one or two
MAX_EOS_TOKEN_IDS = 256


@dataclass(frozen=True)
class ServiceLimits:
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # larger inbound frames drop their peer
    max_nesting_depth: int = MAX_NESTING_DEPTH
    max_frame_objects: int = 1 << 22  # MessagePack objects in one inbound frame
    # Also at most each worker's max_model_len - 1; checked before the ids' range, hashing and
    # the index lookup.
    max_prompt_tokens: int = 1 << 20
    max_pending_per_client: int = 1024  # accepted, unfinished requests per client socket
    max_registration_blocks: int = 1 << 18  # KV blocks one worker may claim
    max_registration_seqs: int = 4096  # max_num_seqs one worker may claim
    max_registration_string: int = 256  # characters of a worker's device and spec method
    socket_hwm: int = DEFAULT_HWM  # messages queued per peer and direction

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} must be >= 1, got {getattr(self, f.name)}")
        if self.max_registration_blocks < 2:
            raise ValueError("max_registration_blocks must be >= 2 (block 0 is the null block)")

    def check_worker(self, info: WorkerInfo, model: str) -> None:
        """ValueError naming the first claim of a registering worker that is beyond these
        limits or does not match the served `model`; messages never echo more than a clip of
        what the worker sent."""
        for name in ("device", "spec_method"):
            value = getattr(info, name)
            if len(value) > self.max_registration_string:
                raise ValueError(
                    f"{name} has {len(value)} characters; at most "
                    f"{self.max_registration_string} are allowed"
                )
        if info.model != model:
            raise ValueError(
                f"this control plane serves {model!r}; the worker loaded {clip(info.model)!r}"
            )
        if len(info.kv_groups) > MAX_KV_GROUPS or len(info.eos_token_ids) > MAX_EOS_TOKEN_IDS:
            raise ValueError(
                f"at most {MAX_KV_GROUPS} KV groups and {MAX_EOS_TOKEN_IDS} EOS token ids are "
                f"allowed, got {len(info.kv_groups)} and {len(info.eos_token_ids)}"
            )
        bounds = (
            ("num_blocks", info.num_blocks, 2, self.max_registration_blocks),
            ("max_num_seqs", info.max_num_seqs, 1, self.max_registration_seqs),
            ("vocab_size", info.vocab_size, 1, MAX_VOCAB),
        )
        for name, value, low, high in bounds:
            if not low <= value <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {value}")

    @staticmethod
    def check_kept(kept: list[KeptRequest], info: WorkerInfo) -> None:
        """ValueError naming the first KV claim of a registering worker (`Register.kept`) that
        its own limits rule out: more requests than it runs, tokens beyond its context or
        vocabulary, block tables that do not cover exactly the tokens' full blocks, block ids
        outside its cache or repeated in one table. Runs after `check_worker`."""
        if len(kept) > info.max_num_seqs:
            raise ValueError(f"{len(kept)} kept requests; the worker runs {info.max_num_seqs}")
        for req in kept:
            if len(req.token_ids) > info.max_model_len:
                raise ValueError(
                    f"a kept request has {len(req.token_ids)} tokens; max_model_len is "
                    f"{info.max_model_len}"
                )
            if len(req.block_ids) != len(info.kv_groups):
                raise ValueError(
                    f"a kept request has {len(req.block_ids)} block tables for "
                    f"{len(info.kv_groups)} KV groups"
                )
            check_token_ids(req.token_ids, info.vocab_size, "kept token ids")
            for spec, ids in zip(info.kv_groups, req.block_ids, strict=True):
                if len(ids) != len(req.token_ids) // spec.block_size:
                    raise ValueError(
                        f"a kept request's {len(req.token_ids)} tokens fill "
                        f"{len(req.token_ids) // spec.block_size} blocks; its table has {len(ids)}"
                    )
                if len(set(ids)) != len(ids) or not all(0 < i < info.num_blocks for i in ids):
                    raise ValueError(
                        "a kept block table repeats a block or names one outside "
                        f"[1, {info.num_blocks})"
                    )


def clip(text: str, limit: int = 64) -> str:
    """`text`, cut to `limit` characters with a note of how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"
