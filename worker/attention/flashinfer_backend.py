"""FlashInfer attention over the paged KV cache (CUDA only; `pip install 'specserve[gpu]'`).

Same storage as the torch backend: one `[num_blocks, 2, block_size, kv_heads, head_dim]`
tensor per layer is FlashInfer's NHD paged layout, and new K/V are written by the caller
through the slot mapping (`PagedKVCache.write`, plain indexing, CPU and CUDA alike).

Per step and KV group, `build_metadata` splits the requests into three parts
(`metadata.split_requests`), each run by its own wrapper:

* decode (one query token): `BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)`.
  Tensor cores take every GQA group size (the CUDA-core decode kernels only a fixed list);
* causal multi-token queries (prefill chunks on a cached prefix, verification of 1+k tokens):
  `BatchPrefillWithPagedKVCacheWrapper` planned with `causal=True`. FlashInfer's causal mask is
  bottom-right aligned (query i of a request with `qo_len` queries and `kv_len` keys sees key
  j iff `j <= kv_len - qo_len + i`), which is exactly "these tokens are the tail of the KV";
* non-causal draft blocks (DFlash): a *separate* prefill wrapper planned with `causal=False`
  (the queries are the tail of the KV, so non-causal = "all context + the whole block").

Sliding windows: ours keeps key k for a query at p iff `k > p - window`; FlashInfer keeps it
iff `p - k <= window_left`, so `window_left = window - 1`. Blocks wholly before the window
are left out of the page table (`metadata.kv_span`); masks only compare positions relative to
the span's end, so this changes nothing but the work done.

Planning. `plan()` needs head counts, head_dim, dtypes and the softmax scale, which the
backend interface gives only to `forward`. The backend therefore learns each model's
attention shape (keyed by its `kv_groups`) from its first forward, plans it right there once
(never once per layer: the plan is memoised on the metadata), and from then on plans every
known shape inside `build_metadata`. `register_shape` lets a caller plan eagerly from the
first step. Host metadata (qo/kv indptr, last_page_len) goes to `plan()` as CPU int32
tensors built from host lists; page indices are copied to the device once per step. Nothing
in a step reads device memory back.

Ownership. Every metadata object leases its own "slot" (wrappers + `PersistentBuffers`) from
a pool and returns it when the object is garbage collected. Two metadata objects alive at
the same time (a target step and its drafter, or the per-layer-kind metadata a DFlash
drafter builds before running any layer) therefore never share a plan or a device buffer, so
neither can run on the other's page table. A slot is re-planned only after the GPU has
executed the previous plan's upload from the wrapper's pinned host buffer (checked with a
CUDA event; the pool prefers slots whose event already completed).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from specserve.worker.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    GroupAttentionMetadata,
    SequenceStep,
    validate_steps,
)
from specserve.worker.attention.metadata import (
    DeviceMetadata,
    GroupHostMetadata,
    PartKind,
    PartMetadata,
    PersistentBuffers,
    build_group_host_metadata,
)
from specserve.worker.model_config import KVLayerGroup

INSTALL_HINT = "pip install 'specserve[gpu]'"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # FA2 and FA3 (Hopper) prefill kernels both take these
DEFAULT_WORKSPACE_BYTES = 256 << 20
DEFAULT_MAX_SLOTS = 16


def import_flashinfer() -> ModuleType:
    """`import flashinfer`, or a RuntimeError that says how to install it."""
    try:
        import flashinfer
    except ImportError as exc:
        raise RuntimeError(
            f"the FlashInfer attention backend needs the flashinfer package ({exc}); "
            f"install it with: {INSTALL_HINT}"
        ) from exc
    return flashinfer


def _normalise_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(frozen=True)
class AttentionShape:
    """Everything `plan()` needs besides the page table."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    sm_scale: float


class _Wrapper:
    """A FlashInfer wrapper plus the event recorded after its last plan's upload."""

    def __init__(self, wrapper: Any, device: torch.device) -> None:
        self.wrapper = wrapper
        self.event = torch.cuda.Event() if device.type == "cuda" else None
        self.planned = False

    def ready(self) -> bool:
        return self.event is None or not self.planned or self.event.query()

    def plan(self, do_plan: Callable[[], None]) -> None:
        # plan() rewrites the wrapper's pinned host buffer and queues an async upload of it;
        # the previous plan's upload must have run first.
        if self.event is not None and self.planned:
            self.event.synchronize()
        do_plan()
        if self.event is not None:
            self.event.record()
        self.planned = True


class _Slot:
    """Wrappers and device buffers owned by one live metadata object at a time."""

    def __init__(self, buffers: PersistentBuffers, make_wrapper: Callable[[PartKind], Any]) -> None:
        self.buffers = buffers
        self._make_wrapper = make_wrapper
        self.wrappers: dict[tuple[PartKind, AttentionShape], _Wrapper] = {}
        self.key: object = None

    def wrapper(self, kind: PartKind, shape: AttentionShape) -> _Wrapper:
        entry = self.wrappers.get((kind, shape))
        if entry is None:
            entry = _Wrapper(self._make_wrapper(kind), self.buffers.device)
            self.wrappers[(kind, shape)] = entry
        return entry

    def ready(self) -> bool:
        return all(w.ready() for w in self.wrappers.values())


