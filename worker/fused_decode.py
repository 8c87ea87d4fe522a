"""A whole decode step of `DecoderModel` in one call to the CPU kernels (`csrc/decode_step.c`).

When every request of a step brings one token, each op of a layer works on a handful of rows
and the step is a chain of ~15 small ops per layer. From Python each pays a dispatch, an
allocation or two and, when it runs on all cores, waking the other threads; at batch 16 that
glue was about a third of a SmolLM2 step on a 2-core CPU. `decode_layers` runs every layer in
one OpenMP parallel region with the same kernels the layer-by-layer path calls, so the results
are bit for bit the same (tests/worker/test_fused_decode.py) and only the glue goes.

It runs where the layer-by-layer path would use the C kernels throughout: a CPU model whose
linear layers are packed as panels (`worker.linear`), one query token per request, and the
PyTorch attention backend's metadata. Anything else (prefill chunks, verification blocks,
FlashInfer, float64) keeps the layer-by-layer path.

The table of weight addresses is built once per model (reading ~25 module attributes per layer
costs ~0.75 ms, 3% of a step) and rebuilt when a packed weight changes: `DecoderModel` drops it
when it is moved, cast, loaded or packed, and every step checks that each `Linear` still holds
the packed weight the table was built from. The table keeps every tensor it points into alive,
so a weight replaced behind its module's back is never read from freed memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.worker import cpu_kernels
from specserve.worker.attention.base import AttentionMetadata
from specserve.worker.attention.torch_backend import PaddedBatch, TorchGroupMetadata
from specserve.worker.kv_cache import PagedKVCache
from specserve.worker.linear import Linear, PackedWeight

if TYPE_CHECKING:
    from specserve.worker.models import DecoderLayer, DecoderModel

# Columns of the tables `decode_layers` reads (the enums of csrc/decode_step.c): per layer the
# input norm, qkv (+ bias), q/k norms, o (+ bias), post norm, gate/up (+ bias), down (+ bias)
# and the KV group; per KV group the KV rows, pages, pages per request, first key positions,
# sequence lengths and window.
LAYER_FIELDS = 13
GROUP_FIELDS = 6


@dataclass(frozen=True)
class WeightsTable:
    """`decode_layers`' per-layer addresses for one model, and what they point into."""

    table: torch.Tensor  # [num_layers, LAYER_FIELDS] int64
    layer_ids: tuple[int, ...]
    linears: tuple[Linear, ...]
    packed: tuple[PackedWeight, ...]  # what each of `linears` held when the table was built
    tensors: tuple[torch.Tensor, ...]  # every tensor the table points into, held alive

    def current(self, rows: int) -> bool:
        """Every linear still holds its packed weight, and uses it for `rows` rows."""
        return all(
            linear.packed is packed and rows >= packed.min_rows
            for linear, packed in zip(self.linears, self.packed, strict=True)
        )


def decode_step(
    model: DecoderModel,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    metadata: AttentionMetadata,
    kv_cache: PagedKVCache,
    aux_layers: Sequence[int],
) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """`forward_with_aux`'s result for a decode step, from the embeddings `x [B, hidden]` (which
    it overwrites) and the step's RoPE tables; None when the step or model does not fit the
    kernel, and the caller runs the layers one by one."""
    batches = _decode_batches(metadata)
    if batches is None or not _inputs_fit(model, x, kv_cache):
        return None
    rows = x.shape[0]
    weights = model.fused_weights
    if weights is None or not weights.current(rows):
        weights = model.fused_weights = build_weights_table(model, rows)
        if weights is None:
            return None
    caches = [kv_cache.layers[i] for i in weights.layer_ids]
    captures = {i: torch.empty_like(x) for i in aux_layers}
    capture_addresses = [0] * len(caches)
    for i, capture in captures.items():
        capture_addresses[i] = capture.data_ptr()
    groups = torch.tensor(
        [
            _group_row(group, batch, kv_cache, rows)
            for group, batch in zip(metadata.groups, batches, strict=True)
        ],
        dtype=torch.int64,
    )
    config = model.config
    dims = torch.tensor(
        [
            rows,
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            kv_cache.block_size,
            kv_cache.num_blocks,
            int(x.dtype == torch.bfloat16),
        ],
        dtype=torch.int64,
    )
    out = torch.empty_like(x)
    cos, sin = cos.contiguous(), sin.contiguous()
    cache_table = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
    capture_table = torch.tensor(capture_addresses, dtype=torch.int64)
    errors = torch.zeros(2, dtype=torch.int64)
    lib = cpu_kernels.load()
    assert lib is not None  # _inputs_fit checked
    status = lib.decode_layers(
        weights.table.data_ptr(),
        len(caches),
        cache_table.data_ptr(),
        capture_table.data_ptr(),
        groups.data_ptr(),
        dims.data_ptr(),
        x.data_ptr(),
        out.data_ptr(),
        model.norm.weight.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        config.rms_norm_eps,
        config.head_dim**-0.5,
        errors.data_ptr(),
    )
    bad_rows, failed = errors.tolist()
    if bad_rows:
        raise IndexError(cpu_kernels.kv_rows_error(bad_rows, kv_cache.num_blocks))
    if failed:
        raise RuntimeError(cpu_kernels.attention_error(failed))
    if status == 1:
        raise MemoryError("decode_layers: no memory for the step's intermediates")
    if status:
        raise RuntimeError(f"decode_layers failed with status {status}")
    return out, [captures[i] for i in aux_layers]


