"""Pure-PyTorch attention over the paged KV cache (CPU and CUDA).

Requests are split into two padded batches, single-token queries (decode) and short query
blocks (verification and draft blocks), plus one call per long query (a prompt chunk of at
least `LONG_QUERY_ROWS` rows). Each padded batch gathers its requests' K and V pages from the
cache (a block's K is one contiguous row of the cache, so the copy moves whole pages) and runs
one `scaled_dot_product_attention` call with an explicit mask. A prompt chunk is attended on
its own: padded beside the step's longest prompt it would cost that prompt's square (a step of
16 ShareGPT prompts took 7.7x the attention time padded), and a chunk that starts its prompt
runs SDPA's causal kernel, which skips the keys above the diagonal, with no mask at all.

On CPU, the decode batch instead goes to `cpu_ops.paged_decode_attention` when it can be
built: it reads each request's pages where they lie, so a step no longer copies every
request's context per layer (1.4-2.5x less attention time at 16 requests of 0.5-2k tokens;
docs/benchmarks.md). Every multi-row query (prompt chunks, verification and draft blocks)
goes to `cpu_ops.paged_prefill_attention` in one call per layer, which also reads the pages
where they lie; the SDPA batches for them are built only where that kernel cannot run the
layer (its dtype or head dim), on first use. A CPU step whose requests all bring short causal
blocks (speculative verification) is instead laid out as decode rows, one per token
(`token_rows`), so that it runs as a decode step: a verification block of 4 tokens then costs
about 1.15x a one-token decode step at batch 1 instead of 1.95x (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.worker.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    GroupAttentionMetadata,
    SequenceStep,
    block_table_tensor,
    once_per_step,
    slot_mapping,
    validate_steps,
)
from specserve.worker.attention.metadata import host_slot_mapping, kv_span, query_starts
from specserve.worker.cpu import kernels as cpu_kernels
from specserve.worker.cpu import ops as cpu_ops
from specserve.worker.model_config import KVLayerGroup

# A query of this many rows or more is a prompt chunk, attended on its own (one SDPA call per
# layer costs about 0.1 ms, small beside the chunk's own attention); shorter multi-row queries
# (verification and draft blocks) share one padded batch.
LONG_QUERY_ROWS = 32
# On CPU, a step whose requests all bring causal blocks of at most this many tokens (decodes and
# verification) runs as decode rows, one per token (`token_rows`).
TOKEN_ROW_BLOCK = 16


@dataclass(frozen=True)
class PaddedBatch:
    """Requests padded to `[B, Q]` queries and `[B, L]` keys (`L = P * block_size` for P
    pages) for one SDPA call.

    `whole` marks a batch that is the entire step with no padding (every request has Q query
    rows, in order): a decode-only step, or one prefill. Its queries are the step's rows as
    they are, so `forward` skips the gather of queries and the scatter of outputs.
    """

    query_index: torch.Tensor  # [B, Q] rows of the flattened batch (padding points at row 0)
    k_pages: torch.Tensor  # [B * P] K page of each gathered block (cache viewed as pages)
    v_pages: torch.Tensor  # [B * P] V page of each gathered block (the K page + 1)
    mask: torch.Tensor  # [B, 1, Q, L] bool, True where the query attends to the key
    first_key_pos: torch.Tensor  # [B] position of each request's first gathered key
    seq_lens: torch.Tensor  # [B] keys below this position exist
    out_rows: torch.Tensor  # [N] rows of the flattened batch that this batch computes
    out_select: torch.Tensor  # [N] their index into the flattened `[B * Q]` output
    whole: bool

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        return _additive_mask(self, self.mask, dtype)


@dataclass(frozen=True)
class LongQuery:
    """One request's prompt chunk: rows `start .. start + length` of the step, attending to the
    `num_keys` keys of its `kv_span`, gathered from `k_pages` and `v_pages`.

    `mask` is None when no key needs hiding beyond what `is_causal` hides: a chunk that starts
    its prompt (queries and keys are the same positions) or a draft block that sees them all.
    """

    start: int
    length: int
    k_pages: torch.Tensor  # [P]
    v_pages: torch.Tensor  # [P]
    num_keys: int
    mask: torch.Tensor | None  # [Q, num_keys] bool, True where the query attends to the key
    is_causal: bool

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        return None if self.mask is None else _additive_mask(self, self.mask, dtype)


def _additive_mask(owner: object, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`mask` as 0 / -inf in the model's dtype, once per step for `owner`: SDPA's CPU kernel
    takes it faster than a boolean mask, which it would convert in every layer."""

    def build() -> torch.Tensor:
        zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return zeros.masked_fill_(~mask, float("-inf"))

    return once_per_step(owner, ("additive_mask", dtype), build)


