"""Test-only engine: naive block allocation and metadata building around `DecoderModel`.

It stands in for the real scheduler: blocks come from a free list that never hands out the
null block, requests are stepped explicitly, and greedy decoding takes the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.shared.config import AttentionType
from specserve.worker.attention.base import SequenceStep
from specserve.worker.kv_cache import NULL_BLOCK, PagedKVCache
from specserve.worker.model_runner import forward_step
from specserve.worker.models import DecoderModel


@dataclass
class Seq:
    tokens: list[int]  # prompt plus generated tokens
    block_tables: list[list[int]]  # one per KV group
    num_computed: int = 0  # tokens whose K/V is in the cache
    generated: list[int] = field(default_factory=list)


class PagedDriver:
    def __init__(
        self,
        model: DecoderModel,
        num_blocks: int = 512,
        block_size: int = 4,
        drop_out_of_window: bool = False,
    ) -> None:
        """`drop_out_of_window` points table entries that left the sliding window at the null
        block (as the scheduler does when it frees them) and fills the null block with NaN, so
        any read of out-of-window context poisons the output."""
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.cache = PagedKVCache(
            cfg.kv_groups,
            num_blocks,
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            model.dtype,
            "cpu",
        )
        self.free = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self.drop_out_of_window = drop_out_of_window
        if drop_out_of_window:
            for tensor in self.cache.layers.values():
                tensor[NULL_BLOCK] = float("nan")

    def new_seq(self, prompt: list[int]) -> Seq:
        return Seq(list(prompt), [[] for _ in self.model.config.kv_groups])

    def fork(self, parent: Seq, prompt: list[int], num_shared_blocks: int) -> Seq:
        """A sequence whose first `num_shared_blocks` blocks (and their K/V) are the parent's."""
        shared = num_shared_blocks * self.block_size
        assert parent.tokens[:shared] == prompt[:shared] and parent.num_computed >= shared
        tables = [list(t[:num_shared_blocks]) for t in parent.block_tables]
        return Seq(list(prompt), tables, num_computed=shared)

    def step(
        self, work: list[tuple[Seq, int]], causal: bool = True, all_rows: bool = False
    ) -> torch.Tensor:
        """Compute `n` more tokens of each `(seq, n)`; return each seq's last-row logits
        (or, with `all_rows`, the logits of every computed token in batch order)."""
        steps, ids, positions, last_rows = [], [], [], []
        for seq, n in work:
            start, end = seq.num_computed, seq.num_computed + n
            assert end <= len(seq.tokens)
            self.allocate(seq, end)
            ids += seq.tokens[start:end]
            positions += range(start, end)
            steps.append(SequenceStep(n, end, [list(t) for t in seq.block_tables], causal))
            last_rows.append(len(ids) - 1)
        cfg = self.model.config
        meta = self.model.backend.build_metadata(steps, cfg.kv_groups, self.block_size, "cpu")
        ids_t, positions_t = torch.tensor(ids), torch.tensor(positions)
        hidden, _ = forward_step(self.model, ids_t, positions_t, meta, self.cache, ())
        for seq, n in work:
            seq.num_computed += n
            self._drop_old_blocks(seq)
        return self.model.compute_logits(hidden if all_rows else hidden[last_rows])

    def generate_greedy(
        self, prompts: list[list[int]], max_new_tokens: int, chunk: int | None = None
    ) -> list[list[int]]:
        """Prefill every prompt (in `chunk`-token pieces if given), then decode together."""
        seqs = [self.new_seq(p) for p in prompts]
        self.prefill(seqs, chunk)
        self.decode(seqs, max_new_tokens - 1)
        return [s.generated for s in seqs]

    def prefill(self, seqs: list[Seq], chunk: int | None = None) -> None:
        """Run prompts to the end (chunked if asked) and append the first generated token."""
        prompt_lens = {id(seq): len(seq.tokens) for seq in seqs}
        while True:
            work = []
            for seq in seqs:
                remaining = prompt_lens[id(seq)] - seq.num_computed
                if remaining > 0:
                    work.append((seq, min(remaining, chunk or remaining)))
            if not work:
                return
            logits = self.step(work)
            for (seq, _), row in zip(work, logits, strict=True):
                if seq.num_computed == len(seq.tokens):
                    self._append(seq, int(row.argmax()))

    def decode(self, seqs: list[Seq], num_steps: int) -> None:
        for _ in range(num_steps):
            logits = self.step([(s, 1) for s in seqs])
            for seq, row in zip(seqs, logits, strict=True):
                self._append(seq, int(row.argmax()))

    def _append(self, seq: Seq, token: int) -> None:
        seq.tokens.append(token)
        seq.generated.append(token)

    def allocate(self, seq: Seq, num_tokens: int) -> None:
        needed = -(-num_tokens // self.block_size)
        for table in seq.block_tables:
            while len(table) < needed:
                table.append(self.free.pop())

    def _drop_old_blocks(self, seq: Seq) -> None:
        """Null out sliding-group blocks that no future query can see."""
        if not self.drop_out_of_window:
            return
        for group, table in zip(self.model.config.kv_groups, seq.block_tables, strict=True):
            if group.attention != AttentionType.SLIDING:
                continue
            assert group.sliding_window is not None
            # The next query sits at position num_computed and sees keys > pos - window.
            first_visible = max(0, seq.num_computed - group.sliding_window + 1)
            for b in range(first_visible // self.block_size):
                table[b] = NULL_BLOCK


def greedy_decode_logits(
    model: DecoderModel, lengths: list[int], steps: int, seed: int, block_size: int = 4
) -> list[torch.Tensor]:
    """Prefill random prompts of `lengths` tokens, then decode them together greedily for
    `steps` steps: the logits of every decode step (a hybrid's out-of-window blocks dropped)."""
    from hf_reference import prompts

    hybrid = len(model.config.kv_groups) > 1
    driver = PagedDriver(model, block_size=block_size, drop_out_of_window=hybrid)
    seqs = [driver.new_seq(p) for p in prompts(lengths, seed=seed)]
    driver.prefill(seqs)
    logits = []
    for _ in range(steps):
        step_logits = driver.step([(s, 1) for s in seqs])
        logits.append(step_logits)
        for seq, row in zip(seqs, step_logits, strict=True):
            driver._append(seq, int(row.argmax()))
    return logits
