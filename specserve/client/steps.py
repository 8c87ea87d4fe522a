"""The two things a client call asks of its socket, and the loop that carries a call out.

Each call is written once, in `ClientCore`, as a generator that yields the I/O it needs: `Send` a
frame, or `Wait` for news of a request. `Client` carries those steps out by polling its socket in
the calling thread, `AsyncClient` by awaiting what its receive task files; that is all the two
clients differ in. An exception raised while carrying out a step (an interrupt, a cancellation) is
thrown back into the call at the step, so the call's own `try` blocks clean up after it.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Send:
    """Put one frame on the socket."""

    frame: bytes


@dataclass(frozen=True, slots=True)
class Wait:
    """Let replies arrive until there is news of `request_id` (a reply for it, or its tombstone
    cleared) or the client's clock reaches `until` (None: no limit). The call checks again after
    every wait, so waking early is harmless."""

    request_id: str
    until: float | None


Step = Send | Wait
Steps = Generator[Step, None, T]


class Run(Generic[T]):
    """One call being carried out: iterating gives its next step; `fail` hands the call what a
    step raised (it is thrown in at that step); `value` is what the call returned."""

    value: T

    def __init__(self, steps: Steps[T]) -> None:
        self._steps = steps
        self._error: BaseException | None = None

    def __iter__(self) -> Iterator[Step]:
        return self

    def __next__(self) -> Step:
        error, self._error = self._error, None
        try:
            return self._steps.send(None) if error is None else self._steps.throw(error)
        except StopIteration as stop:
            self.value = stop.value
            raise

    def fail(self, error: BaseException) -> None:
        self._error = error
