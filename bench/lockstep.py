"""Several engines timed on the same prompts at the same moments: one step of each in turn.

On a shared 2-core VM the speed of the same engine on the same prompts moves 10-25% between
whole runs a few seconds apart (memory bandwidth the neighbours take, the host's frequency),
which buries the few percent that speculation's upkeep or a policy decision is worth. Stepping
the engines in turn, every engine's step next to every other's (the order reversed every other
turn), puts each engine's steps under the load the others see within ~10 ms of them, so the
drift cancels out of their ratio. Each engine is timed over its own steps only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence

from specserve.control.request import SpecDecodingStats
from specserve.llm import LLM, GenerationOutput
from specserve.shared.protocol import SamplingParams
from specserve.training.evaluate import Generation


def lockstep(
    llms: Mapping[str, LLM], prompts: Sequence[Sequence[int]], max_tokens: int, batch: int
) -> dict[str, Generation]:
    """Generate greedily for `prompts`, `batch` at a time, with every engine, stepping them
    in turn; each engine's seconds are the sum of its own steps."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outputs: dict[str, list[list[int]]] = {name: [] for name in llms}
    stats = {name: SpecDecodingStats() for name in llms}
    seconds = dict.fromkeys(llms, 0.0)
    for first in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[first : first + batch]]
        running: dict[str, Iterator[list[GenerationOutput]]] = {
            name: llm.generate_stepwise(chunk, params) for name, llm in llms.items()
        }
        last: dict[str, list[GenerationOutput]] = {}
        turn = 0
        while running:
            names = list(running) if turn % 2 == 0 else list(running)[::-1]
            for name in names:
                started = time.perf_counter()
                step = next(running[name], None)
                seconds[name] += time.perf_counter() - started
                if step is None:
                    del running[name]
                else:
                    last[name] = step
            turn += 1
        for name, outs in last.items():
            for out in outs:
                outputs[name].append(list(out.token_ids))
                if out.spec_stats is not None:
                    stats[name].merge(out.spec_stats)
    return {name: Generation(outputs[name], stats[name], seconds[name]) for name in llms}