@dataclass(frozen=True)
class MultiRowQueries:
    """A step's multi-row queries as `cpu_ops.paged_prefill_attention` takes them, and how to
    build their SDPA batches instead (`sdpa()`, once) for a layer the kernel cannot run."""

    table: torch.Tensor  # [R, len(PREFILL_QUERY_FIELDS)]
    pages: torch.Tensor  # every request's K pages, in order
    build_sdpa: Callable[[], tuple[tuple[PaddedBatch, ...], tuple[LongQuery, ...]]]

    def sdpa(self) -> tuple[tuple[PaddedBatch, ...], tuple[LongQuery, ...]]:
        return once_per_step(self, "sdpa", self.build_sdpa)


@dataclass(frozen=True)
class TorchGroupMetadata(GroupAttentionMetadata):
    batches: tuple[PaddedBatch, ...]
    long_queries: tuple[LongQuery, ...] = ()
    multi_row: MultiRowQueries | None = None  # instead of the short batch and long queries

    @property
    def whole(self) -> bool:
        """One batch or one long query is the entire step: its output is the step's."""
        if self.multi_row is not None:
            return False
        if self.long_queries:
            return not self.batches and len(self.long_queries) == 1
        return self.batches[0].whole


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, multi_row_kernel: bool = True) -> None:
        """`multi_row_kernel=False` keeps every multi-row query on SDPA (to compare the two)."""
        self.multi_row_kernel = multi_row_kernel

    def build_metadata(
        self,
        steps: Sequence[SequenceStep],
        kv_groups: Sequence[KVLayerGroup],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        validate_steps(steps, len(kv_groups), block_size)
        if all(s.query_len == 1 for s in steps):
            return _decode_metadata(steps, kv_groups, block_size, device)
        if (rows := token_rows(steps, device)) is not None:
            return _decode_metadata(rows, kv_groups, block_size, device)
        starts = query_starts(steps)
        decode_rows = [i for i, s in enumerate(steps) if s.query_len == 1]
        multi_rows = [i for i, s in enumerate(steps) if s.query_len > 1]
        short_rows = [i for i in multi_rows if steps[i].query_len < LONG_QUERY_ROWS]
        long_rows = [i for i in multi_rows if steps[i].query_len >= LONG_QUERY_ROWS]
        use_kernel = (
            self.multi_row_kernel
            and torch.device(device).type == "cpu"
            and cpu_kernels.prefill_available()
        )
        groups = []
        for g, group in enumerate(kv_groups):
            window = group.sliding_window
            tables = block_table_tensor(steps, g, device)

            def sdpa_parts(
                g: int = g, window: int | None = window, tables: torch.Tensor = tables
            ) -> tuple[tuple[PaddedBatch, ...], tuple[LongQuery, ...]]:
                short = (
                    (_padded_batch(steps, short_rows, starts, tables, block_size, window),)
                    if short_rows
                    else ()
                )
                return short, tuple(
                    _long_query(steps[r], starts[r], g, block_size, window, device)
                    for r in long_rows
                )

            decode = (
                (_padded_batch(steps, decode_rows, starts, tables, block_size, window),)
                if decode_rows
                else ()
            )
            if use_kernel and multi_rows:
                multi_row = _multi_row_queries(
                    steps, multi_rows, starts, g, block_size, window, sdpa_parts
                )
                batches, long_queries = decode, ()
            else:
                multi_row = None
                short, long_queries = sdpa_parts() if multi_rows else ((), ())
                batches = decode + short
            groups.append(
                TorchGroupMetadata(
                    slot_mapping=slot_mapping(steps, tables, block_size),
                    sliding_window=window,
                    batches=batches,
                    long_queries=long_queries,
                    multi_row=multi_row,
                )
            )
        return AttentionMetadata(num_tokens=sum(s.query_len for s in steps), groups=tuple(groups))

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: GroupAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        assert isinstance(metadata, TorchGroupMetadata)
        _, num_heads, head_dim = query.shape
        num_kv_heads = kv_cache.shape[3]
        pages = kv_cache.view(-1, kv_cache[0, 0].numel())  # [num_blocks * 2, bs * Hkv * D]
        out = None if metadata.whole else torch.empty_like(query)
        batches, long_queries = metadata.batches, metadata.long_queries
        multi_row = metadata.multi_row
        if multi_row is not None:
            assert out is not None
            if cpu_ops.paged_prefill_attention(
                query,
                kv_cache,
                multi_row.table,
                multi_row.pages,
                metadata.sliding_window,
                scale,
                out,
            ):
                if not batches:
                    return out
            else:
                short, long_queries = multi_row.sdpa()
                batches = batches + short
        for long in long_queries:
            shape = (1, -1, num_kv_heads, head_dim)  # [1, L, Hkv, D]
            k = pages.index_select(0, long.k_pages).view(shape)[:, : long.num_keys].transpose(1, 2)
            v = pages.index_select(0, long.v_pages).view(shape)[:, : long.num_keys]
            q = query[long.start : long.start + long.length].view(1, -1, num_heads, head_dim)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k,
                v.transpose(1, 2),
                attn_mask=long.additive_mask(q.dtype),
                is_causal=long.is_causal,
                scale=scale,
                enable_gqa=True,
            )
            o = o.transpose(1, 2).reshape(-1, num_heads, head_dim)
            if out is None:  # `whole`: this query is the step
                return o
            out[long.start : long.start + long.length] = o
        for batch in batches:
            b, q_len = batch.query_index.shape
            o = None
            if q_len == 1:
                q = query if batch.whole else query[batch.query_index[:, 0]]
                k_pages = batch.k_pages.view(b, -1)
                window = metadata.sliding_window
                o = cpu_ops.paged_decode_attention(
                    q, kv_cache, k_pages, batch.first_key_pos, batch.seq_lens, window, scale
                )
            if o is not None:
                if out is None:
                    return o
                out[batch.out_rows] = o
                continue
            shape = (b, -1, num_kv_heads, head_dim)  # [B, L, Hkv, D]
            k = pages.index_select(0, batch.k_pages).view(shape).transpose(1, 2)
            v = pages.index_select(0, batch.v_pages).view(shape).transpose(1, 2)
            if batch.whole:
                q = query.view(b, q_len, num_heads, head_dim)
            else:
                q = query[batch.query_index]  # [B, Q, H, D]
            if q_len == 1:
                # One query per request: the G query heads that share a KV head become G rows
                # of one [B, Hkv, G, D] problem, cheaper than SDPA's GQA expansion.
                q = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=batch.additive_mask(q.dtype), scale=scale
                )
                o = o.reshape(b, num_heads, head_dim)  # kernels may return it transposed
            else:
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2),
                    k,
                    v,
                    attn_mask=batch.additive_mask(q.dtype),
                    scale=scale,
                    enable_gqa=True,
                )
                o = o.transpose(1, 2).reshape(-1, num_heads, head_dim)
            if out is None:  # `whole`: this batch is the step
                return o
            out[batch.out_rows] = o[batch.out_select]
        assert out is not None
        return out


