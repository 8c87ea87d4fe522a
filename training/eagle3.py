"""EAGLE-3 training: the drafter unrolled on its own outputs ("training-time test").

Serving (`worker/spec_decode/speculators.py`) runs the drafter like this: row p reads token
p+1 and the fused target features of row p, at position p, and predicts token p+2; then each
further draft step feeds back the drafter's own pre-norm output as the hidden input, with the
token it just proposed, one position further on, attending to the context K/V (computed from
target features) and to the K/V of the earlier steps of its own chain.

Training reproduces exactly that over whole sequences. Step 0 runs every row with target
features (causal attention over step-0 keys). Step j runs row p at position p+j with the
step-(j-1) output of row p as hidden input and token p+1+j as input id (the target's own
greedy token, i.e. what the drafter proposes whenever its chain is still accepted); its query
sees step-0 keys of rows <= p and the keys of row p at steps 1..j. The loss of step j at row p
is the cross entropy against the target's distribution at position p+1+j over the draft
vocabulary, counted where token p+2+j is a response token whose target argmax the draft
vocabulary holds; steps are weighted 0.8^j (EAGLE-3's schedule). Accuracy counts every response
token, those outside the draft vocabulary as misses, since serving never accepts them.

Parameter names are those of `LlamaForCausalLMEagle3` checkpoints (`midlayer.*`, `fc`, `norm`,
`lm_head`, `d2t`, `t2d`), the format vLLM, SGLang and `worker/spec_decode/eagle3.py` load.
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

STEP_WEIGHT = 0.8  # loss weight of TTT step j: STEP_WEIGHT ** j


@dataclass(frozen=True)
class StepStats:
    """Per TTT step: response rows, summed loss over the loss rows (those whose label the
    draft vocabulary holds), loss rows, and rows whose argmax matched the target's."""

    rows: list[int]
    loss: list[float]
    correct: list[int]
    loss_rows: list[int]


