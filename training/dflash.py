"""DFlash training: many draft blocks per sequence in one pass, as serving runs each one.

Serving (`worker/spec_decode/speculators.py`) drafts a block `[last token, MASK x K]` at
positions `a..a+K` (a: the newest token's position) whose queries see the context K/V of every
position before `a` (the target's fused features through `fc`, `hidden_norm`, the layer's k/v
projections and `k_norm`, with no `input_layernorm`) and the whole block, both ways; mask row j
predicts the token at `a + j` through the target's LM head.

Training samples anchors `a` among a sequence's response positions and runs all their blocks
together: the queries of a block see context keys `< a` and their own block only. The loss is
the cross entropy of mask row j against token `a + j` (the target's greedy token), weighted
`exp(-(j - 1) / gamma)` so early rows, which decide how much of a block is accepted, count
most (DFlash's position-decayed loss), averaged over the weights.

Parameter names are those of z-lab's `DFlashDraftModel` checkpoints (`layers.*` in Qwen3 style
with q/k norms, `fc`, `hidden_norm`, `norm`), the format vLLM, SGLang and
`worker/spec_decode/dflash.py` load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.training.layers import MLP, RMSNorm, SelfAttention, init_weights
from specserve.worker.model_config import ModelConfig
from specserve.worker.models import apply_rope, rope_cos_sin, rope_inv_freq


@dataclass(frozen=True)
class BlockStats:
    """Per mask row j = 1..K: loss rows and rows whose argmax was the target's token."""

    rows: list[int]
    correct: list[int]
    weight: float  # the sum of loss weights (the sequence's share of the mean)


class DFlashLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, hidden, qk_norm=True)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp = MLP(hidden, config.intermediate_size)


