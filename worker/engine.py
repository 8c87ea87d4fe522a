"""One worker's engine: the target model, its drafter, the paged KV cache and the model runner.

It executes step batches and describes itself as a `WorkerInfo`, from which the control plane
builds the scheduler that drives it (in the same process, or over ZeroMQ).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import structlog
import torch

from specserve.shared import protocol
from specserve.shared.config import SpecConfig, SpecMethod
from specserve.worker.attention.flashinfer_backend import FlashInferBackend
from specserve.worker.attention.selection import missing_flashinfer_kernels, select_backend
from specserve.worker.kv_cache import PagedKVCache, bytes_per_block, num_blocks_for_budget
from specserve.worker.memory import keep_freed_memory, kv_budget_bytes
from specserve.worker.model_registry import LoadedModel, load_target, model_dtype
from specserve.worker.model_runner import ModelRunner
from specserve.worker.models import DecoderModel
from specserve.worker.spec_decode.drafter import draft_kv_bytes_per_block
from specserve.worker.spec_decode.speculators import (
    Drafter,
    default_num_spec_tokens,
    drafter_max_model_len,
    load_drafter,
    make_speculator,
    resolve_drafter,
)

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class EngineArgs:
    model: str = "smollm2-135m"
    dtype: str = "auto"  # the checkpoint's own (see model_dtype), or a dtype name
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None  # None: size the KV cache from the memory settings below
    kv_cache_memory_mb: int = 512
    # When set: this fraction of the memory still free after the weights load (worker/memory.py)
    # instead of kv_cache_memory_mb.
    kv_cache_memory_fraction: float | None = None
    max_model_len: int | None = None  # None: the model's maximum
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    spec_method: str = "none"  # none | ngram | eagle3 | dflash
    drafter: str | None = None  # drafter checkpoint dir (eagle3, dflash)
    drafter_dtype: str = "auto"  # `speculators.drafter_dtype`, or a dtype name
    num_spec_tokens: int = 0
    drafter_max_model_len: int | None = None  # None: the drafter checkpoint's limit
    # auto: FlashInfer where it can run, else torch; or torch, flashinfer
    attention_backend: str = "auto"
    sample_drafts: bool = False  # sample drafts (verified with their probabilities), not argmax
    # adaptive: verify per step the drafts that pay at this batch size (spec_decode/policy.py);
    # fixed: always K
    spec_policy: str = "adaptive"


class WorkerEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        method = SpecMethod(args.spec_method)
        drafter_path = resolve_drafter(method, args.model, args.drafter)
        num_spec = args.num_spec_tokens or default_num_spec_tokens(method, drafter_path)
        args = replace(args, drafter=drafter_path, num_spec_tokens=num_spec)
        self.args = args
        SpecConfig(method, args.num_spec_tokens)  # validate before loading anything
        if torch.device(args.device).type == "cpu":
            keep_freed_memory()
        if loaded is None:
            dtype = model_dtype(args.model, args.dtype, args.device)
            backend = select_backend(args.attention_backend, args.device, dtype)
            loaded = load_target(args.model, dtype, args.device, backend)
        self.loaded = loaded
        model = loaded.model
        config = model.config
        max_model_len = args.max_model_len or config.max_position_embeddings
        if max_model_len > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's maximum "
                f"{config.max_position_embeddings}"
            )
        self.max_model_len = max_model_len
        drafter = load_drafter(method, args.drafter, model, args.drafter_dtype)
        if isinstance(model.backend, FlashInferBackend):
            if drafter is not None and drafter.dtype != model.dtype:
                raise ValueError(
                    f"--drafter-dtype {args.drafter_dtype} gives a {drafter.dtype} drafter beside "
                    f"a {model.dtype} target; with FlashInfer attention both run in one dtype"
                )
            head_dims = {config.head_dim} | ({drafter.config.layer.head_dim} if drafter else set())
            reason = missing_flashinfer_kernels(head_dims, model.dtype, args.device)
            if reason is not None:  # a setting the user can fix: a clear error, no traceback
                raise ValueError(reason)
        self.num_blocks = args.num_blocks or self._blocks_for_budget(model, drafter)
        kv_cache = PagedKVCache(
            config.kv_groups, self.num_blocks, args.block_size, config.num_kv_heads,
            config.head_dim, model.dtype, args.device,
        )  # fmt: skip
        self.drafter_max_model_len = None
        if method != SpecMethod.NONE:
            self.drafter_max_model_len = drafter_max_model_len(
                drafter, args.drafter_max_model_len, max_model_len
            )
        speculator = make_speculator(
            method, args.num_spec_tokens, drafter, model, self.num_blocks, args.block_size,
            self.drafter_max_model_len, args.device, args.sample_drafts,
        )  # fmt: skip
        if args.spec_policy not in ("adaptive", "fixed"):
            raise ValueError(f"spec_policy must be adaptive or fixed, got {args.spec_policy!r}")
        self.runner = ModelRunner(
            model, kv_cache, args.device, speculator, args.spec_policy == "adaptive"
        )
        log.info(
            "engine.ready",
            model=loaded.name,
            device=str(args.device),
            attention="flashinfer" if isinstance(model.backend, FlashInferBackend) else "torch",
            kv_blocks=self.num_blocks,
            block_size=args.block_size,
            max_model_len=max_model_len,
            spec_method=method.value,
            num_spec_tokens=args.num_spec_tokens,
            spec_policy=args.spec_policy if method != SpecMethod.NONE else None,
        )

    def _blocks_for_budget(self, model: DecoderModel, drafter: Drafter | None) -> int:
        """Blocks that fit the KV budget, counting the drafter's layers (same block ids)."""
        config, bs = model.config, self.args.block_size
        per_block = bytes_per_block(
            config.num_layers, bs, config.num_kv_heads, config.head_dim, model.dtype
        )
        if drafter is not None:
            per_block += draft_kv_bytes_per_block(drafter.config.layer, bs, drafter.dtype)
        fraction = self.args.kv_cache_memory_fraction
        if fraction is None:
            budget = self.args.kv_cache_memory_mb << 20
        else:
            budget = kv_budget_bytes(self.args.device, fraction)
            log.info("engine.kv_budget", fraction=fraction, megabytes=budget >> 20)
        return num_blocks_for_budget(budget, per_block)

    @property
    def vocab_size(self) -> int:
        return self.loaded.model.config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        tokenizer = self.loaded.tokenizer
        return tokenizer.eos_token_ids if tokenizer else self.loaded.model.config.eos_token_ids

    def info(self, worker_id: str) -> protocol.WorkerInfo:
        args = self.args
        return protocol.WorkerInfo(
            worker_id=worker_id,
            model=self.loaded.name,
            device=args.device,
            kv_groups=list(self.loaded.model.config.kv_group_specs(args.block_size)),
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=args.enable_prefix_caching,
            spec_method=args.spec_method,
            num_spec_tokens=args.num_spec_tokens,
            drafter_max_model_len=self.drafter_max_model_len,
            pid=os.getpid(),
        )

    @torch.inference_mode()
    def execute(self, batch: protocol.StepBatch) -> protocol.StepResult:
        return self.runner.execute(batch)

    def kept_requests(self) -> list[protocol.KeptRequest]:
        """The KV of the requests held now, for the next control plane to adopt (none without
        prefix caching: that plane could not reuse it)."""
        if not self.args.enable_prefix_caching:
            return []
        return self.runner.kept_requests()

    def forget(self, handles: list[int]) -> None:
        """Drop these requests' state (their step failed; it may be half updated)."""
        self.runner.drop(handles)

    def reset(self) -> None:
        """Forget every request (a new control-plane session starts from an empty block pool)."""
        self.runner.drop_all()
