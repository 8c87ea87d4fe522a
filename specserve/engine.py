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
from specserve.shared.config import CacheConfig, SchedulerConfig
from specserve.worker.kv_cache import PagedKVCache
from specserve.worker.model_registry import LoadedModel, load_target
from specserve.worker.model_runner import ModelRunner

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


class InProcessEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        self.args = args
        self.loaded = loaded or load_target(args.model, args.dtype, args.device)
        model = self.loaded.model
        config = model.config
        dtype = model.dtype
        groups = config.kv_groups
        if args.num_blocks is not None:
            kv_cache = PagedKVCache(
                groups, args.num_blocks, args.block_size, config.num_kv_heads,
                config.head_dim, dtype, args.device,
            )  # fmt: skip
        else:
            kv_cache = PagedKVCache.from_budget(
                groups, args.kv_cache_memory_mb << 20, args.block_size, config.num_kv_heads,
                config.head_dim, dtype, args.device,
            )  # fmt: skip
        max_model_len = args.max_model_len or config.max_position_embeddings
        if max_model_len > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's maximum "
                f"{config.max_position_embeddings}"
            )
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
            ),
            CacheConfig(
                num_blocks=kv_cache.num_blocks,
                kv_groups=config.kv_group_specs(args.block_size),
                enable_prefix_caching=args.enable_prefix_caching,
            ),
        )
        self.runner = ModelRunner(model, kv_cache, args.device)
        log.info(
            "engine.ready",
            model=self.loaded.name,
            kv_blocks=kv_cache.num_blocks,
            block_size=args.block_size,
            max_model_len=max_model_len,
        )

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