class DFlashTrainee(nn.Module):
    """The trainable DFlash drafter plus the frozen target parts its loss needs."""

    def __init__(
        self,
        config: ModelConfig,
        num_layers: int,
        num_aux_layers: int,
        mask_token_id: int,
        block_size: int,
        target_embed: torch.Tensor,
        target_head: torch.Tensor,
        decay_gamma: float,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(num_aux_layers * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(num_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        init_weights(self)
        self.mask_token_id = mask_token_id
        self.block_size = block_size
        self.decay_gamma = decay_gamma
        # frozen and never saved; buffers so that `.to(device)` moves them with the drafter
        self.register_buffer("target_embed", target_embed.detach().float(), persistent=False)
        self.register_buffer("target_head", target_head.detach().float(), persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def row_weights(self) -> torch.Tensor:
        """Loss weight of mask rows 1..B-1."""
        j = torch.arange(1, self.block_size, dtype=torch.float32, device=self.inv_freq.device)
        return torch.exp(-(j - 1) / self.decay_gamma)

    def sequence_loss(
        self,
        tokens: torch.Tensor,
        aux: torch.Tensor,
        prompt_len: int,
        max_anchors: int,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, BlockStats] | None:
        """`batch_loss` of one sequence (`tokens [n]`, `aux [n, A]`)."""
        result = self.batch_loss(
            tokens[None], aux[None], [prompt_len], [tokens.shape[0]], max_anchors, generator
        )
        if result is None:
            return None
        loss, stats, weight = result
        rows, correct = stats.tolist()
        return loss, BlockStats([int(r) for r in rows], [int(c) for c in correct], float(weight))

    def batch_loss(
        self,
        tokens: torch.Tensor,
        aux: torch.Tensor,
        prompt_lens: Sequence[int],
        lengths: Sequence[int],
        max_anchors: int,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Weighted cross entropy (summed; divide by the weight summed over a batch) of up to
        `max_anchors` random blocks of each sequence of a padded batch (`tokens [B, L]`,
        `aux [B, L, A]`, sequence b holding `lengths[b]` tokens), the per-row stats as a
        `[2, K]` tensor (loss rows, hits) and the weight; None when no sequence has a
        response. Anchors are drawn on the host, sequence after sequence, so a batch draws
        what its sequences would one by one."""
        picked = [
            _sample_anchors(p, n, max_anchors, generator)
            for p, n in zip(prompt_lens, lengths, strict=True)
        ]
        kept = [i for i, a in enumerate(picked) if a is not None]
        chosen = [a for a in picked if a is not None]
        if not chosen:
            return None
        device = tokens.device
        batch, most = len(chosen), max(a.numel() for a in chosen)
        anchors = torch.zeros(batch, most, dtype=torch.int64)
        real = torch.zeros(batch, most, dtype=torch.bool)
        for row, a in enumerate(chosen):
            anchors[row, : a.numel()], real[row, : a.numel()] = a, True
        context_len = int(anchors.max())  # read on the host, before the anchors move
        tokens, aux = tokens[kept], aux[kept, :context_len]
        anchors, real = anchors.to(device), real.to(device)
        n = torch.tensor([lengths[i] for i in kept], device=device)
        b = self.block_size
        offsets = torch.arange(b, device=device)
        positions = (anchors[:, :, None] + offsets).reshape(-1)  # [B * M * b]
        block_ids = torch.full((batch, most, b), self.mask_token_id, device=device)
        block_ids[:, :, 0] = tokens.gather(1, anchors)
        x = self.target_embed[block_ids.reshape(-1)]
        context = self.hidden_norm(self.fc(aux.flatten(0, 1)))  # [B * C, H]
        context_pos = torch.arange(context_len, device=device).repeat(batch)
        mask = _block_mask(anchors, context_len, b)
        for layer in self.layers:
            x = x + self._attend(layer, x, positions, context, context_pos, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        hidden = self.norm(x).view(batch, most, b, -1)[:, :, 1:]  # mask rows
        logits = F.linear(hidden.flatten(0, 2), self.target_head).float()
        label_pos = anchors[:, :, None] + offsets[1:]  # [B, M, b - 1]
        valid = (label_pos < n[:, None, None]) & real[:, :, None]
        width = tokens.shape[1]
        labels = tokens.gather(1, label_pos.clamp(max=width - 1).flatten(1)).view_as(label_pos)
        weights = self.row_weights() * valid
        row_loss = F.cross_entropy(logits, labels.flatten(), reduction="none")
        loss = (row_loss * weights.flatten()).sum()
        with torch.no_grad():
            hits = (logits.argmax(-1).view_as(labels) == labels) & valid
            stats = torch.stack([valid.sum((0, 1)).float(), hits.sum((0, 1)).float()])
        return loss, stats, weights.sum().detach()

    def _attend(
        self,
        layer: DFlashLayer,
        x: torch.Tensor,
        positions: torch.Tensor,
        context: torch.Tensor,
        context_pos: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """`x [B * Q, H]` (Q block rows per sequence), `context [B * C, H]`, `mask
        [B, Q, C + Q]`."""
        attn = layer.self_attn
        batch, queries, context_len = mask.shape[0], mask.shape[1], mask.shape[2] - mask.shape[1]
        h = layer.input_layernorm(x)
        cos, sin = rope_cos_sin(self.inv_freq, positions, h.dtype)
        ccos, csin = rope_cos_sin(self.inv_freq, context_pos, h.dtype)
        q = apply_rope(attn.queries(h), cos, sin)
        k_block, v_block = attn.keys_values(h)
        k_ctx, v_ctx = attn.keys_values(context)

        def heads(t: torch.Tensor, length: int) -> torch.Tensor:  # [B * T, h, D] -> [B, h, T, D]
            return t.view(batch, length, *t.shape[1:]).transpose(1, 2)

        k = torch.cat(
            [heads(apply_rope(k_ctx, ccos, csin), context_len),
             heads(apply_rope(k_block, cos, sin), queries)], dim=2
        )  # fmt: skip
        v = torch.cat([heads(v_ctx, context_len), heads(v_block, queries)], dim=2)
        group = attn.num_heads // attn.num_kv_heads
        out = F.scaled_dot_product_attention(
            heads(q, queries),
            k.repeat_interleave(group, dim=1),
            v.repeat_interleave(group, dim=1),
            attn_mask=mask[:, None],
            scale=attn.scale,
        )
        return attn.o_proj(out.transpose(1, 2).reshape(batch * queries, -1))


def _sample_anchors(
    prompt_len: int, n: int, max_anchors: int, generator: torch.Generator
) -> torch.Tensor | None:
    """Distinct anchors among the response positions that have a next token, sorted."""
    first, last = max(prompt_len, 1), n - 2  # the anchor token's successor must exist
    count = last - first + 1
    if count <= 0:
        return None
    pick = torch.randperm(count, generator=generator)[: min(max_anchors, count)]
    return (pick + first).sort().values


def _block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """`[B, M*b, context + M*b]` booleans: a block's rows see context `< anchor` and their
    block (a padding anchor, 0, sees its block alone)."""
    device = anchors.device
    m = anchors.shape[1]
    rows = torch.arange(m, device=device).repeat_interleave(block_size)
    sees_context = torch.arange(context_len, device=device) < anchors[:, rows, None]
    sees_block = (rows[:, None] == rows[None, :]).expand(anchors.shape[0], -1, -1)
    return torch.cat([sees_context, sees_block], dim=2)


def default_decay_gamma(block_size: int) -> float:
    """DFlash's decay: gamma 7 for blocks of 16, scaled with the block length."""
    return max(1.0, 7.0 * (block_size - 1) / 15)