def _block_runs_as_decode_rows(device: torch.device | str, query_len: int) -> bool:
    return torch.device(device).type == "cpu" and query_len <= TOKEN_ROW_BLOCK


def verifies_as_decode_rows(backend: AttentionBackend, device: torch.device, block: int) -> bool:
    """Whether verification blocks of `block` tokens run as decode rows (`token_rows`)."""
    return isinstance(backend, TorchAttentionBackend) and _block_runs_as_decode_rows(device, block)


def token_rows(
    steps: Sequence[SequenceStep], device: torch.device | str
) -> list[SequenceStep] | None:
    """A CPU step of short causal blocks (verification) as one single-token step per row, else
    None.

    A causal row sees exactly what the same token would see decoded on its own: the keys below
    its position. Every layer writes the step's K/V before it attends, so as decode rows the
    block's tokens see each other, and the step runs as a decode step: on CPU in one kernel
    call (`fused_decode`), with each row attended as plain decoding attends it.
    """
    if not all(s.causal and _block_runs_as_decode_rows(device, s.query_len) for s in steps):
        return None
    return [
        SequenceStep(1, s.first_position + j + 1, s.block_tables)
        for s in steps
        for j in range(s.query_len)
    ]


@dataclass(frozen=True)
class DecodeRowTables:
    """One KV group's tables for a step of decode rows (one query each), as host lists: what
    `_decode_metadata` puts in tensors, and what the CPU decode kernel reads
    (`fused_decode.DecodeRows`, which a drafter's steps take without the rest)."""

    pages: list[int]  # each row's K pages (V is the next), `max_pages` a row, padded
    max_pages: int
    first_key_pos: list[int]  # position of each row's first key
    seq_lens: list[int]  # keys below this position exist
    slots: list[int]  # where each row's token's K/V is written


