"""Host-side paged-attention metadata, persistent device buffers and backend selection (CPU).

The FlashInfer backend itself is also driven here, on CPU, through `FakeFlashInfer`: a small
PyTorch model of the documented FlashInfer wrapper API (plan once, run per layer; CPU int32
indptr/last_page_len and device int32 page indices; bottom-right-aligned causal mask;
`window_left` keeps key j for query i iff `kv_len - qo_len + i - j <= window_left`; the page
indices tensor is kept by reference and read at run time, as the real wrappers do). It checks
the backend's orchestration (split, row maps, window translation, block skipping, planning
counts, slot ownership) against the torch backend. The real kernels are compared in
`test_flashinfer_gpu.py`.
"""

from __future__ import annotations

import gc
import random
import sys
import types

import pytest
import torch

from specserve.shared.config import AttentionType
from specserve.worker.attention.base import SequenceStep, block_table_tensor, slot_mapping
from specserve.worker.attention.flashinfer_backend import (
    INSTALL_HINT,
    FlashInferBackend,
    import_flashinfer,
)
from specserve.worker.attention.metadata import (
    PartKind,
    PersistentBuffers,
    build_group_host_metadata,
    host_slot_mapping,
    kv_span,
    split_requests,
)
from specserve.worker.attention.selection import flashinfer_unavailable_reason, select_backend
from specserve.worker.attention.torch_backend import TorchAttentionBackend
from specserve.worker.kv_cache import PagedKVCache
from specserve.worker.model_config import KVLayerGroup

BS = 4
FULL = KVLayerGroup(AttentionType.FULL, None, (0,))

# --------------------------------------------------------------------------------------------
# Builders against hand-computed values


def _mixed_steps() -> list[SequenceStep]:
    return [
        SequenceStep(1, 7, [[5, 9]]),  # decode at position 6
        SequenceStep(3, 10, [[2, 7, 11]]),  # prefill chunk on a 7-token cached prefix
        SequenceStep(4, 13, [[3, 4, 6, 8]]),  # verification: last token + 3 drafts
        SequenceStep(1, 4, [[12]]),  # decode filling its only page
        SequenceStep(5, 16, [[13, 14, 15, 16]], causal=False),  # DFlash block: next + 4 MASK
    ]


def test_mixed_batch_hand_computed():
    meta = build_group_host_metadata(_mixed_steps(), 0, BS, None)
    assert meta.num_tokens == 14
    decode, causal, noncausal = meta.parts
    assert decode.kind == PartKind.DECODE and decode.requests == (0, 3)
    assert decode.qo_indptr == (0, 1, 2)
    assert decode.kv_indptr == (0, 2, 3)
    assert decode.kv_indices == (5, 9, 12)
    assert decode.kv_last_page_len == (3, 4)
    assert decode.rows == (0, 8) and decode.row_range is None  # not contiguous: gathered

    assert causal.kind == PartKind.CAUSAL and causal.requests == (1, 2)
    assert causal.qo_indptr == (0, 3, 7)
    assert causal.kv_indptr == (0, 3, 7)
    assert causal.kv_indices == (2, 7, 11, 3, 4, 6, 8)
    assert causal.kv_last_page_len == (2, 1)
    assert causal.kv_lens == (10, 13)
    assert causal.row_range == (1, 8)

    assert noncausal.kind == PartKind.NONCAUSAL and noncausal.requests == (4,)
    assert noncausal.qo_indptr == (0, 5)
    assert noncausal.kv_indptr == (0, 4)
    assert noncausal.kv_indices == (13, 14, 15, 16)
    assert noncausal.kv_last_page_len == (4,)
    assert noncausal.row_range == (9, 14)

    # Group layout of the device buffers: parts concatenated in order.
    assert [p.row_offset for p in meta.parts] == [0, 2, 9]
    assert [p.page_offset for p in meta.parts] == [0, 3, 10]
    # Slots: block * 4 + offset of positions 6 | 7,8,9 | 9..12 | 3 | 11..15.
    assert meta.slot_mapping == (38, 31, 44, 45, 25, 26, 27, 32, 51, 63, 64, 65, 66, 67)