def _decode_batches(metadata: AttentionMetadata) -> list[PaddedBatch] | None:
    """Each group's decode batch when the step is decodes only (one batch covering the whole
    step, one query per request), else None."""
    batches = []
    for group_meta in metadata.groups:
        if not isinstance(group_meta, TorchGroupMetadata) or len(group_meta.batches) != 1:
            return None
        (batch,) = group_meta.batches
        if not batch.whole or batch.query_index.shape[1] != 1:
            return None
        batches.append(batch)
    return batches


def _group_row(
    group: TorchGroupMetadata, batch: PaddedBatch, kv_cache: PagedKVCache, rows: int
) -> list[int]:
    k_rows, _ = group.kv_write_rows(kv_cache.block_size)
    for t in (k_rows, batch.k_pages, batch.first_key_pos, batch.seq_lens):
        assert t.dtype == torch.int64 and t.is_contiguous()  # built so by torch_backend
    return [
        k_rows.data_ptr(),
        batch.k_pages.data_ptr(),
        batch.k_pages.numel() // rows,
        batch.first_key_pos.data_ptr(),
        batch.seq_lens.data_ptr(),
        group.sliding_window or 0,
    ]


def _inputs_fit(model: DecoderModel, x: torch.Tensor, kv_cache: PagedKVCache) -> bool:
    config = model.config
    norm = model.norm.weight
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.is_contiguous()
        and x.dtype in cpu_kernels.linear_dtypes()
        and config.head_dim % 2 == 0
        and config.num_heads % config.num_kv_heads == 0
        and norm.dtype == x.dtype
        and norm.is_contiguous()
        and all(t.dtype == x.dtype and t.is_contiguous() for t in kv_cache.layers.values())
    )


def build_weights_table(model: DecoderModel, rows: int) -> WeightsTable | None:
    """The model's `WeightsTable`, or None when a layer's weights are not all in the kernel's
    layout (e.g. a linear without panels, or one that uses `F.linear` for `rows` rows)."""
    table, linears, tensors = [], [], []
    for layer in model.layers:
        row = _layer_row(layer, rows)
        if row is None:
            return None
        addresses, layer_linears, layer_tensors = row
        table.append(addresses)
        linears += layer_linears
        tensors += layer_tensors
    return WeightsTable(
        table=torch.tensor(table, dtype=torch.int64),
        layer_ids=tuple(layer.attn.layer_id for layer in model.layers),
        linears=tuple(linears),
        packed=tuple(linear.packed for linear in linears),  # type: ignore[misc]
        tensors=tuple(tensors),
    )


def _layer_row(
    layer: DecoderLayer, rows: int
) -> tuple[list[int], list[Linear], list[torch.Tensor]] | None:
    """The layer's addresses, its linears and the tensors the addresses point into; None when
    a weight is not in the kernel's layout."""
    attn, mlp = layer.attn, layer.mlp
    linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
    dtype = layer.input_layernorm.weight.dtype
    if attn.qkv_proj.in_features != attn.o_proj.out_features:  # e.g. EAGLE-3's first layer
        return None
    packed = [linear.packed for linear in linears]
    if not all(p is not None and p.panels and rows >= p.min_rows for p in packed):
        return None
    biases = [linear.bias for linear in linears]
    norm_weights = [None if norm is None else norm.weight for norm in norms]
    held = [t for t in (*biases, *norm_weights) if t is not None]
    if not all(t.dtype == dtype and t.is_contiguous() for t in held):
        return None
    weights = [p.tensor for p in packed if p is not None]
    qkv, o, gate_up, down = (
        (w.data_ptr(), _address(b)) for w, b in zip(weights, biases, strict=True)
    )
    input_norm, post_norm, q_norm, k_norm = (_address(w) for w in norm_weights)
    addresses = [
        input_norm, *qkv, q_norm, k_norm, *o, post_norm, *gate_up, *down, layer.group
    ]  # fmt: skip
    assert len(addresses) == LAYER_FIELDS
    return addresses, linears, held + weights


def _address(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()
