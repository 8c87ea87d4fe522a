"""The training loop shared by both drafters: batches, schedule, checkpoints, resume, progress.

An optimizer step takes whole samples (in a seeded order, reshuffled each epoch) until it holds
`batch_tokens` tokens, and averages their losses. Every `checkpoint_every` steps, and at the
end, the trainer writes the drafter in its serving format to the output directory and its own
state (weights, optimizer, schedule, position, random state) next to it, so `--resume`
continues exactly where the last checkpoint was taken.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from specserve.training.dflash import DFlashTrainee
from specserve.training.eagle3 import Eagle3Trainee
from specserve.training.export import dflash_config, eagle3_config, save_checkpoint
from specserve.training.features import ShardReader
from specserve.training.progress import Progress
from specserve.training.regenerate import Sample

log = structlog.get_logger(__name__)

STATE_FILE = "train_state.pt"
TIME_PROBE_STEPS = 5  # a time-limited run refits its step count every this many steps
EXPORT_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class TrainConfig:
    """Everything that shapes a run; stored with its state so a resume can check it."""

    method: str  # eagle3 | dflash
    aux_layers: tuple[int, ...]  # target layers the drafter reads (output of layer i)
    epochs: float
    max_steps: int | None
    lr: float
    warmup_steps: int
    batch_tokens: int
    seed: int
    checkpoint_every: int
    num_spec_tokens: int  # EAGLE-3: TTT steps; DFlash: mask rows (block = K + 1)
    draft_vocab_size: int  # EAGLE-3
    num_layers: int  # DFlash
    max_anchors: int  # DFlash blocks per sequence
    decay_gamma: float  # DFlash
    mask_token_id: int  # DFlash
    bf16: bool  # autocast matmuls to bfloat16 (weights and optimizer stay float32)
    # Padded tokens per forward pass (gradients accumulate); 1: each sample alone, which a
    # CPU runs fastest, where a GPU wants tens of thousands.
    micro_batch_tokens: int = 1
    provenance: dict[str, Any] = field(default_factory=dict)
    time_limit: float | None = None  # seconds of training: the step count is fitted as it runs


@dataclass
class Metrics:
    """Running sums since the last report, per draft position."""

    loss: float = 0.0
    weight: float = 0.0
    rows: list[int] = field(default_factory=list)
    correct: list[int] = field(default_factory=list)
    tokens: int = 0

    def add(self, rows: Sequence[int], correct: Sequence[int]) -> None:
        if len(self.rows) < len(rows):
            self.rows += [0] * (len(rows) - len(self.rows))
            self.correct += [0] * (len(rows) - len(self.correct))
        for i, (r, c) in enumerate(zip(rows, correct, strict=True)):
            self.rows[i] += r
            self.correct[i] += c

    def accuracy(self) -> list[float]:
        return [c / r if r else 0.0 for r, c in zip(self.rows, self.correct, strict=True)]

    def expected_accepted(self) -> float:
        """Teacher-forced estimate of drafts accepted per round: sum of cumulative products
        of per-position accuracies (each position counts only if all before it matched)."""
        total, alive = 0.0, 1.0
        for acc in self.accuracy():
            alive *= acc
            total += alive
        return total


def draft_vocabulary(
    samples: Sequence[Sample],
    vocab_size: int,
    size: int,
    predicted: Callable[[Sample], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The `size` target ids the target says most often in the responses (EAGLE-3's reduced
    vocabulary), ascending; ties and unused slots go to the lowest ids. A regenerated response
    is what the target says; for the data's own answers `predicted(sample)` gives the target's
    greedy token at each response position (without it, their tokens are counted)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for sample in samples:
        said = predicted(sample) if sample.by_data and predicted else torch.tensor(sample.response)
        counts += torch.bincount(said.cpu(), minlength=vocab_size)
    size = min(size, vocab_size)
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))
    return torch.tensor(sorted(order[:size]))


def target_predictions(
    reader: ShardReader, target, rows_at_once: int = 512
) -> Callable[[Sample], torch.Tensor]:
    """`predicted` for `draft_vocabulary`: the target's argmax at a sample's response positions,
    from its recorded final rows (row i predicts token i+1) through its own logits path, a few
    hundred rows at a time (SmolLM2 on 2 Zen 3 cores: ~1,900 rows/s)."""

    @torch.no_grad()
    def predicted(sample: Sample) -> torch.Tensor:
        _, _, final = reader.rows(sample.rows, sample.num_tokens, dtype=None)
        rows = final[len(sample.prompt) - 1 : sample.num_tokens - 1]
        rows = rows.to(target.embed_tokens.weight.device).to(target.dtype)
        return torch.cat([target.compute_logits(rows[i : i + rows_at_once]).argmax(-1)
                          for i in range(0, rows.shape[0], rows_at_once)])  # fmt: skip

    return predicted


def build_trainee(
    config: TrainConfig,
    target,
    samples: Sequence[Sample],
    reader: ShardReader | None = None,
    draft_ids: torch.Tensor | None = None,
) -> Eagle3Trainee | DFlashTrainee:
    """A fresh drafter for `target` (a `DecoderModel`), on the target's device (its weights
    are initialised on the host, so a seed gives the same drafter on any device). EAGLE-3's
    draft vocabulary is `draft_ids` where given (a saved drafter's), else counted on `samples`;
    with their `reader`, it counts what the target itself would say where a sample holds the
    data's answer."""
    torch.manual_seed(config.seed)
    head = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    embed = target.embed_tokens.weight
    if config.method == "eagle3":
        if draft_ids is None:
            predicted = target_predictions(reader, target) if reader is not None else None
            draft_ids = draft_vocabulary(
                samples, target.config.vocab_size, config.draft_vocab_size, predicted
            )
        trainee = Eagle3Trainee(target.config, len(config.aux_layers), draft_ids, embed, head)
        return trainee.to(embed.device)
    trainee = DFlashTrainee(
        target.config,
        config.num_layers,
        len(config.aux_layers),
        config.mask_token_id,
        config.num_spec_tokens + 1,
        embed,
        head,
        config.decay_gamma,
    )
    return trainee.to(embed.device)


def plan_batches(
    samples: Sequence[Sample], batch_tokens: int, seed: int, epoch: int
) -> list[list[int]]:
    """Sample indices per optimizer step for one epoch (a seeded shuffle, packed by tokens)."""
    order = list(range(len(samples)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    batches: list[list[int]] = [[]]
    tokens = 0
    for i in order:
        if tokens >= batch_tokens:
            batches.append([])
            tokens = 0
        batches[-1].append(i)
        tokens += samples[i].num_tokens
    return [b for b in batches if b]


@dataclass(frozen=True)
class PaddedBatch:
    """Samples of similar length padded to the longest: `tokens [B, L]`, `aux [B, L, A]`,
    `final [B, L, H]` (features as stored; converted on the training device)."""

    samples: list[Sample]
    tokens: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor

    @property
    def prompt_lens(self) -> list[int]:
        return [len(s.prompt) for s in self.samples]

    @property
    def lengths(self) -> list[int]:
        return [s.num_tokens for s in self.samples]


def micro_batches(samples: Sequence[Sample], padded_tokens: int) -> list[list[Sample]]:
    """A step's samples, longest first, cut where one more would pad the batch past
    `padded_tokens` (one sample at least), so that each forward pass pads little."""
    ordered = sorted(samples, key=lambda s: -s.num_tokens)
    groups: list[list[Sample]] = []
    for sample in ordered:
        if groups and (len(groups[-1]) + 1) * groups[-1][0].num_tokens <= padded_tokens:
            groups[-1].append(sample)
        else:
            groups.append([sample])
    return groups


def collate(reader: ShardReader, samples: Sequence[Sample]) -> PaddedBatch:
    """Read and pad one micro-batch on the host."""
    rows = [reader.rows(s.rows, s.num_tokens, dtype=None) for s in samples]
    width = max(s.num_tokens for s in samples)
    dtypes = {r[1].dtype for r in rows}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    tokens = torch.zeros(len(rows), width, dtype=torch.int64)
    aux = torch.zeros(len(rows), width, rows[0][1].shape[1], dtype=dtype)
    final = torch.zeros(len(rows), width, rows[0][2].shape[1], dtype=dtype)
    for i, (t, a, f) in enumerate(rows):
        tokens[i, : t.shape[0]], aux[i, : a.shape[0]], final[i, : f.shape[0]] = t, a, f
    return PaddedBatch(list(samples), tokens, aux, final)


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        trainee: Eagle3Trainee | DFlashTrainee,
        target_config,
        train: Sequence[Sample],
        reader: ShardReader,
        out: Path,
    ) -> None:
        self.config = config
        self.trainee = trainee
        self.target_config = target_config
        self.train = list(train)
        self.reader = reader
        self.out = out
        self.device = next(trainee.parameters()).device
        params = [p for p in trainee.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95))
        self.steps_per_epoch = len(plan_batches(self.train, config.batch_tokens, config.seed, 0))
        total = math.ceil(self.steps_per_epoch * config.epochs)
        self.total_steps = min(total, config.max_steps) if config.max_steps else total
        self.planned_steps = self.total_steps  # before a time limit cuts it
        self.step = 0
        self.tokens_seen = 0
        self.seconds = 0.0
        self.generator = torch.Generator().manual_seed(config.seed)

    # ---- state -----------------------------------------------------------------------------

    def save(self) -> None:
        """Export the drafter and the training state (atomically, the state last)."""
        self.export()
        state = {
            "config": asdict(self.config),
            "model": self.trainee.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "seconds": self.seconds,
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
        }
        tmp = self.out / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.out / STATE_FILE)

    def load(self, path: Path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=False)
        saved = TrainConfig(
            **{**state["config"], "aux_layers": tuple(state["config"]["aux_layers"])}
        )
        mismatched = [
            name
            for name in ("method", "aux_layers", "seed", "batch_tokens", "num_spec_tokens",
                         "draft_vocab_size", "num_layers", "mask_token_id")
            if getattr(saved, name) != getattr(self.config, name)
        ]  # fmt: skip
        if mismatched:
            raise ValueError(
                f"cannot resume {path}: it was started with different "
                + ", ".join(f"{n}={getattr(saved, n)!r}" for n in mismatched)
            )
        self.trainee.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.seconds = state["seconds"]
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])

    def export(self) -> None:
        config = self.config
        provenance = {
            **config.provenance,
            "steps": self.step,
            "tokens_seen": self.tokens_seen,
            "train_seconds": round(self.seconds, 1),
        }
        state = {k: v.cpu() for k, v in self.trainee.state_dict().items()}
        if config.method == "eagle3":
            assert isinstance(self.trainee, Eagle3Trainee)
            hf = eagle3_config(
                self.target_config,
                config.aux_layers,
                self.trainee.lm_head.out_features,
                EXPORT_DTYPE,
                provenance,
            )
        else:
            hf = dflash_config(
                self.target_config,
                config.num_layers,
                config.aux_layers,
                config.mask_token_id,
                config.num_spec_tokens + 1,
                EXPORT_DTYPE,
                provenance,
            )
        save_checkpoint(self.out, hf, state, EXPORT_DTYPE)

    # ---- the loop --------------------------------------------------------------------------

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to a tenth of the peak."""
        peak, warmup = self.config.lr, self.config.warmup_steps
        if step < warmup:
            return peak * (step + 1) / warmup
        progress = (step - warmup) / max(1, self.total_steps - warmup)
        return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))

    def run(self) -> Metrics:
        """Train to `total_steps` from wherever the state is; returns the last metrics."""
        progress = Progress(
            f"training {self.config.method}", self.total_steps, "steps", initial=self.step
        )
        metrics = Metrics()
        self.trainee.train()
        run_started = time.perf_counter()
        measured_from = None  # (time, step) after this run's first step
        batches = self._step_batches()
        # On a GPU the host reads and pads the next step's batch while this one computes.
        ahead = ThreadPoolExecutor(1) if self.device.type == "cuda" else None
        upcoming = _prepare(ahead, self.host_batches, next(batches))
        while self.step < self.total_steps:
            started = time.perf_counter()
            batch, prepared = upcoming
            if self.step + 1 < self.total_steps:
                upcoming = _prepare(ahead, self.host_batches, next(batches))
            step_metrics = self.optimizer_step(batch, prepared.result())
            self.seconds += time.perf_counter() - started
            self.step += 1
            self.tokens_seen += step_metrics.tokens
            metrics = step_metrics
            accuracy = step_metrics.accuracy()
            progress.update(
                1,
                tokens=step_metrics.tokens,
                loss=step_metrics.loss / max(step_metrics.weight, 1e-9),
                acc1=accuracy[0] if accuracy else 0.0,
                al=1 + step_metrics.expected_accepted(),
            )
            if self.config.time_limit is not None:
                if measured_from is None:
                    measured_from = (time.perf_counter(), self.step)
                elif (self.step - measured_from[1]) % TIME_PROBE_STEPS == 0:
                    self._fit_time_limit(run_started, measured_from)
                    progress.set_total(self.total_steps)
            if self.step % self.config.checkpoint_every == 0 or self.step == self.total_steps:
                self.save()
        progress.close()
        if ahead is not None:
            ahead.shutdown(cancel_futures=True)
        return metrics

    def _step_batches(self) -> Iterator[list[Sample]]:
        """The samples of each step from the current one on, epoch after epoch."""
        epoch, offset = divmod(self.step, self.steps_per_epoch)
        while True:
            plan = plan_batches(self.train, self.config.batch_tokens, self.config.seed, epoch)
            for indices in plan[offset:]:
                yield [self.train[i] for i in indices]
            epoch, offset = epoch + 1, 0

    def _fit_time_limit(self, run_started: float, measured_from: tuple[float, int]) -> None:
        """Set `total_steps` to what ends this run within `time_limit` at the pace of its steps
        so far (not counting the first, which warms up), at most the planned count; the LR
        schedule follows the new end. Refitted as the run goes, since steps differ in cost."""
        assert self.config.time_limit is not None
        now = time.perf_counter()
        per_step = (now - measured_from[0]) / max(1, self.step - measured_from[1])
        left = self.config.time_limit - (now - run_started)
        fitting = min(self.planned_steps, self.step + max(0, int(left / per_step)))
        if fitting != self.total_steps:
            log.debug("train.time_limit", steps=fitting, of=self.planned_steps, step_s=per_step)
            self.total_steps = max(self.step, fitting)

    def host_batches(self, batch: Sequence[Sample]) -> list[PaddedBatch]:
        """One step's micro-batches, read and padded on the host (a GPU run prepares the next
        step's in a thread while this one computes)."""
        groups = micro_batches(batch, self.config.micro_batch_tokens)
        return [collate(self.reader, group) for group in groups]

    def optimizer_step(
        self, batch: Sequence[Sample], prepared: list[PaddedBatch] | None = None
    ) -> Metrics:
        """One optimizer step over `batch`: the summed losses of its micro-batches, their
        gradients accumulated, then divided by the step's loss weight (a mean over loss rows,
        whatever the micro-batches)."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        sums = StepSums()
        for padded in prepared if prepared is not None else self.host_batches(batch):
            loss = self.batch_loss(padded, sums)
            if loss is not None:
                loss.backward()
        metrics = sums.metrics()
        if metrics.weight <= 0:
            return metrics
        params = [p for p in self.trainee.parameters() if p.grad is not None]
        for param in params:
            param.grad.div_(metrics.weight)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        self.optimizer.step()
        return metrics

    def sample_loss(self, sample: Sample, metrics: Metrics) -> torch.Tensor | None:
        """One sample's summed loss; adds its rows, hits, weight and tokens to `metrics`."""
        sums = StepSums()
        loss = self.batch_loss(collate(self.reader, [sample]), sums)
        found = sums.metrics()
        metrics.add(found.rows, found.correct)
        metrics.loss += found.loss
        metrics.weight += found.weight
        metrics.tokens += found.tokens
        return loss

    def batch_loss(self, padded: PaddedBatch, sums: StepSums) -> torch.Tensor | None:
        """A micro-batch's summed loss; its stats are added to `sums` on the device."""
        device = self.device
        tokens = padded.tokens.to(device, non_blocking=True)
        aux = padded.aux.to(device, non_blocking=True).float()
        sums.tokens += sum(padded.lengths)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.config.bf16):
            if isinstance(self.trainee, Eagle3Trainee):
                final = padded.final.to(device, non_blocking=True).float()
                lens = torch.tensor([padded.prompt_lens, padded.lengths], device=device)
                loss, stats = self.trainee.batch_loss(
                    tokens, aux, final, lens[0], lens[1], self.config.num_spec_tokens,
                    first_prompt_len=min(padded.prompt_lens),
                )  # fmt: skip
                # rows and hits per step; step 0's loss rows and loss weigh the step
                sums.add(stats[[0, 2]], stats[3, 0], stats[1, 0])
                return loss
            result = self.trainee.batch_loss(
                tokens,
                aux,
                padded.prompt_lens,
                padded.lengths,
                self.config.max_anchors,
                self.generator,
            )
            if result is None:
                return None
            loss, stats, weight = result
            sums.add(stats, weight, loss.detach())
            return loss

    @torch.no_grad()
    def evaluate(self, samples: Sequence[Sample]) -> Metrics:
        """Teacher-forced per-position accuracy on `samples` (e.g. the held-out ones)."""
        self.trainee.eval()
        sums = StepSums()
        for padded in self.host_batches(samples):
            self.batch_loss(padded, sums)
        self.trainee.train()
        return sums.metrics()


