"""In-process serving: the control plane's scheduler and one worker's runner in one process.

They exchange exactly the msgspec frames a remote worker would receive and send, so this path
exercises the wire contract too.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from specserve.control.request import Request
from specserve.control.scheduler import RequestUpdate, Scheduler
from specserve.shared import protocol
from specserve.shared.config import CacheConfig, SchedulerConfig, SpecConfig, SpecMethod
from specserve.worker.attention.selection import select_backend
from specserve.worker.drafters import draft_kv_bytes_per_block
from specserve.worker.kv_cache import PagedKVCache, bytes_per_block, num_blocks_for_budget
from specserve.worker.loader import resolve_dtype
from specserve.worker.model_registry import LoadedModel, load_target
from specserve.worker.model_runner import ModelRunner
from specserve.worker.models import DecoderModel
from specserve.worker.speculators import (
    Drafter,
    drafter_max_model_len,
    load_drafter,
    make_speculator,
)

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class EngineArgs:
    model: str = "smollm2-135m"
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None  # None: size the KV cache from kv_cache_memory_mb
    kv_cache_memory_mb: int = 512
    max_model_len: int | None = None  # None: the model's maximum
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    spec_method: str = "none"  # none | ngram | eagle3 | dflash
    drafter: str | None = None  # drafter checkpoint dir (eagle3, dflash)
    num_spec_tokens: int = 0
    drafter_max_model_len: int | None = None  # None: the drafter checkpoint's limit
    attention_backend: str = "torch"  # torch | flashinfer | auto (FlashInfer where it can run)
    sample_drafts: bool = False  # sample drafts (verified with their probabilities), not argmax


class InProcessEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        self.args = args
        method = SpecMethod(args.spec_method)
        SpecConfig(method, args.num_spec_tokens)  # validate before loading anything
        if loaded is None:
            backend = select_backend(args.attention_backend, args.device, resolve_dtype(args.dtype))
            loaded = load_target(args.model, args.dtype, args.device, backend)
        self.loaded = loaded
        model = self.loaded.model
        config = model.config
        max_model_len = args.max_model_len or config.max_position_embeddings
        if max_model_len > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's maximum "
                f"{config.max_position_embeddings}"
            )
        self.max_model_len = max_model_len
        drafter = load_drafter(method, args.drafter, model)
        num_blocks = args.num_blocks or self._blocks_for_budget(model, drafter)
        kv_cache = PagedKVCache(
            config.kv_groups, num_blocks, args.block_size, config.num_kv_heads,
            config.head_dim, model.dtype, args.device,
        )  # fmt: skip
        draft_len = None
        if method != SpecMethod.NONE:
            draft_len = drafter_max_model_len(drafter, args.drafter_max_model_len, max_model_len)
        spec = SpecConfig(method, args.num_spec_tokens, draft_len)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
                spec=spec,
            ),
            CacheConfig(
                num_blocks=num_blocks,
                kv_groups=config.kv_group_specs(args.block_size),
                enable_prefix_caching=args.enable_prefix_caching,
            ),
        )
        speculator = make_speculator(
            method, args.num_spec_tokens, drafter, model, num_blocks, args.block_size,
            draft_len, args.device, args.sample_drafts,
        )  # fmt: skip
        self.runner = ModelRunner(model, kv_cache, args.device, speculator)
        log.info(
            "engine.ready",
            model=self.loaded.name,
            kv_blocks=num_blocks,
            block_size=args.block_size,
            max_model_len=max_model_len,
            spec_method=method.value,
            num_spec_tokens=args.num_spec_tokens,
        )

    def _blocks_for_budget(self, model: DecoderModel, drafter: Drafter | None) -> int:
        """Blocks that fit the KV budget, counting the drafter's layers (same block ids)."""
        config, bs = model.config, self.args.block_size
        per_block = bytes_per_block(
            config.num_layers, bs, config.num_kv_heads, config.head_dim, model.dtype
        )
        if drafter is not None:
            per_block += draft_kv_bytes_per_block(drafter.config.layer, bs, drafter.dtype)
        return num_blocks_for_budget(self.args.kv_cache_memory_mb << 20, per_block)

    @property
    def vocab_size(self) -> int:
        return self.loaded.model.config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        tokenizer = self.loaded.tokenizer
        return tokenizer.eos_token_ids if tokenizer else self.loaded.model.config.eos_token_ids

    def add_request(self, request: Request) -> None:
        request.sampling.validate(self.vocab_size)
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})"
            )
        self.scheduler.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    @torch.inference_mode()
    def step(self) -> list[RequestUpdate]:
        scheduled = self.scheduler.schedule()
        batch = scheduled.batch
        if not (scheduled.num_scheduled_tokens or batch.finished or batch.preempted):
            return []
        batch = protocol.decode(protocol.encode(batch))
        assert isinstance(batch, protocol.StepBatch)
        result = protocol.decode(protocol.encode(self.runner.execute(batch)))
        assert isinstance(result, protocol.StepResult)
        return self.scheduler.update_from_output(scheduled, result)
