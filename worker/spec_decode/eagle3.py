"""EAGLE-3 drafter: a shallow autoregressive decoder fed with fused target hidden states.

Per step the runner (1) captures the target's hidden states at `aux_layer_ids(L)`, (2) fuses
them with `combine_hidden_states` (`fc`: `[T, n*H_t] -> [T, H]`), (3) runs `forward` over the
target's rows with ids shifted left by one (row at position i consumes token i+1 and the
target feature of row i) and writes the drafter's K/V at the target's slots, then (4) loops
K-1 single-token steps feeding back the `prenorm` output as the next hidden state.

Model. Layer 0 attends over `cat(input_layernorm(embeds), hidden_norm(hidden))`, so its
q/k/v projections read 2H features; its residual is `hidden` (or `hidden_norm(hidden)` with
`norm_before_residual`). Further layers, if any, are standard decoder layers. The output is
`(norm(h), h)`.

Vocabulary. A reduced draft vocabulary (`draft_vocab_size < target vocab`) comes with its
own `lm_head [draft_vocab, H]` and a `d2t` offset table: target_id = draft_id + d2t[draft_id].
`compute_logits` scatters draft logits into a `-inf` target-vocab tensor, so the sampler and
the rejection sampler only ever see target ids. Embeddings (and, for a full draft vocab, the
LM head) come from the target when the checkpoint has none.

Aux layer ids. EAGLE-3 checkpoints number aux layers as "input of decoder layer i" (vLLM's
convention); specserve's `forward_with_aux` captures "output of decoder layer i". Hence
ours = checkpoint id - 1, and the checkpoint default (2, L//2, L-3) becomes (1, L//2-1, L-4).

Checkpoint formats (both accepted):
* `LlamaForCausalLMEagle3` (EAGLE authors' releases): Llama fields at the top level plus
  `draft_vocab_size`, optional `target_hidden_size`, `norm_before_residual`, and aux ids in
  `eagle_config.eagle_aux_hidden_state_layer_ids` or top-level
  `eagle_aux_hidden_state_layer_ids`. Tensors `midlayer.*` (layer 0), `fc.weight`,
  `norm.weight`, `lm_head.weight`, `d2t`, `t2d` (unused).
* speculators (`speculators_model_type: "eagle3"`): layer fields in
  `transformer_layer_config`; `draft_vocab_size`, `target_hidden_size`,
  `norm_before_residual`, `eagle_aux_hidden_state_layer_ids` (or `aux_hidden_state_layer_ids`)
  at the top level. Tensors `layers.0.*`, `fc.weight`, `norm.weight`, `lm_head.weight`,
  optional `embed_tokens.weight`, `d2t`, `t2d`.
Both prefixes (`midlayer.`, `layers.0.`) and an optional leading `model.` load either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from specserve.worker.attention.base import AttentionBackend, AttentionMetadata, SequenceStep
from specserve.worker.cpu import fused_decode, kernels
from specserve.worker.cpu.greedy_screen import GreedyScreen, ScreenCache
from specserve.worker.cpu.linear import Linear
from specserve.worker.kv_cache import PagedKVCache, kv_write_rows
from specserve.worker.loader import assign_weights, map_decoder_layer
from specserve.worker.model_config import ModelConfig
from specserve.worker.models import (
    DecoderLayer,
    DecoderModel,
    RMSNorm,
    RopeTables,
    rope_inv_freq,
)
from specserve.worker.sampler import argmax_rows
from specserve.worker.spec_decode.drafter import (
    DraftAttentionMetadata,
    HiddenStateDrafter,
    LayerAttention,
    TargetParts,
    TensorSource,
    build_draft_metadata,
    int_tuple,
    layer_config,
    placement,
    read_config,
    read_tensors,
)

Eagle3Style = Literal["eagle3", "speculators"]
_EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def default_checkpoint_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's default aux layers for EAGLE-3, in checkpoint ("input of layer i") convention."""
    L = num_target_layers
    return (2, L // 2, L - 3)


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the drafter's decoder layers (Llama style, or Qwen3 with q/k norm)
    style: Eagle3Style
    draft_vocab_size: int | None  # None: the target's vocabulary
    target_hidden_size: int | None
    norm_before_residual: bool
    checkpoint_aux_layer_ids: tuple[int, ...] | None  # "input of layer i"; None = default

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Eagle3Config:
        """Parse either checkpoint format; ValueError for anything else or unsupported."""
        archs = list(hf.get("architectures") or [])
        eagle_cfg = dict(hf.get("eagle_config") or {})
        style: Eagle3Style
        if "speculators_model_type" in hf or "transformer_layer_config" in hf:
            kind = hf.get("speculators_model_type")
            if kind != "eagle3":
                raise ValueError(f"speculators model type {kind!r} is not an EAGLE-3 drafter")
            fields = hf.get("transformer_layer_config")
            if not isinstance(fields, Mapping):
                raise ValueError("speculators EAGLE-3 config needs a transformer_layer_config")
            style, arch = "speculators", None
            ids = hf.get("eagle_aux_hidden_state_layer_ids") or hf.get("aux_hidden_state_layer_ids")
        elif any(a in _EAGLE3_ARCHITECTURES for a in archs):
            fields, style, arch = hf, "eagle3", "LlamaForCausalLM"
            ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or hf.get(
                "eagle_aux_hidden_state_layer_ids"
            )
        else:
            raise ValueError(
                f"not an EAGLE-3 config: architectures={archs}, expected one of "
                f"{list(_EAGLE3_ARCHITECTURES)} or speculators_model_type='eagle3'"
            )
        if not eagle_cfg.get("use_aux_hidden_state", True):
            raise ValueError("EAGLE-3 with use_aux_hidden_state=false (EAGLE-1 style input)")
        if hf.get("norm_before_fc"):
            raise ValueError("EAGLE-3 with norm_before_fc=true is not supported")
        layer = layer_config(fields, arch, "EAGLE-3")
        draft_vocab = hf.get("draft_vocab_size") or layer.vocab_size or None
        target_hidden = hf.get("target_hidden_size")
        return cls(
            layer=layer,
            style=style,
            draft_vocab_size=None if draft_vocab is None else int(draft_vocab),
            target_hidden_size=None if target_hidden is None else int(target_hidden),
            norm_before_residual=bool(hf.get("norm_before_residual", False)),
            checkpoint_aux_layer_ids=None
            if ids is None
            else int_tuple(ids, "eagle_aux_hidden_state_layer_ids"),
        )

    def aux_layer_ids(self, num_target_layers: int) -> list[int]:
        """Target layers whose outputs feed `fc`, in specserve's "output of layer i" convention.

        Checkpoint ids mean "input of layer i" = output of layer i-1, so ours = id - 1. Valid
        checkpoint ids are 1..L (id L is the last layer's output before the final norm); id 0
        would be the embedding output, which `forward_with_aux` does not capture.
        """
        L = num_target_layers
        ids = self.checkpoint_aux_layer_ids or default_checkpoint_aux_layer_ids(L)
        bad = [i for i in ids if not 1 <= i <= L]
        if bad:
            raise ValueError(
                f"EAGLE-3 aux layer ids {bad} (checkpoint convention: input of layer i) are out "
                f"of range 1..{L} for a {L}-layer target"
            )
        return [i - 1 for i in ids]


class Eagle3FirstLayer(DecoderLayer):
    """Decoder layer 0: attention over `[input_layernorm(embeds), hidden_norm(hidden)]`."""

    def __init__(
        self,
        config: ModelConfig,
        norm_before_residual: bool,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        # q/k/v read 2H features (embeds ++ hidden); the MLP and the residual stay H wide.
        hidden = config.hidden_size
        super().__init__(config, 0, 0, backend, dtype, device, attn_in_features=2 * hidden)
        self.norm_before_residual = norm_before_residual
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps, dtype, device)

    def forward(  # type: ignore[override]
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        x, normed_hidden = self.attention_input(embeds, hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        h = residual + self.attn(x, cos, sin, self.group, metadata, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    def attention_input(
        self, embeds: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What q/k/v read, `[input_layernorm(embeds), hidden_norm(hidden)]`, and the normed
        hidden state (the residual when `norm_before_residual`)."""
        normed_hidden = self.hidden_norm(hidden)
        return torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1), normed_hidden


class Eagle3Drafter(HiddenStateDrafter[Eagle3Config]):
    """Built by `load_eagle3`; holds only the drafter's own weights (see `TargetParts`)."""

    def __init__(
        self,
        config: Eagle3Config,
        target: TargetParts,
        fc_in_features: int,
        fc_bias: bool,
        own_embed_tokens: bool,
        own_lm_head: bool,
        draft_vocab_size: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__(config, target, backend)
        layer = config.layer
        hidden = layer.hidden_size
        self.fc = Linear(fc_in_features, hidden, fc_bias, device, dtype)
        self.layers = nn.ModuleList(
            [Eagle3FirstLayer(layer, config.norm_before_residual, backend, dtype, device)]
            + [
                DecoderLayer(layer, i, 0, backend, dtype, device)
                for i in range(1, layer.num_layers)
            ]
        )
        self.norm = RMSNorm(hidden, layer.rms_norm_eps, dtype, device)
        self.embed_tokens: nn.Embedding | None = None
        if own_embed_tokens:
            self.embed_tokens = nn.Embedding(target.vocab_size, hidden, device=device, dtype=dtype)
        self.lm_head: Linear | None = None
        if own_lm_head:
            self.lm_head = Linear(hidden, draft_vocab_size, False, device, dtype)
        # Not buffers: built on the meta device and loaded with `assign=True` (as the target).
        self.inv_freq = rope_inv_freq(layer)
        self.rope = RopeTables()
        self.draft_to_target: torch.Tensor | None = None  # [draft_vocab] target ids
        self._draft_ids_rise = False  # draft_to_target is increasing (see `greedy_drafts`)
        self._head_screen = ScreenCache()  # the draft head's (`greedy_drafts`)

    def aux_layer_ids(self, num_target_layers: int | None = None) -> list[int]:
        """Target layers to capture (output of layer i); see `Eagle3Config.aux_layer_ids`."""
        return self.config.aux_layer_ids(num_target_layers or self.target.num_layers)

    def build_attn_metadata(
        self, steps: Sequence[SequenceStep], block_size: int, device: torch.device | str
    ) -> DraftAttentionMetadata:
        """Causal metadata for all layers; each step carries the target's full-attention table."""
        kinds = [LayerAttention(causal=True)] * self.num_layers
        return build_draft_metadata(self.backend, steps, kinds, block_size, device)

    @torch.no_grad()
    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """`[T, n*H_t]` concatenated aux hidden states (in `aux_layer_ids` order) -> `[T, H]`."""
        if aux.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"EAGLE-3 fc expects {self.fc.in_features} features (aux layers x target "
                f"hidden), got {aux.shape[-1]}"
            )
        return self.fc(aux.to(self.dtype))

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embed = self.embed_tokens if self.embed_tokens is not None else self.target.embed_tokens
        return embed(input_ids).to(self.dtype)

    @property
    def context_rows_are_kv(self) -> bool:
        """One layer: what a row whose output nobody reads leaves behind is its K/V alone
        (`write_context_kv`); a deeper layer's K/V would need the layers below it."""
        return self.num_layers == 1

    @torch.no_grad()
    def write_context_kv(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: PagedKVCache,
    ) -> None:
        """The K/V `forward` would write for these rows (one-layer drafters only), without
        computing their outputs: a catch-up over rows put aside needs nothing else."""
        if not self.context_rows_are_kv:
            raise ValueError(f"context K/V alone needs a one-layer drafter ({self.num_layers})")
        first = self.layers[0]
        x, _ = first.attention_input(self.embed(input_ids), hidden.to(self.dtype))
        cos, sin = self.rope(self.inv_freq, positions, self.dtype)
        rows = kv_write_rows(slot_mapping, kv_cache.block_size)
        first.attn.write_context_kv(x, cos, sin, kv_cache, rows)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: DraftAttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(normed, prenorm)`, both `[T, H]`: logits come from `normed`; `prenorm` is the
        `hidden` input of the next autoregressive step. Writes K/V of all T rows."""
        num_tokens = input_ids.shape[0]
        if not num_tokens == hidden.shape[0] == positions.shape[0] == attn_metadata.num_tokens:
            raise ValueError(
                f"EAGLE-3 forward: {num_tokens} ids, {hidden.shape[0]} hidden rows, "
                f"{positions.shape[0]} positions, metadata for {attn_metadata.num_tokens} tokens"
            )
        cos, sin = self.rope(self.inv_freq, positions, self.dtype)
        first, *rest = self.layers
        embeds, hidden = self.embed(input_ids), hidden.to(self.dtype)
        fused = self._one_call(embeds, hidden, cos, sin, attn_metadata, kv_cache)
        if fused is not None:
            return fused
        metas = attn_metadata.per_layer
        x = first(embeds, hidden, cos, sin, metas[0], kv_cache)
        for layer, meta in zip(rest, metas[1:], strict=True):
            x = layer(x, cos, sin, meta, kv_cache)
        return self.norm(x), x

    def _one_call(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: DraftAttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`forward`'s layers in one call to the CPU kernels where the step fits them (one
        query a row, as a one-token draft step; panel weights): the same results bit for bit,
        without a dispatch, an allocation and a thread wake-up for each of a layer's ~12 small
        ops (about half of an EAGLE-3 draft step's time at batch 1 went to them)."""
        if hidden.device.type != "cpu":
            return None
        groups = self._decode_groups(attn_metadata, kv_cache, 1)  # None: e.g. a prompt chunk
        if groups is None:
            return None
        stack = self._stack(embeds.shape[0], kv_cache)
        if stack is None:
            return None
        return self._stack_step(stack, embeds, hidden, cos, sin, groups[0])

    def _decode_groups(
        self, attn_metadata: DraftAttentionMetadata, kv_cache: PagedKVCache, parts: int
    ) -> torch.Tensor | None:
        """The kernel's KV group tables of `parts` equal runs of the rows (`group_tables`),
        from the steps where the metadata has them (`decode_rows`), else from the layers'
        metadata; None where the rows are not decode rows of one metadata for every layer."""
        if attn_metadata.decode_rows is not None:
            return attn_metadata.decode_rows.tables(parts)
        metas = attn_metadata.per_layer
        if any(meta is not metas[0] for meta in metas):
            return None
        return fused_decode.group_tables(metas[0], kv_cache, parts)

    def _stack(self, rows: int, kv_cache: PagedKVCache) -> fused_decode.LayerStack | None:
        """The layers for the CPU kernels at `rows` rows, the first reading `attention_input`."""
        config = self.config.layer
        return fused_decode.stack_for(
            self.layers, self.norm, config, self.dtype, rows, kv_cache, 2 * config.hidden_size
        )

    def _stack_step(
        self,
        stack: fused_decode.LayerStack,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        groups: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(normed, prenorm)` of one step through `stack` (None where its inputs do not fit)."""
        first = self.layers[0]
        attn_input, normed_hidden = first.attention_input(embeds, hidden)
        # The kernel adds each layer's output into the residual stream in place.
        x = (normed_hidden if first.norm_before_residual else hidden).clone(
            memory_format=torch.contiguous_format
        )
        if not stack.takes(x, cos, sin, attn_input):
            return None
        normed, _ = stack.run(x, cos, sin, groups, attn_input=attn_input)
        return normed, x

    @torch.no_grad()
    def greedy_chain(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        steps: Sequence[SequenceStep],
        kv_cache: PagedKVCache,
    ) -> list[torch.Tensor] | None:
        """Greedy drafts of the next depths for `rows = tokens.shape[0]` requests, given each
        one's last draft (`tokens`) and the pre-norm state that drafted it (`hidden`):
        `steps` are the depths' one-token steps, depth by depth (`len(steps) // rows` of them,
        each request's rows in `tokens`' order). Each depth is `forward` then `greedy_drafts`,
        bit for bit; the metadata, the RoPE tables and the layer table are made once for the
        chain. Where the draft head has its own vocabulary read without a screen (a bfloat16
        drafter's), every depth runs in one C call (`LayerStack.run_chain`: at batch 1, K=3,
        a round's proposing 2.62 -> 1.93 ms on a 2-core Zen 4, docs/benchmarks.md), else a
        kernel call a depth with the head and the next embeddings between. None where the
        chain does not fit the CPU kernels (nothing written): the caller steps depth by
        depth."""
        rows = tokens.shape[0]
        if (
            hidden.device.type != "cpu"
            or not rows
            or len(steps) % rows
            or any(step.query_len != 1 for step in steps)
        ):
            return None
        metadata = self.build_attn_metadata(steps, kv_cache.block_size, hidden.device)
        depths = len(steps) // rows
        groups = self._decode_groups(metadata, kv_cache, depths)
        if groups is None:
            return None
        stack = self._stack(rows, kv_cache)
        if stack is None:
            return None
        positions = torch.tensor([step.seq_len - 1 for step in steps])
        cos, sin = self.rope(self.inv_freq, positions, self.dtype)
        chain = self._chain_table(stack, depths)
        if chain is not None and hidden.shape == (rows, self.config.layer.hidden_size):
            x = hidden.to(self.dtype).clone(memory_format=torch.contiguous_format)
            return list(stack.run_chain(x, tokens.contiguous(), cos, sin, groups, chain))
        drafts = []
        for depth in range(depths):
            part = slice(depth * rows, (depth + 1) * rows)
            step = self._stack_step(
                stack,
                self.embed(tokens),
                hidden.to(self.dtype),
                cos[part],
                sin[part],
                groups[depth],
            )
            if step is None:
                if depth:
                    raise RuntimeError("EAGLE-3 draft chain: a depth's inputs no longer fit")
                return None
            normed, hidden = step
            tokens = self.greedy_drafts(normed)
            drafts.append(tokens)
        return drafts

    def _chain_table(
        self, stack: fused_decode.LayerStack, depths: int
    ) -> kernels.DraftChain | None:
        """The table of `depths` depths for the draft chain's one C call on `stack`, where
        each depth's `greedy_drafts` is the draft head's argmax mapped to target ids (None
        where it reads a screen or the whole vocabulary, or a part does not fit the kernel)."""
        ids = self.draft_to_target
        if self.lm_head is None or ids is None or not self._draft_ids_rise:
            return None
        if self.head_screen() is not None:
            return None
        embed = self.embed_tokens if self.embed_tokens is not None else self.target.embed_tokens
        first = self.layers[0]
        return stack.chain_table(
            depths,
            self.lm_head,
            embed.weight,
            first.input_layernorm,
            first.hidden_norm,
            first.norm_before_residual,
            ids,
        )

    @torch.no_grad()
    def greedy_drafts(self, normed: torch.Tensor) -> torch.Tensor:
        """Each row's `compute_logits` argmax. With a reduced draft vocabulary whose target ids
        rise with the draft ids (as `d2t` is written), the argmax of the draft logits alone,
        mapped: the same token, first index on ties, without filling and scanning the full
        vocabulary's row (49,152 values a row for 8,192 logits). A float32 draft head is read
        through its screen where that pays (`cpu.greedy_screen`: the same argmax from an int8
        or bfloat16 copy; the bundled drafter's 19 MB head a quarter of it on AVX2)."""
        ids = self.draft_to_target
        if self.lm_head is None or ids is None or not self._draft_ids_rise:
            return argmax_rows(self.compute_logits(normed))
        screen = self.head_screen()
        best = screen.argmax(normed) if screen is not None else None
        return ids[best if best is not None else argmax_rows(self.lm_head(normed))]

    def head_screen(self) -> GreedyScreen | None:
        """The own draft head's screen, made for its current packing (None where the head is
        not a float32 one packed as panels)."""
        return self._head_screen.get(self.lm_head.packed if self.lm_head is not None else None)

    @torch.no_grad()
    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """`[N, H]` -> `[N, target_vocab]`; ids outside a reduced draft vocab get `-inf`."""
        if self.lm_head is None:
            return self.target.compute_logits(normed)
        logits = self.lm_head(normed)
        if self.draft_to_target is None:
            return logits
        full = logits.new_full((logits.shape[0], self.target.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = logits
        return full


def load_eagle3(
    path: str | Path,
    target: DecoderModel,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    backend: AttentionBackend | None = None,
) -> Eagle3Drafter:
    """Load an EAGLE-3 checkpoint (either format) for `target`.

    dtype, device and backend default to the target's.
    """
    path = Path(path)
    config = Eagle3Config.from_hf(read_config(path))
    tensors = TensorSource(read_tensors(path), "EAGLE-3", {"midlayer.": "layers.0."})
    return build_eagle3(config, tensors, target, dtype, device, backend)


def build_eagle3(
    config: Eagle3Config,
    tensors: TensorSource,
    target: DecoderModel,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    backend: AttentionBackend | None = None,
) -> Eagle3Drafter:
    """Check the checkpoint against the config and the target, then build the drafter."""
    dtype, device = placement(target, dtype, device)
    parts = TargetParts.of(target)
    layer = config.layer
    hidden, vocab = layer.hidden_size, parts.vocab_size
    draft_vocab = config.draft_vocab_size or vocab
    _check_sizes(config, parts)
    take = tensors.take
    fc_in = len(config.aux_layer_ids(parts.num_layers)) * parts.hidden_size
    weights = {"fc.weight": take("fc.weight", hidden, fc_in)}
    fc_bias = "fc.bias" in tensors
    if fc_bias:
        weights["fc.bias"] = take("fc.bias", hidden)
    for i in range(layer.num_layers):
        prefix = f"layers.{i}."
        weights.update(
            map_decoder_layer(layer, take, prefix, prefix, 2 * hidden if i == 0 else None)
        )
    weights["layers.0.hidden_norm.weight"] = take("layers.0.hidden_norm.weight", hidden)
    weights["norm.weight"] = take("norm.weight", hidden)

    own_lm_head = "lm_head.weight" in tensors
    if own_lm_head:
        weights["lm_head.weight"] = take("lm_head.weight", draft_vocab, hidden)
    elif draft_vocab != vocab or hidden != parts.hidden_size:
        raise ValueError(
            "EAGLE-3 checkpoint is missing tensor 'lm_head.weight' (needed: its draft vocab "
            f"{draft_vocab} or hidden size {hidden} differs from the target's "
            f"{vocab} / {parts.hidden_size}, so the target's LM head cannot be shared)"
        )
    draft_to_target = None
    if draft_vocab != vocab or "d2t" in tensors:
        if "d2t" not in tensors:
            raise ValueError(
                f"EAGLE-3 draft vocab {draft_vocab} < target vocab {vocab} needs a "
                "'d2t' tensor in the checkpoint"
            )
        draft_to_target = _draft_to_target(take("d2t", draft_vocab), vocab)

    own_embed = "embed_tokens.weight" in tensors
    if own_embed:
        embed = take("embed_tokens.weight", vocab, hidden)
        own_embed = not _same_as_target(embed, target.embed_tokens.weight)
        if own_embed:
            weights["embed_tokens.weight"] = embed
    if not own_embed and hidden != parts.hidden_size:
        raise ValueError(
            f"EAGLE-3 hidden size {hidden} differs from the target's {parts.hidden_size}, so it "
            "cannot share the target's embeddings; the checkpoint needs embed_tokens.weight"
        )
    tensors.check_all_used()

    model = Eagle3Drafter(
        config,
        parts,
        fc_in,
        fc_bias,
        own_embed,
        own_lm_head,
        draft_vocab,
        backend or target.backend,
        dtype,
        device="meta",
    )
    model = assign_weights(model, weights, dtype, device)
    if draft_to_target is not None:
        model.draft_to_target = draft_to_target.to(device)
        model._draft_ids_rise = bool((draft_to_target[1:] > draft_to_target[:-1]).all())
    model.head_screen()  # made at load, not in the first step
    return model


def _check_sizes(config: Eagle3Config, target: TargetParts) -> None:
    layer = config.layer
    vocab = target.vocab_size
    if config.target_hidden_size not in (None, target.hidden_size):
        raise ValueError(
            f"EAGLE-3 target_hidden_size {config.target_hidden_size} != target hidden size "
            f"{target.hidden_size}"
        )
    if layer.vocab_size not in (0, vocab):
        raise ValueError(f"EAGLE-3 vocab_size {layer.vocab_size} != target vocab size {vocab}")
    if config.draft_vocab_size is not None and not 0 < config.draft_vocab_size <= vocab:
        raise ValueError(
            f"EAGLE-3 draft_vocab_size {config.draft_vocab_size} must be in 1..{vocab}"
        )


def _draft_to_target(d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """Absolute target ids from `d2t` offsets, checked to be in range and distinct."""
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise ValueError(f"EAGLE-3 d2t must hold integer offsets, got {d2t.dtype}")
    ids = torch.arange(d2t.shape[0], dtype=torch.int64) + d2t.to(torch.int64)
    if bool(((ids < 0) | (ids >= vocab)).any()):
        raise ValueError(f"EAGLE-3 d2t maps draft ids outside the target vocab 0..{vocab - 1}")
    if ids.unique().numel() != ids.numel():
        raise ValueError("EAGLE-3 d2t maps two draft ids to the same target id")
    return ids


def _same_as_target(weight: torch.Tensor, target_weight: torch.Tensor) -> bool:
    """Share a saved copy of the target's embeddings instead of holding a duplicate."""
    if weight.shape != target_weight.shape:
        return False
    return torch.equal(weight.to(target_weight.device, target_weight.dtype), target_weight)
