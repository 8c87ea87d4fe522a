"""Prompt-lookup (n-gram) drafting: propose the tokens that followed an earlier copy of the suffix.

No weights and no KV: the drafts are copied from the request's own tokens, so they are
deterministic (verify them with one-hot `q`, i.e. `draft_probs=None`). The longest matching
suffix n-gram wins (a longer match is stronger evidence the text is repeating), and among its
earlier occurrences the most recent one is used: recent context best predicts what comes next
(e.g. the latest edit of a repeatedly rewritten line), and it is what an incremental index gets
by overwriting. Proposals stop at the end of the sequence, so a match just before the suffix
may propose fewer than `k` tokens.

`NgramProposer` keeps a per-request index updated as tokens arrive, so each proposal costs
O(max_n) instead of a scan of the whole sequence.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def _check(k: int, min_n: int, max_n: int) -> None:
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")


class NgramIndex:
    """One sequence's n-gram index: each n-gram (min_n..max_n) maps to its latest end position.

    Only n-grams ending before the last token are indexed, so a lookup of the suffix finds an
    earlier copy and never the suffix itself.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        _check(0, min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens, indexing the n-grams that now end before the last token."""
        start = max(len(self.tokens) - 1, 0)
        self.tokens.extend(int(t) for t in token_ids)
        for end in range(start, len(self.tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._last_end[tuple(self.tokens[end - n + 1 : end + 1])] = end

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the most recent earlier copy of the longest suffix
        n-gram (n from `max_n` down to `min_n`); empty when nothing matches."""
        _check(k, self.min_n, self.max_n)
        length = len(self.tokens)
        if k == 0 or length < 2:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self._last_end.get(tuple(self.tokens[length - n :]))
            if end is not None:
                return self.tokens[end + 1 : end + 1 + k]
        return []


class NgramProposer:
    """Per-request n-gram indexes: add a request, feed it its new tokens, ask for drafts."""

    def __init__(self, k: int, min_n: int = 1, max_n: int = 4) -> None:
        _check(k, min_n, max_n)
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.indexes: dict[Hashable, NgramIndex] = {}

    def add_request(self, request: Hashable, token_ids: Sequence[int]) -> None:
        """Start (or restart, e.g. after preemption) a request from its full token list."""
        index = NgramIndex(self.min_n, self.max_n)
        index.extend(token_ids)
        self.indexes[request] = index

    def extend(self, request: Hashable, new_token_ids: Sequence[int]) -> None:
        self.indexes[request].extend(new_token_ids)

    def propose(self, request: Hashable) -> list[int]:
        return self.indexes[request].propose(self.k)

    def remove(self, request: Hashable) -> None:
        self.indexes.pop(request, None)

    def __contains__(self, request: Hashable) -> bool:
        return request in self.indexes