class SlotPool:
    """Hands each metadata object an exclusive slot; slots come back when it is collected."""

    def __init__(self, make_slot: Callable[[], _Slot], max_slots: int) -> None:
        self._make_slot = make_slot
        self.max_slots = max_slots
        self.slots: list[_Slot] = []
        self._free: list[_Slot] = []  # oldest release first

    @property
    def num_leased(self) -> int:
        return len(self.slots) - len(self._free)

    def lease(self, key: object) -> _Slot:
        if not self._free and len(self.slots) >= self.max_slots:
            gc.collect()  # metadata kept alive only by a reference cycle
        candidates = [s for s in self._free if s.key == key] + [
            s for s in self._free if s.key != key
        ]
        ready = [s for s in candidates if s.ready()]
        if ready:
            slot = ready[0]
        elif len(self.slots) < self.max_slots:
            slot = self._make_slot()
            self.slots.append(slot)
            self._free.append(slot)
        elif candidates:
            slot = candidates[0]  # every slot busy on the GPU: plan() will wait for it
        else:
            raise RuntimeError(
                f"more than {self.max_slots} FlashInfer attention metadata objects are alive; "
                "drop metadata of finished steps (or raise max_slots)"
            )
        self._free.remove(slot)
        slot.key = key
        return slot

    def release(self, slot: _Slot) -> None:
        self._free.append(slot)


@dataclass(frozen=True)
class _PartRun:
    wrapper: Any
    row_range: tuple[int, int] | None  # contiguous rows, else `rows` gathers them
    rows: torch.Tensor | None


@dataclass(frozen=True)
class FlashInferGroupMetadata(GroupAttentionMetadata):
    host: GroupHostMetadata
    device: DeviceMetadata
    key: tuple[KVLayerGroup, ...] = field(repr=False)
    slot: _Slot = field(repr=False, compare=False)
    plans: dict[AttentionShape, tuple[_PartRun, ...]] = field(
        default_factory=dict, repr=False, compare=False
    )