def test_slot_mapping_matches_the_torch_backend():
    steps = _mixed_steps()
    tables = block_table_tensor(steps, 0, "cpu")
    assert host_slot_mapping(steps, 0, BS) == slot_mapping(steps, tables, BS).tolist()


def test_split_single_token_draft_block_is_a_decode():
    steps = [SequenceStep(1, 5, [[1, 2]], causal=False), SequenceStep(2, 5, [[3, 4]])]
    assert split_requests(steps) == {PartKind.DECODE: [0], PartKind.CAUSAL: [1]}


def test_sliding_window_skips_blocks_before_the_window():
    w = 5  # a query at p sees keys p-4..p
    steps = [
        # decode at 13: first visible key 9 -> block 2; blocks 0, 1 were freed (null)
        SequenceStep(1, 14, [[0, 0, 21, 22]]),
        # verification at 9..11: first visible key 5 -> block 1
        SequenceStep(3, 12, [[0, 31, 32]]),
        # DFlash block at 16..19: first visible key 12 -> block 3
        SequenceStep(4, 20, [[0, 0, 0, 41, 42]], causal=False),
        # short fresh prefill, window not reached
        SequenceStep(3, 3, [[51]]),
        # decode at 8: first visible key 4 -> exactly block 1's start
        SequenceStep(1, 9, [[0, 61, 62]]),
    ]
    meta = build_group_host_metadata(steps, 0, BS, w)
    decode, causal, noncausal = meta.parts
    assert decode.requests == (0, 4)
    assert decode.kv_indices == (21, 22, 61, 62)
    assert decode.kv_lens == (6, 5)
    assert decode.kv_last_page_len == (2, 1)
    assert causal.requests == (1, 3)
    assert causal.kv_indices == (31, 32, 51)
    assert causal.kv_lens == (8, 3)
    assert causal.kv_last_page_len == (4, 3)
    assert noncausal.kv_indices == (41, 42)
    assert noncausal.kv_lens == (8,)
    assert kv_span(steps[0], BS, w).first_block == 2


def test_null_block_inside_the_window_is_rejected():
    with pytest.raises(ValueError, match="null block inside the attended span"):
        build_group_host_metadata([SequenceStep(1, 14, [[0, 0, 0, 22]])], 0, BS, 5)
    with pytest.raises(ValueError, match="null block"):
        build_group_host_metadata([SequenceStep(2, 6, [[7, 0]])], 0, BS, None)


def _flashinfer_visible(qo_len: int, kv_len: int, causal: bool, window_left: int) -> torch.Tensor:
    """FlashInfer's documented mask, `[qo_len, kv_len]` (span-relative key index)."""
    i = torch.arange(qo_len)[:, None]
    j = torch.arange(kv_len)[None, :]
    mask = torch.ones(qo_len, kv_len, dtype=torch.bool)
    if causal:
        mask &= j <= kv_len - qo_len + i
    if window_left >= 0:
        mask &= kv_len - qo_len + i - j <= window_left
    return mask


@pytest.mark.parametrize("window", [None, 1, 3, 4, 5, 9])
def test_span_and_window_left_reproduce_our_mask(window):
    """For random requests: FlashInfer's mask over our span, mapped back to absolute positions,
    equals our rule (key k visible to a query at p iff k <= p or non-causal, k > p - window)."""
    rng = random.Random(window or 0)
    for _ in range(200):
        seq_len = rng.randint(1, 40)
        q_len = rng.randint(1, seq_len)
        causal = rng.random() < 0.5
        step = SequenceStep(q_len, seq_len, [[1] * 10], causal)
        span = kv_span(step, BS, window)
        assert span.kv_len == (span.num_pages - 1) * BS + span.last_page_len
        assert 1 <= span.last_page_len <= BS and span.kv_len >= q_len
        window_left = -1 if window is None else window - 1
        fi = _flashinfer_visible(q_len, span.kv_len, causal or q_len == 1, window_left)
        ours = torch.zeros(q_len, seq_len, dtype=torch.bool)
        ours[:, span.first_block * BS :] = fi
        p = torch.arange(seq_len - q_len, seq_len)[:, None]
        k = torch.arange(seq_len)[None, :]
        expected = (k <= p) if causal else torch.ones_like(ours)
        if window is not None:
            expected &= k > p - window
        assert torch.equal(ours, expected), (q_len, seq_len, causal)


