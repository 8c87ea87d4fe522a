"""A whole decode step of `DecoderModel` in one call to the CPU kernels (`csrc/decode_step.c`).

When every request of a step brings one token, each op of a layer works on a handful of rows
and the step is a chain of ~15 small ops per layer. From Python each pays a dispatch, an
allocation or two and, when it runs on all cores, waking the other threads; at batch 16 that
glue was about a third of a SmolLM2 step on a 2-core CPU. `decode_layers` runs every layer in
one OpenMP parallel region with the same kernels the layer-by-layer path calls, so the results
are bit for bit the same (tests/worker/test_fused_decode.py) and only the glue goes.

`run_layers` is the call itself, for any stack of `DecoderLayer`s: the target's (`decode_step`)
and an EAGLE-3 drafter's, whose first layer reads a given attention input (`[norm(embeddings),
norm(hidden)]`, twice the residual's width) instead of its input norm of the residual stream.

It runs where the layer-by-layer path would use the C kernels throughout: a CPU model whose
linear layers are packed as panels (`worker.linear`), one query token per row, and the PyTorch
attention backend's metadata. Verification blocks and short prompt chunks come as one decode row
per token (`torch_backend.token_rows`). Anything else (longer prompt chunks, DFlash's
non-causal blocks, FlashInfer, float64, a layer of another dtype) keeps the layer-by-layer path.

The table of weight addresses (`LayerStack`) is made with each tensor's dtype and size
checked, and kept until a weight is packed again or a parameter it reads in place moves
(`stack_for`), so a weight that was moved, cast, reloaded or replaced is always the one used,
and the C code never reads past a tensor. Its rows are built by column name
(`kernels.DecodeLayer`, `DecodeGroup`, `DecodeDims`, and `DraftChain` for `run_chain`, an
EAGLE-3 drafter's greedy depths in one call), whose order the library is checked against
when it loads. A drafter's steps bring their KV tables made from the steps alone
(`DecodeRows`), without the attention metadata of the layer path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from specserve.worker.attention.base import AttentionMetadata, SequenceStep, validate_steps
from specserve.worker.attention.torch_backend import (
    PaddedBatch,
    TorchGroupMetadata,
    decode_row_tables,
    token_rows,
)
from specserve.worker.cpu import kernels
from specserve.worker.cpu.kernels import PANEL, DecodeDims, DecodeGroup, DecodeLayer
from specserve.worker.cpu.linear import Linear, packing_generation
from specserve.worker.kv_cache import PagedKVCache
from specserve.worker.model_config import ModelConfig
from specserve.worker.models import DecoderLayer, DecoderModel, RMSNorm


def decode_step(
    model: DecoderModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    metadata: AttentionMetadata,
    kv_cache: PagedKVCache,
    aux_layers: Sequence[int],
) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """`model.forward_with_aux`'s result for a decode step; None when the step or model does
    not fit the kernel, and the caller runs the layers one by one."""
    if not takes_step(metadata):
        return None
    x, cos, sin = model.embed_step(input_ids, positions, metadata, aux_layers)
    return run_layers(
        model.layers, model.norm, model.config, x, cos, sin, metadata, kv_cache, aux_layers
    )


def takes_step(metadata: AttentionMetadata) -> bool:
    """Whether `run_layers` can take a step of this metadata (decodes only, one query a row):
    what a caller asks before it builds the layers' inputs."""
    return _decode_batches(metadata) is not None