def _prepare(
    pool: ThreadPoolExecutor | None,
    prepare: Callable[[list[Sample]], list[PaddedBatch]],
    batch: list[Sample],
) -> tuple[list[Sample], Future[list[PaddedBatch]]]:
    """`batch` and its host batches, prepared in `pool` (or here and now without one)."""
    if pool is not None:
        return batch, pool.submit(prepare, batch)
    done: Future[list[PaddedBatch]] = Future()
    done.set_result(prepare(batch))
    return batch, done


class StepSums:
    """Stats of a step's micro-batches, summed on the device and read once."""

    def __init__(self) -> None:
        self.stats: torch.Tensor | None = None  # [rows, hits] per draft position
        self.weight: torch.Tensor | float = 0.0
        self.loss: torch.Tensor | float = 0.0
        self.tokens = 0

    def add(self, stats: torch.Tensor, weight: torch.Tensor, loss: torch.Tensor) -> None:
        self.stats = stats if self.stats is None else self.stats + stats
        self.weight = self.weight + weight
        self.loss = self.loss + loss

    def metrics(self) -> Metrics:
        metrics = Metrics(tokens=self.tokens)
        if self.stats is None:
            return metrics
        rows, correct = self.stats.tolist()  # the step's one host synchronisation
        metrics.add([int(r) for r in rows], [int(c) for c in correct])
        metrics.weight = float(self.weight)
        metrics.loss = float(self.loss)
        return metrics


def write_report(path: Path, report: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
