"""Host-side paged-attention metadata shared by backends, plus reusable device buffers.

Everything here is computed from host lists (the `SequenceStep`s of one forward step), so
building it never reads device memory. The functions are pure and run on CPU tensors, which is
how the tests exercise them.

Conventions (FlashInfer's paged layout, `kv_cache.py`):

* A request's KV span is the run of its block-table entries from `first_block` to the block
  holding its last token. With a sliding window, whole blocks that end before the earliest
  key any of the request's queries can see are skipped, so out-of-window entries (the null
  block, once the control plane frees them) never appear. Skipping whole blocks keeps the
  first page aligned: the span's token `j` is position `first_block * block_size + j`, and
  causal and window masks, which only compare positions relative to the span's end, are
  unchanged.
* `kv_len = seq_len - first_block * block_size`; `kv_last_page_len` is in `1..block_size`.
* `qo_indptr` / `kv_indptr` are prefix sums starting at 0; `kv_indices` concatenates the spans.
* A step's requests are split into three parts, each run by its own kernel launch:
  `decode` (one query token; causal and non-causal are identical then), `causal` (prefill
  chunks, multi-token verification) and `noncausal` (DFlash draft blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from specserve.worker.attention.base import SequenceStep
from specserve.worker.kv_cache import NULL_BLOCK


class PartKind(StrEnum):
    DECODE = "decode"
    CAUSAL = "causal"
    NONCAUSAL = "noncausal"


PART_ORDER = (PartKind.DECODE, PartKind.CAUSAL, PartKind.NONCAUSAL)


def part_kind(step: SequenceStep) -> PartKind:
    if step.query_len == 1:
        return PartKind.DECODE
    return PartKind.CAUSAL if step.causal else PartKind.NONCAUSAL


def split_requests(steps: Sequence[SequenceStep]) -> dict[PartKind, list[int]]:
    """Request indices of each part, in batch order; empty parts are left out."""
    parts: dict[PartKind, list[int]] = {kind: [] for kind in PART_ORDER}
    for i, step in enumerate(steps):
        parts[part_kind(step)].append(i)
    return {kind: rows for kind, rows in parts.items() if rows}


def query_starts(steps: Sequence[SequenceStep]) -> list[int]:
    """First flattened token row of each request."""
    starts, total = [], 0
    for step in steps:
        starts.append(total)
        total += step.query_len
    return starts


def first_visible_position(step: SequenceStep, window: int | None) -> int:
    """Earliest key position any query of `step` can see (a key at k is visible to a query at
    p when `k > p - window`)."""
    return 0 if window is None else max(0, step.first_position - window + 1)


@dataclass(frozen=True)
class KVSpan:
    """Where one request's attended keys live in its block table."""

    first_block: int  # table index of the first page passed to the kernel
    num_pages: int
    kv_len: int  # keys covered by those pages (tokens before `first_block` excluded)
    last_page_len: int  # 1..block_size