def run_layers(
    layers: Sequence[DecoderLayer],
    norm: RMSNorm,
    config: ModelConfig,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    metadata: AttentionMetadata,
    kv_cache: PagedKVCache,
    aux_layers: Sequence[int] = (),
    attn_input: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """`layers` over the residual stream `x` (left holding it after the last layer), then
    `norm`: the normed output and the captures of `aux_layers`; None where the step or a
    layer does not fit the kernel. `attn_input`: what the first layer's q/k/v read instead of
    its input norm of `x` (an EAGLE-3 drafter's `[norm(embeddings), norm(hidden)]`)."""
    groups = group_tables(metadata, kv_cache, 1)
    if groups is None or len(metadata.groups) != len(config.kv_groups):
        return None
    assert metadata.num_tokens == x.shape[0]
    qkv_in = config.hidden_size if attn_input is None else attn_input.shape[-1]
    stack = stack_for(layers, norm, config, x.dtype, x.shape[0], kv_cache, qkv_in)
    if stack is None or not stack.takes(x, cos, sin, attn_input):
        return None
    return stack.run(x, cos, sin, groups[0], aux_layers, attn_input)


# Parameters a table points at where they are: (module, parameter name, address).
InPlace = list[tuple[nn.Module, str, int]]


@dataclass(frozen=True, eq=False)
class LayerStack:
    """A stack of layers checked for the kernel at one row count, with its table of weight
    addresses: what `run_layers` makes for each step, and an EAGLE-3 draft chain once for all
    its depths (steps of the same rows, each with its own KV rows, `group_tables`)."""

    layers: Sequence[DecoderLayer]
    norm: RMSNorm
    config: ModelConfig
    dtype: torch.dtype
    rows: int
    qkv_in: int  # the first layer's q/k/v input width
    table: torch.Tensor  # [layers, DecodeLayer]
    caches: torch.Tensor  # each layer's KV cache address
    block_size: int  # the KV cache's (not the cache itself: it keeps this stack)
    num_blocks: int
    # The layers' parameters the kernel reads in place (norm weights, biases; the final norm
    # is read at each step): the table holds while each is still there (a Parameter can be
    # replaced, or its `.data` swapped, behind its module's back).
    in_place: tuple[tuple[nn.Module, str, int], ...]

    @classmethod
    def of(
        cls,
        layers: Sequence[DecoderLayer],
        norm: RMSNorm,
        config: ModelConfig,
        dtype: torch.dtype,
        rows: int,
        kv_cache: PagedKVCache,
        qkv_in: int,
    ) -> LayerStack | None:
        """The stack for steps of `rows` rows of `dtype`, or None where a layer, the norm or the
        cache does not fit the kernel."""
        if not _stack_fits(layers, norm, config, dtype, kv_cache):
            return None
        in_place: InPlace = []
        table = [
            _layer_row(
                layer, config, dtype, rows, qkv_in if i == 0 else config.hidden_size, in_place
            )
            for i, layer in enumerate(layers)
        ]
        if any(row is None for row in table):
            return None
        layer_ids = [layer.attn.layer_id for layer in layers]
        caches = torch.tensor([kv_cache.layers[i].data_ptr() for i in layer_ids], dtype=torch.int64)
        table_t = torch.tensor(table, dtype=torch.int64)
        return cls(
            layers, norm, config, dtype, rows, qkv_in, table_t, caches,
            kv_cache.block_size, kv_cache.num_blocks, tuple(in_place),
        )  # fmt: skip

    def current(self) -> bool:
        """Whether the parameters read in place are still where the table says."""
        return all(
            (param := module._parameters[name]) is not None and param.data_ptr() == address
            for module, name, address in self.in_place
        )

    def takes(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_input: torch.Tensor | None
    ) -> bool:
        """Whether a step's residual stream, RoPE tables and first-layer input fit the stack."""
        return self._takes_stream(x, cos, sin) and (
            self.qkv_in == self.config.hidden_size
            if attn_input is None
            else _given_input_fits(attn_input, x, self.qkv_in)
        )

    def _takes_stream(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        shape = (self.rows, 1, self.config.head_dim)
        return (
            x.device.type == "cpu"
            and x.dim() == 2
            and x.shape == (self.rows, self.config.hidden_size)
            and x.is_contiguous()
            and x.dtype == self.dtype
            and all(
                t.dtype == self.dtype and t.is_contiguous() and t.shape == shape for t in (cos, sin)
            )
        )

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        groups: torch.Tensor,
        aux_layers: Sequence[int] = (),
        attn_input: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One step (inputs that `takes` accepts; `groups`: a `group_tables` row): the normed
        output and the captures of `aux_layers`, `x` left holding the residual stream."""
        captures = {i: torch.empty_like(x) for i in aux_layers}
        capture_table = torch.zeros(len(self.layers), dtype=torch.int64)
        for i, capture in captures.items():
            capture_table[i] = capture.data_ptr()
        dims = self._dims(0 if attn_input is None else attn_input.data_ptr())
        self._check_groups(groups, 1)
        out = torch.empty_like(x)
        errors = torch.zeros(2, dtype=torch.int64)
        step = (capture_table, groups, dims, x, out)
        self._call("decode_layers", [t.data_ptr() for t in step], cos, sin, errors)
        return out, [captures[i] for i in aux_layers]

    def run_chain(
        self,
        x: torch.Tensor,
        tokens: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        groups: torch.Tensor,
        chain: kernels.DraftChain,
    ) -> torch.Tensor:
        """An EAGLE-3 drafter's next `chain.depths` greedy drafts in one call (`draft_chain` in
        `csrc/decode_step.c`): `[depths, rows]` target ids, from the last drafts `tokens` and
        the pre-norm state `x` that drafted them (left holding the last depth's). `cos`, `sin`:
        the depths' RoPE rows, depth by depth; `groups`: `group_tables` of the depths."""
        rows, depths = self.rows, chain.depths
        if self.qkv_in != 2 * self.config.hidden_size or not self._takes_stream(
            x, cos[:rows], sin[:rows]
        ):
            raise ValueError("draft_chain: the stack is not an EAGLE-3 drafter's at these rows")
        shape = (depths * rows, 1, self.config.head_dim)
        if (
            cos.shape != shape
            or sin.shape != shape
            or not (cos.is_contiguous() and sin.is_contiguous())
        ):
            raise ValueError(f"draft_chain: RoPE rows {tuple(cos.shape)} for {depths} depths")
        if tokens.dtype != torch.int64 or tokens.shape != (rows,) or not tokens.is_contiguous():
            raise ValueError(f"draft_chain: tokens {tuple(tokens.shape)} {tokens.dtype}")
        self._check_groups(groups, depths)
        out = torch.empty((depths, rows), dtype=torch.int64)
        errors = torch.zeros(3, dtype=torch.int64)
        table = torch.tensor(chain, dtype=torch.int64)
        dims = self._dims(0)
        step = (groups, dims, table, x, tokens, out)
        self._call("draft_chain", [t.data_ptr() for t in step], cos, sin, errors)
        return out

    def chain_table(
        self,
        depths: int,
        head: Linear,
        embed: torch.Tensor,
        input_norm: RMSNorm,
        hidden_norm: RMSNorm,
        norm_before_residual: bool,
        draft_to_target: torch.Tensor,
    ) -> kernels.DraftChain | None:
        """`run_chain`'s table of `depths` depths on this stack (an EAGLE-3 drafter's layers):
        its draft head (`[draft_vocab, hidden]` panels, no bias), the embedding table its
        drafts are read back through (float32 or bfloat16), the first layer's two norms and
        the draft ids' target ids; None where a part does not fit the kernel."""
        vocab, hidden = head.out_features, head.in_features
        panels, bias, narrow, bits = _linear_addresses(head, self.dtype, self.rows, hidden, vocab)
        if (
            hidden != self.config.hidden_size
            or panels is None
            or bias != 0
            or embed.dtype not in (torch.float32, torch.bfloat16)
            or embed.dim() != 2
            or embed.shape[1] != hidden
            or not _fits(embed, embed.dtype, embed.numel())
            or not _fits(draft_to_target, torch.int64, vocab)
        ):
            return None
        norms = [_norm_address(n, self.dtype, hidden, None) for n in (input_norm, hidden_norm)]
        if None in norms:
            return None
        return kernels.DraftChain(
            depths=depths,
            num_groups=len(self.config.kv_groups),
            embed=embed.data_ptr(),
            embed_rows=embed.shape[0],
            embed_bf16=int(embed.dtype == torch.bfloat16),
            input_norm=norms[0],
            hidden_norm=norms[1],
            norm_before_residual=int(norm_before_residual),
            head=panels,
            head_narrow=narrow,
            head_bits=bits,
            draft_vocab=vocab,
            draft_to_target=draft_to_target.data_ptr(),
        )

    def _call(
        self,
        kernel: str,
        step: Sequence[int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        errors: torch.Tensor,
    ) -> None:
        """`kernel` (`decode_layers` or `draft_chain`) on this stack's layers with the step's
        own addresses `step` between their tables and the final norm; raises what it reports."""
        lib = kernels.load()
        assert lib is not None  # LayerStack.of checked
        status = getattr(lib, kernel)(
            self.table.data_ptr(),
            len(self.layers),
            self.caches.data_ptr(),
            *step,
            self.norm.weight.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            self.config.rms_norm_eps,
            self.config.head_dim**-0.5,
            errors.data_ptr(),
        )
        self._raise_for(kernel, status, errors)

    def _dims(self, attn_input: int) -> torch.Tensor:
        config = self.config
        return torch.tensor(
            DecodeDims(
                rows=self.rows,
                hidden=config.hidden_size,
                heads=config.num_heads,
                kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                inter=config.intermediate_size,
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                is_bf16=int(self.dtype == torch.bfloat16),
                attn_input=attn_input,
                attn_in=self.qkv_in,
            ),
            dtype=torch.int64,
        )

    def _check_groups(self, groups: torch.Tensor, parts: int) -> None:
        """`groups` must be `parts` rows of `group_tables` for this stack's KV groups."""
        shape = (len(self.config.kv_groups), len(DecodeGroup._fields))
        if not (
            groups.dtype == torch.int64
            and groups.is_contiguous()
            and groups.shape[-2:] == shape
            and groups.numel() == parts * shape[0] * shape[1]
        ):
            raise ValueError(
                f"decode_layers: a KV group table {tuple(groups.shape)} {groups.dtype} for "
                f"{parts} x {len(self.config.kv_groups)} groups"
            )

    def _raise_for(self, kernel: str, status: int, errors: torch.Tensor) -> None:
        bad_rows, failed, *bad_tokens = errors.tolist()
        if bad_rows:
            raise IndexError(kernels.kv_rows_error(bad_rows, self.num_blocks))
        if failed:
            raise RuntimeError(kernels.attention_error(failed))
        if bad_tokens and bad_tokens[0]:
            raise IndexError(f"{kernel}: {bad_tokens[0]} drafts outside the embedding table")
        if status == 1:
            raise MemoryError(f"{kernel}: no memory for the step's intermediates")
        if status:
            raise RuntimeError(f"{kernel} failed with status {status}")


def stack_for(
    layers: Sequence[DecoderLayer],
    norm: RMSNorm,
    config: ModelConfig,
    dtype: torch.dtype,
    rows: int,
    kv_cache: PagedKVCache,
    qkv_in: int,
) -> LayerStack | None:
    """`LayerStack.of`, kept in the KV cache (`decode_stacks`) per stack of layers and step
    shape while no weight is packed again (`linear.packing_generation`): making the table reads
    every linear's panels, limits and sizes, 1.2-1.7 ms a step for SmolLM2's 30 layers on a
    2-core Zen 3 VM, where a batch-1 step took 9.5-12 ms. (A None kept under an id that a later
    object reuses only sends that step down the layer-by-layer path.)"""
    if not layers:
        return None
    kept = kv_cache.decode_stacks
    generation = packing_generation()
    if kept.get("generation") != generation:
        kept.clear()
        kept["generation"] = generation
    key = (id(layers[0]), len(layers), id(norm), id(config), dtype, rows, qkv_in)
    stack = kept.get(key, False)
    if stack is None or (
        isinstance(stack, LayerStack)
        and stack.norm is norm
        and stack.config is config
        and all(a is b for a, b in zip(stack.layers, layers, strict=True))
        and stack.current()
    ):
        return stack
    stack = kept[key] = LayerStack.of(layers, norm, config, dtype, rows, kv_cache, qkv_in)
    return stack


def group_tables(
    metadata: AttentionMetadata, kv_cache: PagedKVCache, parts: int
) -> torch.Tensor | None:
    """`[parts, groups, DecodeGroup]`: the KV group table of each of `parts` equal runs of a
    decode step's rows (an EAGLE-3 draft chain's depths, built as one step, depth by depth),
    each pointing into the step's own metadata tensors (which the caller keeps); None where
    the step is not decodes only (`takes_step`)."""
    batches = _decode_batches(metadata)
    if batches is None:
        return None
    rows = metadata.num_tokens
    assert rows % parts == 0
    part_rows = rows // parts
    tables = []
    for part in range(parts):
        first = part * part_rows
        tables.append(
            [
                _group_row(group, batch, kv_cache, rows, first)
                for group, batch in zip(metadata.groups, batches, strict=True)
            ]
        )
    return torch.tensor(tables, dtype=torch.int64)


@dataclass(frozen=True, eq=False)
class DecodeRows:
    """The KV group table (`group_tables`' rows) of decode rows in one full-attention group,
    made straight from their steps: a drafter's passes on the kernel read nothing else, and
    at batch 1 the attention metadata of the layer path cost about half as much as the
    drafter layer's own kernel call (~0.13 ms a pass, two passes an EAGLE-3 round)."""

    values: torch.Tensor  # int64: each row's K row, first key position, length, then pages
    rows: int
    max_pages: int

    @classmethod
    def of(
        cls, steps: Sequence[SequenceStep], block_size: int, device: torch.device | str
    ) -> DecodeRows | None:
        """The rows of `steps` (one block table each) where they run as decode rows on a CPU
        (`token_rows`), else None."""
        rows = token_rows(steps, device) if torch.device(device).type == "cpu" else None
        if not rows:
            return None
        validate_steps(rows, 1, block_size)
        tables = decode_row_tables(rows, 0, block_size, None)
        k_rows = [slot // block_size * 2 * block_size + slot % block_size for slot in tables.slots]
        values = k_rows + tables.first_key_pos + tables.seq_lens + tables.pages
        return cls(torch.tensor(values, dtype=torch.int64), len(rows), tables.max_pages)

    def tables(self, parts: int) -> torch.Tensor:
        """`group_tables`' `[parts, 1, DecodeGroup]` for `parts` equal runs of the rows,
        pointing into `values` (which the caller keeps with this object)."""
        rows, step = self.rows, torch.int64.itemsize
        assert rows % parts == 0
        k_rows = self.values.data_ptr()
        first_pos, seq_lens, pages = (k_rows + i * rows * step for i in (1, 2, 3))
        part_rows = rows // parts
        return torch.tensor(
            [
                [
                    DecodeGroup(
                        k_rows=k_rows + first * step,
                        pages=pages + first * self.max_pages * step,
                        max_pages=self.max_pages,
                        first_pos=first_pos + first * step,
                        seq_lens=seq_lens + first * step,
                        window=0,
                    )
                ]
                for first in range(0, rows, part_rows)
            ],
            dtype=torch.int64,
        )


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
    group: TorchGroupMetadata,
    batch: PaddedBatch,
    kv_cache: PagedKVCache,
    rows: int,
    first: int,
) -> DecodeGroup:
    """The group's table row from row `first` on of a step of `rows` decode rows."""
    k_rows, _ = group.kv_write_rows(kv_cache.block_size)
    for t in (k_rows, batch.k_pages, batch.first_key_pos, batch.seq_lens):
        assert t.dtype == torch.int64 and t.is_contiguous()  # built so by torch_backend
    assert k_rows.numel() == batch.seq_lens.numel() == rows
    max_pages = batch.k_pages.numel() // rows
    step = torch.int64.itemsize
    return DecodeGroup(
        k_rows=k_rows.data_ptr() + first * step,
        pages=batch.k_pages.data_ptr() + first * max_pages * step,
        max_pages=max_pages,
        first_pos=batch.first_key_pos.data_ptr() + first * step,
        seq_lens=batch.seq_lens.data_ptr() + first * step,
        window=group.sliding_window or 0,
    )


def _stack_fits(
    layers: Sequence[DecoderLayer],
    norm: RMSNorm,
    config: ModelConfig,
    dtype: torch.dtype,
    kv_cache: PagedKVCache,
) -> bool:
    dim = config.head_dim
    cache_shape = (kv_cache.num_blocks, 2, kv_cache.block_size, config.num_kv_heads, dim)
    return (
        dtype in kernels.linear_dtypes()
        and len(layers) > 0
        and dim % 2 == 0
        and config.num_heads % config.num_kv_heads == 0
        and _fits(norm.weight, dtype, config.hidden_size)
        and all(
            t.dtype == dtype and t.is_contiguous() and t.shape == cache_shape
            for t in kv_cache.layers.values()
        )
        and all(layer.attn.layer_id in kv_cache.layers for layer in layers)
    )


def _given_input_fits(attn_input: torch.Tensor, x: torch.Tensor, width: int) -> bool:
    return (
        attn_input.dtype == x.dtype
        and attn_input.device.type == "cpu"
        and attn_input.dim() == 2
        and attn_input.shape == (x.shape[0], width)
        and attn_input.is_contiguous()
    )


def _layer_row(
    layer: DecoderLayer,
    config: ModelConfig,
    dtype: torch.dtype,
    rows: int,
    qkv_in: int,
    in_place: InPlace | None = None,
) -> DecodeLayer | None:
    """The layer's addresses, or None when a weight is not in the kernel's layout, dtype or
    size (e.g. a linear without panels, or one that uses `F.linear` or oneDNN for `rows`
    rows); the parameters it points at in place (norm weights, biases) are noted in
    `in_place`.

    Submodules and parameters are read from the modules' own dicts: `nn.Module`'s attribute
    lookup would cost ~0.3 us a time, and a step reads ~400 of them."""
    modules = layer._modules
    attn, mlp = modules["attn"]._modules, modules["mlp"]._modules
    hidden, head_dim, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_width = config.num_heads * head_dim
    qkv_width = q_width + 2 * config.num_kv_heads * head_dim
    qkv, qkv_bias, qkv_narrow, qkv_bits = _linear_addresses(
        attn["qkv_proj"], dtype, rows, qkv_in, qkv_width, in_place
    )
    o, o_bias, o_narrow, o_bits = _linear_addresses(
        attn["o_proj"], dtype, rows, q_width, hidden, in_place
    )
    gate_up, gate_up_bias, gate_up_narrow, gate_up_bits = _linear_addresses(
        mlp["gate_up_proj"], dtype, rows, hidden, 2 * inter, in_place
    )
    down, down_bias, down_narrow, down_bits = _linear_addresses(
        mlp["down_proj"], dtype, rows, inter, hidden, in_place
    )
    row = DecodeLayer(
        input_norm=_norm_address(modules["input_layernorm"], dtype, hidden, in_place),
        qkv=qkv,
        qkv_bias=qkv_bias,
        q_norm=_norm_address(attn.get("q_norm"), dtype, head_dim, in_place),
        k_norm=_norm_address(attn.get("k_norm"), dtype, head_dim, in_place),
        o=o,
        o_bias=o_bias,
        post_norm=_norm_address(modules["post_attention_layernorm"], dtype, hidden, in_place),
        gate_up=gate_up,
        gate_up_bias=gate_up_bias,
        down=down,
        down_bias=down_bias,
        qkv_narrow=qkv_narrow,
        qkv_bits=qkv_bits,
        o_narrow=o_narrow,
        o_bits=o_bits,
        gate_up_narrow=gate_up_narrow,
        gate_up_bits=gate_up_bits,
        down_narrow=down_narrow,
        down_bits=down_bits,
        group=layer.group,
    )
    return None if None in row else row


def _linear_addresses(
    linear: Linear,
    dtype: torch.dtype,
    rows: int,
    in_features: int,
    out_features: int,
    in_place: InPlace | None = None,
) -> tuple[int | None, int | None, int, int]:
    """The panels, bias (0: none), narrow panels (0: none) and their kind (0: none) of a
    `Linear` that the layer path would run through the panel kernel for `rows` rows, with the
    shape the step needs; None for what does not fit."""
    packed = linear.packed
    if (
        packed is None
        or not packed.runs_panels(rows)
        or (linear.in_features, linear.out_features) != (in_features, out_features)
    ):
        return None, None, 0, 0
    depth = (in_features + 1) // 2 * 2 if dtype == torch.bfloat16 else in_features
    panels = -(-out_features // PANEL) * PANEL * depth
    bias = linear._parameters["bias"]
    narrow, bits = packed.narrow_for(rows)
    fits = (
        narrow is not None
        and dtype == torch.float32
        and _fits(narrow, torch.uint8, kernels.narrow_panels_bytes(bits, out_features, in_features))
    )
    return (
        _address(packed.tensor, dtype, panels),
        0 if bias is None else _parameter_address(linear, "bias", dtype, out_features, in_place),
        narrow.data_ptr() if fits else 0,
        bits if fits else 0,
    )


def _norm_address(
    norm: RMSNorm | None, dtype: torch.dtype, size: int, in_place: InPlace | None
) -> int | None:
    return 0 if norm is None else _parameter_address(norm, "weight", dtype, size, in_place)


def _parameter_address(
    module: nn.Module, name: str, dtype: torch.dtype, numel: int, in_place: InPlace | None
) -> int | None:
    """`_address` of a parameter the kernel reads where it is, noted with its module in
    `in_place` (a table holds while it stays there: `LayerStack.current`)."""
    address = _address(module._parameters[name], dtype, numel)
    if address is not None and in_place is not None:
        in_place.append((module, name, address))
    return address


def _address(tensor: torch.Tensor | None, dtype: torch.dtype, numel: int) -> int | None:
    """`tensor`'s address when it holds `numel` contiguous CPU values of `dtype`, else None."""
    return tensor.data_ptr() if _fits(tensor, dtype, numel) else None


def _fits(tensor: torch.Tensor | None, dtype: torch.dtype, numel: int) -> bool:
    return (
        tensor is not None
        and tensor.dtype == dtype
        and tensor.is_cpu
        and tensor.numel() == numel
        and tensor.is_contiguous()
    )