def decode_row_tables(
    steps: Sequence[SequenceStep], group: int, block_size: int, window: int | None
) -> DecodeRowTables:
    """`DecodeRowTables` of group `group` for `steps`, every one a single query."""
    spans = [kv_span(s, block_size, window) for s in steps]
    max_pages = max(span.num_pages for span in spans)
    pages: list[int] = []
    for step, span in zip(steps, spans, strict=True):
        table = step.block_tables[group]
        own = [2 * table[span.first_block + p] for p in range(span.num_pages)]
        pages += own + own[-1:] * (max_pages - span.num_pages)  # pad: re-read the last page
    return DecodeRowTables(
        pages=pages,
        max_pages=max_pages,
        first_key_pos=[span.first_block * block_size for span in spans],
        seq_lens=[s.seq_len for s in steps],
        slots=host_slot_mapping(steps, group, block_size),
    )


def _decode_metadata(
    steps: Sequence[SequenceStep],
    kv_groups: Sequence[KVLayerGroup],
    block_size: int,
    device: torch.device | str,
) -> AttentionMetadata:
    """Metadata of a step in which every request decodes one token: the same batch
    `_padded_batch` builds, but from the host lists, so it costs a few small tensors instead of
    ~40 tensor ops (~0.4 ms of a ~20 ms CPU decode step at batch 16)."""
    batch = len(steps)
    rows = torch.arange(batch, device=device)
    groups = []
    for g, group in enumerate(kv_groups):
        window = group.sliding_window
        tables = decode_row_tables(steps, g, block_size, window)
        first_key_pos = torch.tensor(tables.first_key_pos)
        lens = torch.tensor(tables.seq_lens)
        k_pos = first_key_pos[:, None] + torch.arange(tables.max_pages * block_size)[None]
        mask = k_pos < lens[:, None]
        if window is not None:
            mask &= k_pos > (lens - 1 - window)[:, None]
        k_pages = torch.tensor(tables.pages, device=device)
        groups.append(
            TorchGroupMetadata(
                slot_mapping=torch.tensor(tables.slots, device=device),
                sliding_window=window,
                batches=(
                    PaddedBatch(
                        query_index=rows[:, None],
                        k_pages=k_pages,
                        v_pages=k_pages + 1,
                        mask=mask[:, None, None].to(device),
                        first_key_pos=first_key_pos.to(device),
                        seq_lens=lens.to(device),
                        out_rows=rows,
                        out_select=rows,
                        whole=True,
                    ),
                ),
            )
        )
    return AttentionMetadata(num_tokens=batch, groups=tuple(groups))


def _multi_row_queries(
    steps: Sequence[SequenceStep],
    rows: list[int],
    starts: list[int],
    group: int,
    block_size: int,
    window: int | None,
    build_sdpa: Callable[[], tuple[tuple[PaddedBatch, ...], tuple[LongQuery, ...]]],
) -> MultiRowQueries:
    """The kernel's table for requests `rows`: each over exactly the pages of its `kv_span`."""
    table: list[list[int]] = []
    pages: list[int] = []
    for r in rows:
        step = steps[r]
        span = kv_span(step, block_size, window)
        blocks = step.block_tables[group][span.first_block : span.first_block + span.num_pages]
        first_key = span.first_block * block_size
        table.append(
            [starts[r], step.query_len, step.first_position, first_key, step.seq_len,
             int(step.causal), len(pages), span.num_pages]
        )  # fmt: skip
        pages += [2 * b for b in blocks]
    return MultiRowQueries(
        table=torch.tensor(table, dtype=torch.int64),
        pages=torch.tensor(pages, dtype=torch.int64),
        build_sdpa=build_sdpa,
    )