# --------------------------------------------------------------------------------------------
# Persistent buffers reused across steps


def _reference_device_metadata(meta) -> dict[str, list[int]]:
    """What every device view must hold, computed independently from the host metadata."""
    qo, kv_lens, last, pages = [], [], [], []
    for part in meta.parts:
        qo.extend(part.qo_indptr[i + 1] - part.qo_indptr[i] for i in range(part.num_requests))
        kv_lens.extend(part.kv_lens)
        last.extend(part.kv_last_page_len)
        pages.extend(part.kv_indptr[i + 1] - part.kv_indptr[i] for i in range(part.num_requests))

    def cumsum(xs):
        out = [0]
        for x in xs:
            out.append(out[-1] + x)
        return out

    return {
        "slot_mapping": list(meta.slot_mapping),
        "rows": meta.concat("rows"),
        "kv_indices": meta.concat("kv_indices"),
        "qo_lens": qo,
        "kv_lens": kv_lens,
        "qo_indptr": cumsum(qo),
        "kv_indptr": cumsum(pages),
        "kv_last_page_len": last,
    }


def _check_device(dev, meta) -> None:
    for name, expected in _reference_device_metadata(meta).items():
        got = getattr(dev, name).tolist()
        assert got == expected, f"{name}: {got} != {expected}"