class FlashInferBackend(AttentionBackend):
    """Paged attention with FlashInfer wrappers; see the module docstring."""

    def __init__(
        self,
        device: torch.device | str = "cuda",
        *,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        prefill_backend: str = "auto",
        max_slots: int = DEFAULT_MAX_SLOTS,
        flashinfer_module: ModuleType | Any | None = None,
    ) -> None:
        """`flashinfer_module` substitutes the package (tests run a CPU model of its API);
        with the real package the device must be CUDA."""
        if flashinfer_module is None:
            device = torch.device(device)
            if device.type != "cuda" or not torch.cuda.is_available():
                raise RuntimeError(
                    f"the FlashInfer attention backend runs on CUDA devices only, got device "
                    f"{str(device)!r} (CUDA available: {torch.cuda.is_available()}); "
                    "use the torch backend"
                )
            flashinfer_module = import_flashinfer()
        self.fi = flashinfer_module
        self.device = _normalise_device(device)
        self.prefill_backend = prefill_backend
        # What the kernels take; tests driving a CPU model of the API may widen these.
        self.supported_dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES
        self.supported_head_dims: tuple[int, ...] | None = SUPPORTED_HEAD_DIMS
        # One float workspace shared by every wrapper: they run one after another on the
        # current stream. Zeroed: the decode wrapper requires it on first use.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.pool = SlotPool(self._make_slot, max_slots)
        self.num_plans = 0  # plan() calls so far (tests and benchmarks read it)
        self._shapes: dict[tuple[KVLayerGroup, ...], list[AttentionShape]] = {}

    def _make_slot(self) -> _Slot:
        return _Slot(PersistentBuffers(self.device), self._make_wrapper)

    def _make_wrapper(self, kind: PartKind) -> Any:
        if kind == PartKind.DECODE:
            return self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=True
            )
        return self.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=self.prefill_backend
        )

    def register_shape(
        self,
        kv_groups: Sequence[KVLayerGroup],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        scale: float | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """Plan this shape in `build_metadata` from the first step on (else learnt lazily)."""
        shape = AttentionShape(
            num_heads,
            num_kv_heads,
            head_dim,
            dtype,
            kv_dtype or dtype,
            float(head_dim**-0.5 if scale is None else scale),
        )
        self._check_shape(shape)
        known = self._shapes.setdefault(tuple(kv_groups), [])
        if shape not in known:
            known.append(shape)

    def build_metadata(
        self,
        steps: Sequence[SequenceStep],
        kv_groups: Sequence[KVLayerGroup],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        validate_steps(steps, len(kv_groups), block_size)
        if _normalise_device(device) != self.device:
            raise ValueError(
                f"metadata requested for device {device}, but this FlashInfer backend lives on "
                f"{self.device}"
            )
        key = tuple(kv_groups)
        groups: list[FlashInferGroupMetadata] = []
        for g, group in enumerate(kv_groups):
            host = build_group_host_metadata(steps, g, block_size, group.sliding_window)
            slot = self.pool.lease(key)
            try:
                dev = slot.buffers.update(host)
            except BaseException:
                self.pool.release(slot)
                raise
            meta = FlashInferGroupMetadata(
                slot_mapping=dev.slot_mapping,
                sliding_window=group.sliding_window,
                host=host,
                device=dev,
                key=key,
                slot=slot,
            )
            weakref.finalize(meta, self.pool.release, slot)
            for shape in self._shapes.get(key, ()):
                self._plan(meta, shape)
            groups.append(meta)
        return AttentionMetadata(num_tokens=sum(s.query_len for s in steps), groups=tuple(groups))

    def _check_shape(self, shape: AttentionShape) -> None:
        if shape.q_dtype not in self.supported_dtypes:
            raise RuntimeError(
                f"FlashInfer attention runs in {[str(d) for d in self.supported_dtypes]}, got "
                f"{shape.q_dtype}; load the model in bfloat16/float16 or use the torch backend"
            )
        dims = self.supported_head_dims
        if dims is not None and shape.head_dim not in dims:
            raise RuntimeError(
                f"FlashInfer attention supports head_dim in {list(dims)}, got {shape.head_dim}; "
                "use the torch backend"
            )
        if shape.num_qo_heads % shape.num_kv_heads:
            raise ValueError(
                f"{shape.num_qo_heads} query heads is not a multiple of "
                f"{shape.num_kv_heads} KV heads"
            )

    def _plan(self, meta: FlashInferGroupMetadata, shape: AttentionShape) -> tuple[_PartRun, ...]:
        """Plan every part of `meta` for `shape`, once (memoised on `meta`)."""
        window_left = -1 if meta.sliding_window is None else meta.sliding_window - 1
        common = dict(
            pos_encoding_mode="NONE",
            window_left=window_left,
            q_data_type=shape.q_dtype,
            kv_data_type=shape.kv_dtype,
            sm_scale=shape.sm_scale,
            non_blocking=True,
        )
        heads = (shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, meta.host.block_size)
        runs = []
        for part in meta.host.parts:
            entry = meta.slot.wrapper(part.kind, shape)
            indices = meta.device.kv_indices[part.page_offset : part.page_offset + part.num_pages]
            entry.plan(_plan_call(entry.wrapper, part, indices, heads, common))
            self.num_plans += 1
            rows = None
            if part.row_range is None:
                rows = meta.device.rows[part.row_offset : part.row_offset + part.num_tokens]
            runs.append(_PartRun(entry.wrapper, part.row_range, rows))
        planned = tuple(runs)
        meta.plans[shape] = planned
        return planned

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: GroupAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if not isinstance(metadata, FlashInferGroupMetadata):
            raise TypeError(
                f"FlashInferBackend.forward needs metadata from its own build_metadata, got "
                f"{type(metadata).__name__}"
            )
        num_tokens = metadata.host.num_tokens
        if query.shape[0] != num_tokens:
            raise ValueError(f"{query.shape[0]} query rows but metadata for {num_tokens} tokens")
        shape = AttentionShape(
            num_qo_heads=query.shape[1],
            num_kv_heads=kv_cache.shape[3],
            head_dim=query.shape[2],
            q_dtype=query.dtype,
            kv_dtype=kv_cache.dtype,
            sm_scale=float(scale),
        )
        runs = metadata.plans.get(shape)
        if runs is None:  # first layer of this shape on this metadata: plan once, remember
            self._check_shape(shape)
            runs = self._plan(metadata, shape)
            known = self._shapes.setdefault(metadata.key, [])
            if shape not in known:
                known.append(shape)
        query = query.contiguous()
        if len(runs) == 1 and runs[0].row_range == (0, num_tokens):
            return runs[0].wrapper.run(query, kv_cache)
        out = torch.empty_like(query)
        for run in runs:
            if run.row_range is not None:
                start, stop = run.row_range
                out[start:stop] = run.wrapper.run(query[start:stop], kv_cache)
            else:
                assert run.rows is not None
                part_out = run.wrapper.run(query.index_select(0, run.rows), kv_cache)
                out.index_copy_(0, run.rows, part_out)
        return out


def _plan_call(
    wrapper: Any,
    part: PartMetadata,
    indices: torch.Tensor,
    heads: tuple[int, int, int, int],
    common: dict[str, Any],
) -> Callable[[], None]:
    """The plan() call of one part: host (CPU int32) indptr/last_page_len, device indices."""
    kv_indptr = part.int32("kv_indptr")
    last_page_len = part.int32("kv_last_page_len")
    if part.kind == PartKind.DECODE:
        return lambda: wrapper.plan(kv_indptr, indices, last_page_len, *heads, **common)
    qo_indptr = part.int32("qo_indptr")
    causal = part.kind == PartKind.CAUSAL
    return lambda: wrapper.plan(
        qo_indptr, kv_indptr, indices, last_page_len, *heads, causal=causal, **common
    )