def _long_query(
    step: SequenceStep,
    start: int,
    group: int,
    block_size: int,
    window: int | None,
    device: torch.device | str,
) -> LongQuery:
    """A prompt chunk's own attention problem, over exactly the keys of its `kv_span`, with the
    visibility rule of `_padded_batch`."""
    span = kv_span(step, block_size, window)
    table = step.block_tables[group]
    blocks = table[span.first_block : span.first_block + span.num_pages]
    first_key = span.first_block * block_size
    # Decided from the host-side sizes (never waiting on the device): the window hides a key
    # when the first key is `window` or more behind the last query; the causal kernel hides
    # exactly the upper triangle when the queries and keys are the same positions.
    window_hides = window is not None and first_key <= step.seq_len - 1 - window
    is_causal = step.causal and first_key == step.first_position and not window_hides
    mask = None
    if not is_causal and (step.causal or window_hides):
        k_pos = torch.arange(first_key, step.seq_len, device=device)[None, :]
        q_pos = torch.arange(step.first_position, step.seq_len, device=device)[:, None]
        mask = torch.ones(step.query_len, span.kv_len, dtype=torch.bool, device=device)
        if step.causal:
            mask &= k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
    k_pages = torch.tensor([2 * b for b in blocks], dtype=torch.int64, device=device)
    return LongQuery(
        start=start,
        length=step.query_len,
        k_pages=k_pages,
        v_pages=k_pages + 1,
        num_keys=span.kv_len,
        mask=mask,
        is_causal=is_causal,
    )


def _padded_batch(
    steps: Sequence[SequenceStep],
    rows: list[int],
    query_starts: list[int],
    tables: torch.Tensor,
    block_size: int,
    window: int | None,
) -> PaddedBatch:
    """Index tensors and mask for requests `rows`, built with tensor ops (no per-token loops).

    Keys are gathered as whole pages (one K or V block is one contiguous row of the cache),
    over each request's `kv_span`: from the page holding the first key any of its queries can
    see (0 for full attention, `first_position - window + 1` for a sliding window) to the page
    holding its last token. Key j of a request is position `first_block * block_size + j`. A key
    at `k` is visible to a query at `p` when `k < seq_len` and `k <= p` (causal) or always (draft
    block), and, with a window, when `k > p - window` (transformers' sliding-window rule).
    """
    device = tables.device

    def column(values: list[int] | list[bool], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)[:, None]

    sub = [steps[r] for r in rows]
    spans = [kv_span(s, block_size, window) for s in sub]
    q_lens = column([s.query_len for s in sub], torch.int64)
    seq_lens = column([s.seq_len for s in sub], torch.int64)
    causal = column([s.causal for s in sub], torch.bool)
    starts = column([query_starts[r] for r in rows], torch.int64)
    first_pages = column([span.first_block for span in spans], torch.int64)
    last_pages = column([span.first_block + span.num_pages - 1 for span in spans], torch.int64)

    # Sizes come from the host-side lists, so building never waits on the device.
    max_q = max(s.query_len for s in sub)
    max_pages = max(span.num_pages for span in spans)
    q_idx = torch.arange(max_q, device=device)[None, :]
    q_valid = q_idx < q_lens  # [B, Q]
    q_pos = seq_lens - q_lens + q_idx
    k_pos = first_pages * block_size + torch.arange(max_pages * block_size, device=device)[None]

    limit = torch.where(causal, q_pos, seq_lens - 1)  # last visible key per query
    mask = (k_pos < seq_lens)[:, None, :] & (k_pos[:, None, :] <= limit[:, :, None])
    if window is not None:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - window
    # Padded query rows get one visible key so the softmax stays finite; their output is dropped.
    mask[:, :, 0] |= ~q_valid

    # Padding pages re-read the request's last page: real data, so masked-out scores stay finite.
    pages = torch.minimum(first_pages + torch.arange(max_pages, device=device)[None], last_pages)
    k_pages = (tables[rows].gather(1, pages) * 2).flatten()  # K of block b is cache page 2b
    flat_valid = q_valid.flatten()
    return PaddedBatch(
        query_index=torch.where(q_valid, starts + q_idx, 0),
        k_pages=k_pages,
        v_pages=k_pages + 1,
        mask=mask[:, None],
        first_key_pos=(first_pages * block_size).flatten(),
        seq_lens=seq_lens.flatten(),
        out_rows=(starts + q_idx).flatten()[flat_valid],
        out_select=torch.nonzero(flat_valid).flatten(),
        whole=len(rows) == len(steps) and all(s.query_len == max_q for s in sub),
    )
