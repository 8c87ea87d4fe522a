"""A progress bar for long training work: count, rate, ETA, and the latest loss and tokens/s."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    """tqdm on stderr, plus a tokens/s figure over the whole run and free-form fields."""

    def __init__(self, what: str, total: int, unit: str, initial: int = 0) -> None:
        self.bar = tqdm(
            total=total,
            initial=initial,
            desc=what,
            unit=f" {unit}",
            file=sys.stderr,
            dynamic_ncols=True,
            smoothing=0.1,
        )
        self.started = time.perf_counter()
        self.tokens = 0

    def update(self, n: int = 1, tokens: int = 0, **fields: float | int | str) -> None:
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        shown = {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in fields.items()}
        if self.tokens:
            shown["tok/s"] = f"{self.tokens / elapsed:.0f}"
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(n)

    def set_total(self, total: int) -> None:
        self.bar.total = total
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
