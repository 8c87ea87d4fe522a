"""Run the choices of one HTTP request (every prompt times `n`) through the asyncio SDK, and
merge their outputs into one stream of `(choice index, output)`.

The choices of one prompt share its KV blocks through the prefix cache: the first is sent
alone, and the others once its first output shows that its prompt has been computed (and its
full blocks cached), so they are admitted as prefix-cache hits instead of prefilling it again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import msgspec

from specserve.client import AsyncClient, Prompt
from specserve.shared.protocol import RequestOutput, SamplingParams


@dataclass(frozen=True)
class Choice:
    index: int
    prompt: Prompt
    sampling: SamplingParams
    request_id: str


def plan_choices(
    request_id: str, prompts: Sequence[Prompt], n: int, sampling: SamplingParams
) -> list[list[Choice]]:
    """For each prompt its `n` choices (index `prompt * n + i`); a seeded request gives choice
    `i` the seed `seed + i`, so the choices differ and each is reproducible."""
    groups = []
    for p, prompt in enumerate(prompts):
        group = []
        for i in range(n):
            seeded = sampling
            if sampling.seed is not None and i:
                seeded = msgspec.structs.replace(sampling, seed=(sampling.seed + i) % 2**63)
            index = p * n + i
            group.append(Choice(index, prompt, seeded, f"{request_id}-{index}"))
        groups.append(group)
    return groups


_DONE = object()


def run_choices(
    client: AsyncClient, groups: list[list[Choice]], timeout: float | None
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every output of every choice as it arrives. An error of any choice ends the whole
    iteration with that error; leaving early (or an error) aborts the choices still running."""
    if len(groups) == 1 and len(groups[0]) == 1:
        return _one_choice(client, groups[0][0], timeout)
    return _merged(client, groups, timeout)


def _open(
    client: AsyncClient, choice: Choice, timeout: float | None
) -> AsyncIterator[RequestOutput]:
    return client.stream(
        choice.prompt, choice.sampling, request_id=choice.request_id, timeout=timeout
    )


async def _one_choice(
    client: AsyncClient, choice: Choice, timeout: float | None
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The common case, read straight from the SDK's stream: no task or queue in between, so
    each streamed token costs one task switch less."""
    async with contextlib.aclosing(_open(client, choice, timeout)) as outputs:
        async for output in outputs:
            yield choice.index, output


async def _merged(
    client: AsyncClient, groups: list[list[Choice]], timeout: float | None
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Several choices: a task per choice, their outputs merged through one queue."""
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | object] = asyncio.Queue()

    async def one(choice: Choice, started: asyncio.Event | None) -> None:
        async with contextlib.aclosing(_open(client, choice, timeout)) as outputs:
            async for output in outputs:
                if started is not None:
                    started.set()
                await queue.put((choice.index, output))

    async def group_task(group: list[Choice]) -> None:
        try:
            started = asyncio.Event()
            first = asyncio.ensure_future(one(group[0], started))
            rest: list[asyncio.Future[None]] = []
            try:
                if len(group) > 1:
                    waiter = asyncio.ensure_future(started.wait())
                    await asyncio.wait({first, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    if first.done() and first.exception() is not None:
                        raise first.exception()  # type: ignore[misc]
                    rest = [asyncio.ensure_future(one(c, None)) for c in group[1:]]
                await asyncio.gather(first, *rest)
            finally:  # each task is cancelled once: a second cancel would cut its abort short
                for task in (first, *rest):
                    if not task.done() and not task.cancelling():
                        task.cancel()
                await asyncio.gather(first, *rest, return_exceptions=True)
        except BaseException as exc:  # passed on to the consumer
            await queue.put(exc)
        finally:
            await queue.put(_DONE)

    tasks = [asyncio.ensure_future(group_task(g)) for g in groups]
    running = len(tasks)
    try:
        while running:
            item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, BaseException):
                if isinstance(item, asyncio.CancelledError):
                    continue
                raise item
            else:
                yield item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
