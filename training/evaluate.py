"""Acceptance of a drafter through the real serving path (scheduler, runner, verification)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from specserve.control.request import SpecDecodingStats
from specserve.shared.protocol import SamplingParams
from specserve.shared.tokenizer import Tokenizer
from specserve.training.corpus import Chat


@dataclass(frozen=True)
class Generation:
    """Greedy outputs of a set of prompts, with the speculation statistics of those requests."""

    outputs: list[list[int]]
    stats: SpecDecodingStats
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return sum(len(o) for o in self.outputs) / self.seconds if self.seconds else 0.0


def measure(llm, prompts: Sequence[Sequence[int]], max_tokens: int, batch: int) -> Generation:
    """Generate greedily for `prompts` (token ids), `batch` at a time, with `llm` (a
    `specserve.LLM`, speculating or not)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outputs: list[list[int]] = []
    stats = SpecDecodingStats()
    started = time.perf_counter()
    for first in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[first : first + batch]]
        for out in llm.generate(chunk, params):
            outputs.append(list(out.token_ids))
            if out.spec_stats is not None:
                stats.merge(out.spec_stats)
    return Generation(outputs, stats, time.perf_counter() - started)


def first_turn_prompts(
    tokenizer: Tokenizer, chats: Iterable[Chat], count: int, max_prompt_tokens: int
) -> list[list[int]]:
    """The first user turn of each chat as a chat prompt, skipping those longer than
    `max_prompt_tokens`, until `count` are found."""
    prompts: list[list[int]] = []
    for chat in chats:
        if len(prompts) == count:
            break
        text = next(t for role, t in chat.turns if role == "user")
        ids = tokenizer.encode_prompt(text, chat=True)
        if len(ids) <= max_prompt_tokens:
            prompts.append(ids)
    return prompts
