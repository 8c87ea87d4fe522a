"""The Python API: `LLM(model).generate(prompts, params)`, served in-process."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from specserve.control.frontend import Frontend
from specserve.control.request import Request, SpecDecodingStats
from specserve.in_process import EngineArgs, InProcessEngine
from specserve.shared.protocol import SamplingParams, TokenLogprobs

Prompt = str | Sequence[int]


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None  # None when the model has no tokenizer
    finish_reason: str | None
    logprobs: list[TokenLogprobs]
    error: str | None = None
    spec_stats: SpecDecodingStats | None = None
    prompt_logprobs: TokenLogprobs | None = None  # prompt tokens 1.., when asked for


class LLM:
    def __init__(self, model: str = "smollm2-135m", **engine_args) -> None:
        self.engine = InProcessEngine(EngineArgs(model=model, **engine_args))
        self.tokenizer = self.engine.loaded.tokenizer
        self._ids = itertools.count()

    @property
    def spec_stats(self) -> SpecDecodingStats:
        """Speculative-decoding statistics over every request this LLM served."""
        return self.engine.scheduler.spec_stats

    def encode_prompt(self, prompt: Prompt, chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids instead of text")
        return self.tokenizer.encode_prompt(prompt, chat)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (text or token ids), batched together; results in order."""
        *_, outputs = self.generate_stepwise(prompts, params, chat)
        return outputs

    def generate_stepwise(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
    ) -> Iterator[list[GenerationOutput]]:
        """`generate`, one engine step per iteration: yields the outputs so far (in order) after
        each step, final (text decoded) at the last. Lets a caller drive several engines in
        turn, step by step, as `bench/lockstep.py` does to time them under the same load."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        eos = engine.eos_token_ids
        outputs: dict[str, GenerationOutput] = {}
        for prompt, sampling in zip(prompts, params, strict=True):
            token_ids = self.encode_prompt(prompt, chat)
            request_id = f"llm-{next(self._ids)}"
            sampling = Frontend.with_stop_ids(sampling, eos)
            engine.add_request(
                Request(request_id, token_ids, sampling, eos_token_id=eos[0] if eos else None)
            )
            outputs[request_id] = GenerationOutput(request_id, token_ids, [], None, None, [])
        while engine.has_unfinished_requests():
            for update in engine.step():
                out = outputs[update.request_id]
                out.token_ids.extend(update.new_token_ids)
                if update.logprobs is not None:
                    out.logprobs.append(update.logprobs)
                if update.prompt_logprobs is not None:
                    out.prompt_logprobs = update.prompt_logprobs
                if update.finished:
                    out.finish_reason = update.status.finish_reason
                    out.error = update.error
                    out.spec_stats = update.spec_stats
            if engine.has_unfinished_requests():
                yield list(outputs.values())
        if self.tokenizer is not None:
            for out in outputs.values():
                out.text = self.tokenizer.decode(out.token_ids)
        yield list(outputs.values())