def kv_span(step: SequenceStep, block_size: int, window: int | None) -> KVSpan:
    total_blocks = -(-step.seq_len // block_size)
    first_block = first_visible_position(step, window) // block_size
    return KVSpan(
        first_block=first_block,
        num_pages=total_blocks - first_block,
        kv_len=step.seq_len - first_block * block_size,
        last_page_len=step.seq_len - (total_blocks - 1) * block_size,
    )


def prefix_sum(lengths: Sequence[int]) -> list[int]:
    out, total = [0], 0
    for n in lengths:
        total += n
        out.append(total)
    return out


def host_slot_mapping(steps: Sequence[SequenceStep], group: int, block_size: int) -> list[int]:
    """Slot (`block * block_size + offset`) of every new token, in flattened batch order."""
    slots: list[int] = []
    for step in steps:
        table = step.block_tables[group]
        for pos in range(step.first_position, step.seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return slots


@dataclass(frozen=True)
class PartMetadata:
    """One kernel launch's batch: CSR page table and the flattened rows it computes.

    All index lists are host lists; `*_tensor` give the CPU int32 tensors FlashInfer's
    `plan()` reads on the host.
    """

    kind: PartKind
    requests: tuple[int, ...]  # request indices of the step, in part order
    qo_lens: tuple[int, ...]  # [n] query tokens per request
    qo_indptr: tuple[int, ...]  # [n + 1], rebased to 0
    kv_indptr: tuple[int, ...]  # [n + 1], rebased to 0 (indexes this part's `kv_indices`)
    kv_indices: tuple[int, ...]  # [kv_indptr[-1]]
    kv_last_page_len: tuple[int, ...]  # [n]
    kv_lens: tuple[int, ...]  # [n] keys per request after the window skip
    rows: tuple[int, ...]  # flattened token rows, in part order
    row_offset: int  # where this part's rows start in the group's concatenated row map
    page_offset: int  # where this part's pages start in the group's concatenated indices

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return self.qo_indptr[-1]

    @property
    def num_pages(self) -> int:
        return self.kv_indptr[-1]

    @property
    def row_range(self) -> tuple[int, int] | None:
        """`(start, stop)` when the rows are one contiguous ascending run, else None."""
        if not self.rows:
            return None
        start, stop = self.rows[0], self.rows[-1] + 1
        return (start, stop) if stop - start == len(self.rows) else None

    def int32(self, name: str) -> torch.Tensor:
        return torch.tensor(getattr(self, name), dtype=torch.int32)


@dataclass(frozen=True)
class GroupHostMetadata:
    """One KV group's host metadata for a step."""

    num_tokens: int
    block_size: int
    sliding_window: int | None
    slot_mapping: tuple[int, ...]  # [T]
    parts: tuple[PartMetadata, ...]  # in `PART_ORDER`, empty parts left out

    def concat(self, name: str) -> list[int]:
        """A per-part field concatenated over parts (group layout of the device buffers)."""
        out: list[int] = []
        for part in self.parts:
            out.extend(getattr(part, name))
        return out


def build_group_host_metadata(
    steps: Sequence[SequenceStep],
    group: int,
    block_size: int,
    sliding_window: int | None,
) -> GroupHostMetadata:
    """Split, page tables and slot mapping of KV group `group` (steps already validated).

    Raises ValueError if a page the kernel would read (an in-window block) is the null block.
    """
    starts = query_starts(steps)
    parts: list[PartMetadata] = []
    row_offset = page_offset = 0
    for kind, requests in split_requests(steps).items():
        indices: list[int] = []
        num_pages: list[int] = []
        last: list[int] = []
        kv_lens: list[int] = []
        rows: list[int] = []
        for r in requests:
            step = steps[r]
            span = kv_span(step, block_size, sliding_window)
            pages = step.block_tables[group][span.first_block : span.first_block + span.num_pages]
            if NULL_BLOCK in pages:
                raise ValueError(
                    f"request {r}, KV group {group}: block table has the null block inside the "
                    f"attended span (blocks {span.first_block}..."
                    f"{span.first_block + span.num_pages - 1})"
                )
            indices.extend(pages)
            num_pages.append(span.num_pages)
            last.append(span.last_page_len)
            kv_lens.append(span.kv_len)
            rows.extend(range(starts[r], starts[r] + step.query_len))
        part = PartMetadata(
            kind=kind,
            requests=tuple(requests),
            qo_lens=tuple(steps[r].query_len for r in requests),
            qo_indptr=tuple(prefix_sum([steps[r].query_len for r in requests])),
            kv_indptr=tuple(prefix_sum(num_pages)),
            kv_indices=tuple(indices),
            kv_last_page_len=tuple(last),
            kv_lens=tuple(kv_lens),
            rows=tuple(rows),
            row_offset=row_offset,
            page_offset=page_offset,
        )
        parts.append(part)
        row_offset += len(rows)
        page_offset += len(indices)
    return GroupHostMetadata(
        num_tokens=sum(s.query_len for s in steps),
        block_size=block_size,
        sliding_window=sliding_window,
        slot_mapping=tuple(host_slot_mapping(steps, group, block_size)),
        parts=tuple(parts),
    )


# --------------------------------------------------------------------------------------------
# Persistent (device) buffers


@dataclass(frozen=True)
class DeviceMetadata:
    """Exact-length views of `PersistentBuffers` for one step (group layout: parts in order).

    `qo_indptr`/`kv_indptr` are global over the group (not rebased per part); part p's
    requests are `[part_request_offset, ...)`. Views never extend past this step's sizes, so no
    entry of an earlier, larger step is visible through them.
    """

    slot_mapping: torch.Tensor  # [T] int64
    rows: torch.Tensor  # [T] int64, the parts' rows concatenated
    kv_indices: torch.Tensor  # [P] int32
    qo_lens: torch.Tensor  # [R] int32
    kv_lens: torch.Tensor  # [R] int32
    qo_indptr: torch.Tensor  # [R + 1] int32, derived on the device
    kv_indptr: torch.Tensor  # [R + 1] int32, derived on the device
    kv_last_page_len: torch.Tensor  # [R] int32, derived on the device


class PersistentBuffers:
    """Preallocated device tensors a step's metadata is copied into, reused across steps.

    Per step, `update` does ONE host-to-device copy (a packed int64 staging tensor: request
    lengths, slot mapping, row map, page indices) and then recomputes every derived buffer on
    the device from data that copy just refreshed: page counts and `kv_indptr` (cumsum of the
    per-request page counts), `qo_indptr` (cumsum of query lengths), `kv_last_page_len`. No
    buffer is left holding an earlier step's numbers, and nothing is read back to the host.

    The copy is `non_blocking` from a freshly built pageable tensor: CUDA stages pageable
    memory before the call returns, so there is no host/device sync and no reuse race.
    Buffers grow (reallocate, doubling) when a step needs more room.

    Owners must not `update` a buffer set while metadata built from its previous views can
    still be launched: views alias the buffers. (The FlashInfer backend leases one set per
    live metadata object.)
    """

    def __init__(
        self,
        device: torch.device | str,
        max_requests: int = 64,
        max_tokens: int = 2048,
        max_pages: int = 4096,
    ) -> None:
        self.device = torch.device(device)
        self.num_updates = 0
        self._allocate(max_requests, max_tokens, max_pages)

    def _allocate(self, max_requests: int, max_tokens: int, max_pages: int) -> None:
        self.max_requests, self.max_tokens, self.max_pages = max_requests, max_tokens, max_pages
        dev = self.device
        self.staging = torch.zeros(
            2 * max_requests + 2 * max_tokens + max_pages, dtype=torch.int64, device=dev
        )
        self.kv_indices = torch.zeros(max_pages, dtype=torch.int32, device=dev)
        self.qo_lens = torch.zeros(max_requests, dtype=torch.int32, device=dev)
        self.kv_lens = torch.zeros(max_requests, dtype=torch.int32, device=dev)
        self.qo_indptr = torch.zeros(max_requests + 1, dtype=torch.int32, device=dev)
        self.kv_indptr = torch.zeros(max_requests + 1, dtype=torch.int32, device=dev)
        self.kv_last_page_len = torch.zeros(max_requests, dtype=torch.int32, device=dev)

    def _ensure(self, requests: int, tokens: int, pages: int) -> None:
        if requests <= self.max_requests and tokens <= self.max_tokens and pages <= self.max_pages:
            return

        def grow(have: int, need: int) -> int:
            while have < need:
                have *= 2
            return have

        self._allocate(
            grow(self.max_requests, requests),
            grow(self.max_tokens, tokens),
            grow(self.max_pages, pages),
        )

    def update(self, host: GroupHostMetadata) -> DeviceMetadata:
        qo_lens = host.concat("qo_lens")
        kv_lens = host.concat("kv_lens")
        rows = host.concat("rows")
        indices = host.concat("kv_indices")
        n_req, n_tok, n_pages = len(kv_lens), host.num_tokens, len(indices)
        self._ensure(n_req, n_tok, n_pages)
        packed = torch.tensor(
            [*qo_lens, *kv_lens, *host.slot_mapping, *rows, *indices], dtype=torch.int64
        )
        stage = self.staging[: packed.numel()]
        stage.copy_(packed, non_blocking=True)
        offsets = prefix_sum([n_req, n_req, n_tok, n_tok, n_pages])
        views = [stage[offsets[i] : offsets[i + 1]] for i in range(5)]
        qo_src, kv_src, slots, row_map, idx_src = views
        self.qo_lens[:n_req].copy_(qo_src)
        self.kv_lens[:n_req].copy_(kv_src)
        self.kv_indices[:n_pages].copy_(idx_src)
        self._recompute_derived(n_req, host.block_size)
        self.num_updates += 1
        return DeviceMetadata(
            slot_mapping=slots,
            rows=row_map,
            kv_indices=self.kv_indices[:n_pages],
            qo_lens=self.qo_lens[:n_req],
            kv_lens=self.kv_lens[:n_req],
            qo_indptr=self.qo_indptr[: n_req + 1],
            kv_indptr=self.kv_indptr[: n_req + 1],
            kv_last_page_len=self.kv_last_page_len[:n_req],
        )

    def _recompute_derived(self, n_req: int, block_size: int) -> None:
        """Device-side: every buffer not copied from the host this step is rebuilt here."""
        kv_lens = self.kv_lens[:n_req]
        num_pages = (kv_lens + (block_size - 1)) // block_size
        self.kv_last_page_len[:n_req].copy_(kv_lens - (num_pages - 1) * block_size)
        self.qo_indptr[:1].zero_()  # slice writes: no host sync
        self.kv_indptr[:1].zero_()
        self.qo_indptr[1 : n_req + 1].copy_(torch.cumsum(self.qo_lens[:n_req], 0))
        self.kv_indptr[1 : n_req + 1].copy_(torch.cumsum(num_pages, 0))