class Eagle3FirstLayer(nn.Module):
    """The EAGLE-3 decoder layer: attention reads `[input_layernorm(embeds), hidden_norm(h)]`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, 2 * hidden, qk_norm=False)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp = MLP(hidden, config.intermediate_size)


class Eagle3Trainee(nn.Module):
    """The trainable EAGLE-3 drafter plus the frozen target parts its loss needs."""

    def __init__(
        self,
        config: ModelConfig,
        num_aux_layers: int,
        draft_ids: torch.Tensor,
        target_embed: torch.Tensor,
        target_head: torch.Tensor,
    ) -> None:
        """`config`: the drafter layer's geometry (the target's); `draft_ids`: the target ids
        of the draft vocabulary, ascending; `target_embed`/`target_head`: the target's input
        embeddings and LM head weight (frozen; shared, never saved)."""
        super().__init__()
        hidden = config.hidden_size
        self.config = config
        self.fc = nn.Linear(num_aux_layers * hidden, hidden, bias=False)
        self.midlayer = Eagle3FirstLayer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_ids.numel(), bias=False)
        init_weights(self)
        head_rows = target_head[draft_ids].detach().float()  # the target's, for the draft vocab
        with torch.no_grad():  # a strong start
            self.lm_head.weight.copy_(head_rows)
        t2d = torch.zeros(target_embed.shape[0], dtype=torch.bool)
        t2d[draft_ids] = True
        self.register_buffer("d2t", draft_ids - torch.arange(draft_ids.numel()))
        self.register_buffer("t2d", t2d)
        # frozen and never saved; buffers so that `.to(device)` moves them with the drafter
        self.register_buffer("target_embed", target_embed.detach().float(), persistent=False)
        self.register_buffer("target_head_draft", head_rows, persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def sequence_loss(
        self,
        tokens: torch.Tensor,
        aux: torch.Tensor,
        final: torch.Tensor,
        prompt_len: int,
        num_steps: int,
    ) -> tuple[torch.Tensor, StepStats]:
        """`batch_loss` of one sequence: `tokens [n]`, `aux [n, A]`, `final [n, H]`."""
        n = torch.tensor([tokens.shape[0]], device=tokens.device)
        loss, stats = self.batch_loss(
            tokens[None], aux[None], final[None], n.new_tensor([prompt_len]), n, num_steps,
            first_prompt_len=prompt_len,
        )  # fmt: skip
        rows, losses, correct, loss_rows = stats.tolist()
        as_ints = [int(r) for r in rows], [int(c) for c in correct], [int(r) for r in loss_rows]
        return loss, StepStats(as_ints[0], losses, as_ints[1], as_ints[2])

    def batch_loss(
        self,
        tokens: torch.Tensor,
        aux: torch.Tensor,
        final: torch.Tensor,
        prompt_lens: torch.Tensor,
        lengths: torch.Tensor,
        num_steps: int,
        first_prompt_len: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted TTT loss of a padded batch (summed over its loss rows) and per-step stats
        as a `[4, num_steps]` tensor (rows, summed loss, correct, loss rows; see `StepStats`),
        so that a batch costs one host synchronisation, not one per sequence and step.

        `tokens [B, L]`, `aux [B, L, A]` and `final [B, L, H]` hold the target's rows of each
        sequence up to its `lengths[b]` (the last row is never used: no token follows it), the
        rest padding; `first_prompt_len` is the shortest prompt (or less: 0 runs every row
        at every step). Step 0 runs every row (their keys are the context of all later rows);
        the later steps run the rows from the first whose chain can reach a response token of
        the shortest prompt. A row that cannot reach a response, or that reads past its
        sequence, only leaves its loss out: a row's query sees step-0 keys at or before it and
        its own later keys, never another row's.
        """
        batch, width = tokens.shape
        m = width - 1  # rows with a next token
        # Row p's last step labels token p + num_steps + 1: rows before `first` never reach a
        # response, so steps after the first run from there (their step-0 keys stay).
        first = max(0, first_prompt_len - 1 - num_steps)
        rows = torch.arange(m, device=tokens.device)
        last = (lengths - 1)[:, None]
        # The target's log-probabilities over the draft vocab at positions first+1..m.
        target_logp = F.log_softmax(final[:, first + 1 :] @ self.target_head_draft.T, dim=-1)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        total = aux.new_zeros(())
        stats = []
        hidden = self.fc(aux[:, :m])
        for step in range(num_steps):
            ids = tokens.gather(1, (rows + 1 + step).clamp(max=width - 1).expand(batch, -1))
            hidden = self._step(ids, hidden, rows + step, first if step else 0, keys, values)
            if step == 0:  # later steps run rows `first ..` only
                hidden, rows = hidden[:, first:], rows[first:]
            label_pos = rows + 2 + step  # the token the step predicts
            in_response = (label_pos >= prompt_lens[:, None]) & (label_pos <= last)
            labels = tokens.gather(1, label_pos.clamp(max=width - 1).expand(batch, -1))
            mask = in_response & self.t2d[labels]
            logits = self.lm_head(self.norm(hidden)).float()
            at = (rows + step - first).clamp(max=m - 1 - first)  # position p + 1 + step
            targets = target_logp[:, at]
            row_loss = -(targets.exp() * F.log_softmax(logits, dim=-1)).sum(-1)
            step_loss = (row_loss * mask).sum()
            total = total + STEP_WEIGHT**step * step_loss
            with torch.no_grad():
                hits = (logits.argmax(-1) == targets.argmax(-1)) & mask
                counts = (in_response.sum(), step_loss.detach(), hits.sum(), mask.sum())
                stats.append(torch.stack([c.float() for c in counts]))
        return total, torch.stack(stats, dim=1)

    def _step(
        self,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        first_row: int,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        """One TTT step over rows `first_row ..` of each sequence (`ids [B, rows]`); appends
        its keys/values; returns the pre-norm output."""
        layer = self.midlayer
        attn = layer.self_attn
        batch, rows = ids.shape
        embeds = self.target_embed[ids]
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        x = x.flatten(0, 1)
        cos, sin = rope_cos_sin(self.inv_freq, positions.repeat(batch), x.dtype)
        q = apply_rope(attn.queries(x), cos, sin)
        k, v = attn.keys_values(x)
        k = apply_rope(k, cos, sin)
        unflat = (batch, rows, attn.num_heads, attn.head_dim)
        keys.append(attn.expand_kv(k).view(unflat).transpose(1, 2))
        values.append(attn.expand_kv(v).view(unflat).transpose(1, 2))
        queries = q.view(unflat).transpose(1, 2)
        out = _chain_attention(queries, keys, values, first_row, attn.scale)
        h = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, rows, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))


def _chain_attention(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    first_row: int,
    scale: float,
) -> torch.Tensor:
    """Attention of step j's queries `[B, H, rows, D]` (rows `first_row ..`; step 0 starts
    at row 0): causal over step 0's keys, plus each row's own keys of steps 1..j (the draft
    chain that row has built), which are stored for rows `first_row ..` as well."""
    k0, v0 = keys[0], values[0]
    context = (q @ k0.transpose(-1, -2)) * scale  # [B, H, rows, m]
    rows = torch.arange(first_row, first_row + q.shape[2], device=q.device)
    future = torch.arange(k0.shape[2], device=q.device)[None, :] > rows[:, None]
    context = context.masked_fill(future, float("-inf"))
    own = [(q * k).sum(-1, keepdim=True) * scale for k in keys[1:]]
    weights = torch.softmax(torch.cat([context, *own], dim=-1).float(), dim=-1).to(q.dtype)
    width = k0.shape[2]
    out = weights[..., :width] @ v0
    for i, v in enumerate(values[1:]):
        out = out + weights[..., width + i : width + i + 1] * v
    return out  # [B, H, m, D]