def _random_batch(rng: random.Random, n: int, window: int | None) -> list[SequenceStep]:
    steps = []
    next_block = 1
    for _ in range(n):
        seq_len = rng.randint(1, 60)
        q_len = rng.choice([1, 1, 2, 4, min(seq_len, 7), seq_len])
        q_len = min(q_len, seq_len)
        blocks = -(-seq_len // BS)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        steps.append(SequenceStep(q_len, seq_len, [table], causal=rng.random() < 0.7))
    return steps


# Batches of changing composition: shrinking, growing past capacity, decode-only, one request.
COMPOSITIONS = [9, 3, 12, 1, 30, 2, 6]


def _run_steps(buffers: PersistentBuffers, window: int | None) -> None:
    rng = random.Random(7)
    for n in COMPOSITIONS:
        meta = build_group_host_metadata(_random_batch(rng, n, window), 0, BS, window)
        _check_device(buffers.update(meta), meta)


@pytest.mark.parametrize("window", [None, 6])
def test_persistent_buffers_reused_across_changing_batches(window):
    buffers = PersistentBuffers("cpu", max_requests=4, max_tokens=16, max_pages=8)
    _run_steps(buffers, window)
    assert buffers.num_updates == len(COMPOSITIONS)
    assert buffers.max_requests >= 30  # grew past its initial capacity


class SkipsRecomputeWhenWarm(PersistentBuffers):
    """Deliberately broken: derived buffers are computed on the first update only (the kind
    of 'already computed' shortcut behind vLLM #39546's stale `paged_kv_indptr`)."""

    def _recompute_derived(self, n_req: int, block_size: int) -> None:
        if self.num_updates == 0:
            super()._recompute_derived(n_req, block_size)


def test_skipping_the_device_recompute_leaves_stale_indptr_and_is_caught():
    buffers = SkipsRecomputeWhenWarm("cpu", max_requests=64, max_tokens=4096, max_pages=4096)
    with pytest.raises(AssertionError, match=r"qo_indptr|kv_indptr|kv_last_page_len"):
        _run_steps(buffers, None)


def test_stale_tail_of_a_larger_step_is_not_visible():
    buffers = PersistentBuffers("cpu", max_requests=64, max_tokens=512, max_pages=512)
    rng = random.Random(3)
    big = build_group_host_metadata(_random_batch(rng, 20, None), 0, BS, None)
    buffers.update(big)
    small_steps = [SequenceStep(1, 5, [[3, 4]]), SequenceStep(2, 2, [[9]])]
    small = build_group_host_metadata(small_steps, 0, BS, None)
    dev = buffers.update(small)
    assert dev.kv_indptr.tolist() == [0, 2, 3]  # length R + 1: nothing from the big step
    assert dev.kv_indices.tolist() == [3, 4, 9]
    assert dev.slot_mapping.tolist() == [16, 36, 37]
    _check_device(dev, small)


# --------------------------------------------------------------------------------------------
# Backend selection on a machine without CUDA


def test_selection_without_cuda():
    assert isinstance(select_backend("auto", "cpu"), TorchAttentionBackend)
    assert isinstance(select_backend("torch", "cpu"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="not a CUDA device"):
        select_backend("flashinfer", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("flash", "cpu")
    if not torch.cuda.is_available():
        assert isinstance(select_backend("auto", "cuda"), TorchAttentionBackend)
        with pytest.raises(ValueError, match="no CUDA device is available"):
            select_backend("flashinfer", "cuda")


def test_flashinfer_backend_refuses_a_cpu_device():
    with pytest.raises(RuntimeError, match="CUDA devices only"):
        FlashInferBackend("cpu")


def _pretend_gpu(monkeypatch, capability: tuple[int, int], installed: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Pretend GPU")
    real = __import__("importlib.util").util.find_spec
    monkeypatch.setattr(
        "importlib.util.find_spec",
        lambda name, *a: (object() if installed else None) if name == "flashinfer" else real(name),
    )


def test_selection_reasons_on_a_pretend_gpu(monkeypatch):
    _pretend_gpu(monkeypatch, (9, 0), installed=False)
    reason = flashinfer_unavailable_reason("cuda", torch.bfloat16)
    assert reason is not None and INSTALL_HINT in reason
    with pytest.raises(ValueError, match=r"pip install 'specserve\[gpu\]'"):
        select_backend("flashinfer", "cuda", torch.bfloat16)
    assert isinstance(select_backend("auto", "cuda", torch.bfloat16), TorchAttentionBackend)

    _pretend_gpu(monkeypatch, (7, 0), installed=True)
    with pytest.raises(ValueError, match=r"unsupported GPU Pretend GPU .*7\.0"):
        select_backend("flashinfer", "cuda:0")
    _pretend_gpu(monkeypatch, (7, 5), installed=True)
    assert "bfloat16" in (flashinfer_unavailable_reason("cuda", torch.bfloat16) or "")
    _pretend_gpu(monkeypatch, (9, 0), installed=True)
    assert "float32" in (flashinfer_unavailable_reason("cuda", torch.float32) or "")
    assert isinstance(select_backend("auto", "cuda", torch.float32), TorchAttentionBackend)


def test_missing_package_is_a_clear_runtime_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    with pytest.raises(RuntimeError, match=r"pip install 'specserve\[gpu\]'"):
        import_flashinfer()


def test_engine_rejects_flashinfer_on_cpu(llama_ckpt):
    from specserve.llm import LLM

    with pytest.raises(ValueError, match="cannot run here: device 'cpu'"):
        LLM(str(llama_ckpt.path), attention_backend="flashinfer", num_blocks=16)


# --------------------------------------------------------------------------------------------
# The FlashInfer backend on CPU, through a model of FlashInfer's API


class _FakeWrapper:
    plans: list[tuple[str, int]]  # shared log of (wrapper kind, wrapper id)

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", **kwargs) -> None:
        assert kv_layout == "NHD"
        assert workspace.dtype == torch.uint8
        self.kwargs = kwargs
        self.state: dict | None = None

    def _plan(self, qo_indptr, kv_indptr, indices, last, hq, hkv, d, page_size, **kw) -> None:
        for host in (qo_indptr, kv_indptr, last):  # read on the host by plan()
            assert host.device.type == "cpu" and host.dtype == torch.int32
        assert indices.dtype == torch.int32
        assert kw["pos_encoding_mode"] == "NONE"
        assert hq % hkv == 0
        self.state = dict(
            qo_indptr=qo_indptr.clone(),  # copied into the plan, like the real wrapper
            kv_indptr=kv_indptr.clone(),
            last=last.clone(),
            indices=indices,  # kept by reference and read at run time, like the real wrapper
            heads=(hq, hkv, d),
            page_size=page_size,
            **kw,
        )
        type(self).plans.append((type(self).__name__, id(self)))

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        s = self.state
        assert s is not None, "run() before plan()"
        assert q.dtype == s["q_data_type"] and kv_cache.dtype == s["kv_data_type"]
        hq, hkv, d = s["heads"]
        assert q.shape[1:] == (hq, d) and kv_cache.shape[3:] == (hkv, d)
        assert q.shape[0] == int(s["qo_indptr"][-1])
        assert kv_cache.shape[2] == s["page_size"]
        out = torch.empty_like(q)
        ps = s["page_size"]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # fp32 accumulation
        for b in range(len(s["last"])):
            q0, q1 = int(s["qo_indptr"][b]), int(s["qo_indptr"][b + 1])
            p0, p1 = int(s["kv_indptr"][b]), int(s["kv_indptr"][b + 1])
            kv_len = (p1 - p0 - 1) * ps + int(s["last"][b])
            pages = s["indices"][p0:p1].long()
            k = kv_cache[pages, 0].reshape(-1, hkv, d)[:kv_len].to(acc)
            v = kv_cache[pages, 1].reshape(-1, hkv, d)[:kv_len].to(acc)
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
            mask = _flashinfer_visible(q1 - q0, kv_len, s["causal"], s["window_left"])
            scores = torch.einsum("qhd,khd->hqk", q[q0:q1].to(acc), k) * s["sm_scale"]
            scores = scores.masked_fill(~mask[None], float("-inf"))
            out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
        return out


class FakeDecodeWrapper(_FakeWrapper):
    def plan(self, indptr, indices, last, hq, hkv, d, page_size, **kw) -> None:
        assert self.kwargs.get("use_tensor_cores") is True
        qo = torch.arange(len(last) + 1, dtype=torch.int32)
        self._plan(qo, indptr, indices, last, hq, hkv, d, page_size, causal=True, **kw)


class FakePrefillWrapper(_FakeWrapper):
    def plan(self, qo_indptr, kv_indptr, indices, last, hq, hkv, d, page_size, **kw) -> None:
        assert "causal" in kw, "always pass causal explicitly (the default is False)"
        self._plan(qo_indptr, kv_indptr, indices, last, hq, hkv, d, page_size, **kw)


def _fake_flashinfer() -> types.SimpleNamespace:
    plans: list[tuple[str, int]] = []
    decode = type("FakeDecode", (FakeDecodeWrapper,), {"plans": plans})
    prefill = type("FakePrefill", (FakePrefillWrapper,), {"plans": plans})
    return types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=decode,
        BatchPrefillWithPagedKVCacheWrapper=prefill,
        plans=plans,
    )


def _fake_backend(dtypes=(torch.bfloat16, torch.float32, torch.float64)) -> FlashInferBackend:
    backend = FlashInferBackend("cpu", workspace_bytes=1024, flashinfer_module=_fake_flashinfer())
    backend.supported_dtypes = dtypes
    backend.supported_head_dims = None
    return backend


HKV, D = 2, 8


def _fill_cache(group: KVLayerGroup, num_blocks: int, dtype: torch.dtype) -> PagedKVCache:
    torch.manual_seed(0)
    cache = PagedKVCache([group], num_blocks, BS, HKV, D, dtype, "cpu")
    cache.layers[0].copy_(torch.randn_like(cache.layers[0], dtype=torch.float32).to(dtype))
    return cache


def _batch(specs, rng: random.Random, num_blocks: int, window: int | None):
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    steps = []
    for q_len, seq_len, causal in specs:
        table = [free.pop() for _ in range(-(-seq_len // BS))]
        if window is not None:  # blocks wholly before the window were freed: null
            first = max(0, seq_len - q_len - window + 1) // BS
            table[:first] = [0] * first
        steps.append(SequenceStep(q_len, seq_len, [table], causal))
    return steps


MIXED = [(1, 7, True), (3, 10, True), (4, 13, True), (1, 4, True), (5, 16, False), (6, 6, True)]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq", [2, 8])  # GQA group sizes 1 and 4
def test_fake_flashinfer_backend_matches_torch(window, hq):
    kind = AttentionType.FULL if window is None else AttentionType.SLIDING
    group = KVLayerGroup(kind, window, (0,))
    cache = _fill_cache(group, 64, torch.float64)
    steps = _batch(MIXED, random.Random(1), 64, window)
    query = torch.randn(sum(s.query_len for s in steps), hq, D, dtype=torch.float64)
    ref_meta = TorchAttentionBackend().build_metadata(steps, [group], BS, "cpu")
    expected = TorchAttentionBackend().forward(query, cache.layer(0), ref_meta.groups[0], 0.3)
    backend = _fake_backend()
    meta = backend.build_metadata(steps, [group], BS, "cpu")
    assert torch.equal(meta.groups[0].slot_mapping, ref_meta.groups[0].slot_mapping)
    out = backend.forward(query, cache.layer(0), meta.groups[0], 0.3)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    plans = backend.fi.plans
    kinds = sorted(name for name, _ in plans)
    assert kinds == ["FakeDecode", "FakePrefill", "FakePrefill"]  # causal, non-causal apart
    assert len({wid for _, wid in plans}) == 3


def test_plans_once_per_step_not_per_layer_and_eagerly_once_known():
    cache = _fill_cache(FULL, 64, torch.float32)
    backend = _fake_backend()
    rng = random.Random(2)
    for step_no in range(3):
        steps = _batch(MIXED[: 3 + step_no], rng, 64, None)
        before = backend.num_plans
        meta = backend.build_metadata(steps, [FULL], BS, "cpu")
        planned_in_build = backend.num_plans - before
        query = torch.randn(sum(s.query_len for s in steps), 4, D)
        for _layer in range(6):
            backend.forward(query, cache.layer(0), meta.groups[0], D**-0.5)
        num_parts = len(meta.groups[0].host.parts)
        assert backend.num_plans - before == num_parts  # once per part, whatever the layers
        # Step 0 learns the shape at its first layer; later steps plan in build_metadata.
        assert planned_in_build == (0 if step_no == 0 else num_parts)


def test_register_shape_plans_in_build_metadata_from_the_first_step():
    backend = _fake_backend()
    backend.register_shape([FULL], 4, HKV, D, torch.float32)
    meta = backend.build_metadata([SequenceStep(1, 3, [[1]])], [FULL], BS, "cpu")
    assert backend.num_plans == 1 and len(meta.groups[0].plans) == 1


def test_two_live_metadata_objects_do_not_share_plans_or_buffers():
    """Build A, build B (e.g. a DFlash drafter's per-kind metadata), then run A: A must still
    read its own page table. A backend keeping one wrapper/buffer set per KV group fails."""
    cache = _fill_cache(FULL, 64, torch.float64)
    backend = _fake_backend()
    rng = random.Random(4)
    steps_a = _batch([(1, 9, True), (3, 14, True)], rng, 64, None)
    steps_b = _batch([(1, 30, True), (4, 22, False), (2, 5, True)], rng, 64, None)
    ref = TorchAttentionBackend()
    scale = 0.5
    qa = torch.randn(4, 4, D, dtype=torch.float64)
    qb = torch.randn(7, 4, D, dtype=torch.float64)
    backend.register_shape([FULL], 4, HKV, D, torch.float64, scale)
    meta_a = backend.build_metadata(steps_a, [FULL], BS, "cpu")
    meta_b = backend.build_metadata(steps_b, [FULL], BS, "cpu")
    assert backend.pool.num_leased == 2
    for steps, q, meta in ((steps_a, qa, meta_a), (steps_b, qb, meta_b)):
        expected = ref.forward(
            q, cache.layer(0), ref.build_metadata(steps, [FULL], BS, "cpu").groups[0], scale
        )
        out = backend.forward(q, cache.layer(0), meta.groups[0], scale)
        torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    del meta_a, meta_b, meta
    gc.collect()
    assert backend.pool.num_leased == 0 and len(backend.pool.slots) == 2


def test_changing_batch_composition_across_steps_reuses_slots_without_stale_data():
    cache = _fill_cache(FULL, 512, torch.float64)
    backend = _fake_backend()
    ref = TorchAttentionBackend()
    rng = random.Random(5)
    for n in COMPOSITIONS:
        specs = []
        for _ in range(n):
            seq_len = rng.randint(1, 40)
            specs.append(
                (rng.choice([1, 1, min(3, seq_len), seq_len]), seq_len, rng.random() < 0.7)
            )
        steps = _batch(specs, rng, 512, None)
        q = torch.randn(sum(s.query_len for s in steps), 4, D, dtype=torch.float64)
        meta = backend.build_metadata(steps, [FULL], BS, "cpu")
        out = backend.forward(q, cache.layer(0), meta.groups[0], 0.4)
        expected = ref.forward(
            q, cache.layer(0), ref.build_metadata(steps, [FULL], BS, "cpu").groups[0], 0.4
        )
        torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
        del meta
    assert len(backend.pool.slots) == 1  # one slot, reused by every step


def test_forward_checks():
    backend = _fake_backend(dtypes=(torch.bfloat16,))
    meta = backend.build_metadata([SequenceStep(1, 3, [[1]])], [FULL], BS, "cpu")
    cache = torch.zeros(4, 2, BS, HKV, D)
    with pytest.raises(RuntimeError, match="float32"):
        backend.forward(torch.zeros(1, 4, D), cache, meta.groups[0], 1.0)
    with pytest.raises(ValueError, match="2 query rows but metadata for 1"):
        backend.forward(
            torch.zeros(2, 4, D, dtype=torch.bfloat16), cache.bfloat16(), meta.groups[0], 1.0
        )
    torch_meta = TorchAttentionBackend().build_metadata(
        [SequenceStep(1, 3, [[1]])], [FULL], BS, "cpu"
    )
    with pytest.raises(TypeError, match="its own build_metadata"):
        backend.forward(torch.zeros(1, 4, D), cache, torch_meta.groups[0], 1.0)
    with pytest.raises(ValueError, match="lives on cpu"):
        backend.build_metadata([SequenceStep(1, 3, [[1]])], [FULL], BS, "meta")


def _fake_select(monkeypatch):
    import specserve.worker.engine as engine

    real = engine.select_backend

    def select(name, device, dtype=None):
        return _fake_backend() if name == "flashinfer" else real(name, device, dtype)

    monkeypatch.setattr(engine, "select_backend", select)


@pytest.mark.parametrize("spec", ["none", "dflash", "eagle3"])
def test_engine_greedy_tokens_match_torch_backend(monkeypatch, tmp_path, qwen3_hybrid_ckpt, spec):
    """The whole engine (chunked prefill beside decodes, sliding + full groups, and with
    drafters: verification rows, DFlash non-causal blocks, several live metadata objects per
    step) gives the same greedy tokens through the FlashInfer backend as through torch."""
    import json

    from drafter_checkpoints import write_random_dflash, write_random_eagle3
    from hf_reference import prompts

    from specserve.llm import LLM
    from specserve.shared.protocol import SamplingParams

    _fake_select(monkeypatch)
    config = json.loads((qwen3_hybrid_ckpt.path / "config.json").read_text())
    extra: dict = {}
    if spec == "dflash":
        drafter = write_random_dflash(tmp_path / "d", config, 2, [0, 2], 255, 4, seed=1)
        extra = dict(spec_method="dflash", drafter=str(drafter), num_spec_tokens=3)
    elif spec == "eagle3":
        drafter = write_random_eagle3(
            tmp_path / "e", config, "eagle3", seed=1, aux_layer_ids=[1, 2, 3]
        )
        extra = dict(spec_method="eagle3", drafter=str(drafter), num_spec_tokens=3)
    batch = prompts([3, 9, 17, 24, 30, 5], seed=1)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = {}
    for name in ("torch", "flashinfer"):
        llm = LLM(
            str(qwen3_hybrid_ckpt.path), attention_backend=name, num_blocks=256, block_size=4,
            max_num_batched_tokens=16, **extra,
        )  # fmt: skip
        backend = llm.engine.loaded.model.backend
        assert isinstance(backend, FlashInferBackend) == (name == "flashinfer")
        outs[name] = [o.token_ids for o in llm.generate(batch, params)]
        if name == "flashinfer":
            assert backend.num_plans > 0
    assert outs["flashinfer"] == outs["torch"]


@pytest.mark.parametrize("window", [None, 3, 8, 21])
def test_decode_steps_take_the_host_built_batch(window):
    """A decode-only step's metadata, built from the host lists, equals what the general
    tensor-op builder gives for the same requests (every field), for ragged contexts from one
    key to many blocks and windows shorter and longer than a block."""
    from specserve.worker.attention import torch_backend

    rng = random.Random(7)
    steps, next_block = [], 1
    for seq_len in [1, 4, 5, 17, 60, 33, 2]:
        blocks = -(-seq_len // BS)
        table = list(range(next_block, next_block + blocks))
        rng.shuffle(table)
        next_block += blocks
        steps.append(SequenceStep(1, seq_len, [table]))
    kind = AttentionType.FULL if window is None else AttentionType.SLIDING
    group = KVLayerGroup(kind, window, (0,))
    meta = TorchAttentionBackend().build_metadata(steps, [group], BS, "cpu")
    tables = block_table_tensor(steps, 0, "cpu")
    expected = torch_backend._padded_batch(
        steps, list(range(len(steps))), list(range(len(steps))), tables, BS, window
    )
    (got,) = meta.groups[0].batches
    assert got.whole and expected.whole
    for name in ("query_index", "k_pages", "v_pages", "mask", "first_key_pos", "seq_lens"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert torch.equal(got.out_rows, expected.out_rows)
    assert torch.equal(got.out_select, expected.out_select)
    assert torch.equal(meta.groups[0].slot_mapping, slot_mapping(steps, tables, BS))


def test_flashinfer_needs_nvcc_or_its_prebuilt_kernels(tmp_path):
    """FlashInfer compiles kernels on first use: without nvcc (where FlashInfer looks for it) or
    flashinfer-jit-cache, it is reported unusable up front instead of failing mid-serving."""
    from functools import partial

    from specserve.worker.attention.selection import flashinfer_build_unavailable_reason

    def nothing(_name: str) -> None:
        return None

    def no_module(_name: str) -> bool:
        return False

    reason_for = partial(
        flashinfer_build_unavailable_reason,
        default_nvcc=str(tmp_path / "no"),
        has_prebuilt=lambda: False,
    )
    reason = reason_for({}, nothing, no_module)
    assert reason is not None and "nvcc" in reason and "--attention-backend torch" in reason
    assert "specserve kernels flashinfer" in reason
    assert reason_for({}, nothing, lambda name: name == "flashinfer_jit_cache") is None
    assert reason_for({}, nothing, no_module, has_prebuilt=lambda: True) is None
    cuda = tmp_path / "cuda-13.0"
    (cuda / "bin").mkdir(parents=True)
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text("")
    for env in ({"CUDA_HOME": str(cuda)}, {"CUDA_PATH": str(cuda)}, {"FLASHINFER_NVCC": str(nvcc)}):
        assert reason_for(env, nothing, no_module) is None, env
    assert reason_for({}, lambda _: str(nvcc), no_module) is None  # on PATH
    assert reason_for({"CUDA_HOME": str(tmp_path / "nowhere")}, nothing, no_module) is not None
    assert (
        flashinfer_build_unavailable_reason({}, nothing, no_module, str(nvcc), lambda: False)
        is None
    )
