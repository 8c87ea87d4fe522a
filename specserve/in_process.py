"""In-process serving: the control plane's scheduler and one worker's engine in one process.

They exchange exactly the msgspec frames a remote worker would receive and send, and the
scheduler is built from the worker's `WorkerInfo` as the control plane builds it, so this path
exercises the wire contract too.
"""

from __future__ import annotations

from specserve.control.request import Request
from specserve.control.scheduler import RequestUpdate, Scheduler
from specserve.shared import protocol
from specserve.worker.engine import EngineArgs, WorkerEngine
from specserve.worker.model_registry import LoadedModel

__all__ = ["EngineArgs", "InProcessEngine"]


class InProcessEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        self.args = args
        self.worker = WorkerEngine(args, loaded)
        self.loaded = self.worker.loaded
        self.runner = self.worker.runner
        self.max_model_len = self.worker.max_model_len
        self.scheduler = Scheduler.for_worker(self.worker.info("local"))

    @property
    def vocab_size(self) -> int:
        return self.worker.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.worker.eos_token_ids

    def add_request(self, request: Request) -> None:
        """The in-process entry point, so the one place an in-process request is validated."""
        request.sampling.validate(self.vocab_size)
        protocol.check_token_ids(request.prompt_token_ids, self.vocab_size, "prompt token ids")
        self.scheduler.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def step(self) -> list[RequestUpdate]:
        scheduled = self.scheduler.schedule()
        early = self.scheduler.take_early_updates()
        batch = scheduled.batch
        if not (scheduled.num_scheduled_tokens or batch.finished or batch.preempted):
            return early
        batch = protocol.decode(protocol.encode(batch))
        assert isinstance(batch, protocol.StepBatch)
        result = protocol.decode(protocol.encode(self.worker.execute(batch)))
        assert isinstance(result, protocol.StepResult)
        return early + self.scheduler.update_from_output(scheduled, result)
