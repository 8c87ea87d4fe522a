"""`specserve train-drafter`: from chats to a drafter in its serving format, resumable.

1. Chats (`corpus.py`): the first `held_out` are held out for evaluation, training uses the
   next `max_samples` after passing over `skip_chats` (chats an `--init` drafter trained on).
2. Regeneration (`regenerate.py`): the target answers them through specserve's engine and its
   hidden states are recorded (with `--answers dataset`, the training chats' own answers are
   run through the target instead). Cached in the work directory, which both drafters can share;
   a manifest there refuses data made by another target or with other settings.
3. Training (`trainer.py`), checkpointed into the output directory.
4. A report (`training.json`): the command, seed, data, wall times, tokens seen, and the
   teacher-forced per-position accuracy on held-out samples.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

import structlog
import torch

from specserve.shared.tokenizer import load_tokenizer
from specserve.training.corpus import SHAREGPT, read_chats
from specserve.training.dflash import DFlashTrainee, default_decay_gamma
from specserve.training.eagle3 import Eagle3Trainee
from specserve.training.evaluate import first_turn_prompts, measure
from specserve.training.features import FeatureRecorder, ShardReader, write_shard
from specserve.training.regenerate import (
    RegenerateOptions,
    Sample,
    prefill_rows,
    regenerate,
)
from specserve.training.trainer import (
    STATE_FILE,
    Metrics,
    TrainConfig,
    Trainer,
    build_trainee,
    write_report,
)

log = structlog.get_logger(__name__)

METHODS = ("eagle3", "dflash")
ANSWERS = ("target", "dataset")  # who wrote the training answers: regenerated, or the data's
GPU_MICRO_BATCH_TOKENS = 32768
GPU_BATCHED_TOKENS = 16384
BLOCK_SIZE = 16  # regeneration's KV cache holds `concurrency` sequences of `max_len` tokens
DRAFT_VOCAB_SIZE = 8192  # EAGLE-3's draft vocabulary, the tokens most frequent in the data
DFLASH_LAYERS = 2
# A token the chat never produces, whose (frozen) embedding marks DFlash's masked rows.
MASK_TOKEN_CANDIDATES = ("<|mask|>", "<mask>", "<|MASK|>", "<empty_output>", "<unk>")


@dataclass(frozen=True)
class TrainDrafterArgs:
    method: str
    model: str
    out: Path
    work_dir: Path | None = None  # default: OUT/data
    data: str = SHAREGPT
    max_samples: int = 2000  # training chats
    skip_chats: int = 0  # training chats passed over first (the ones an --init drafter saw)
    held_out: int = 200  # leading chats never trained on
    eval_samples: int = 32  # held-out chats regenerated for evaluation
    max_len: int = 1024
    max_new_tokens: int = 384
    max_turns: int = 2
    answers: str = "target"  # "dataset": train on the data's own answers (one prefill each)
    concurrency: int = 64
    epochs: float = 2.0
    steps: int | None = None
    lr: float = 1e-3
    warmup_steps: int = 20
    batch_tokens: int = 16384
    micro_batch_tokens: int | None = None  # padded tokens per forward pass (default by device)
    seed: int = 0
    checkpoint_every: int = 25
    num_spec_tokens: int | None = None  # default: 5 (EAGLE-3 TTT steps), 15 (DFlash)
    draft_vocab_size: int | None = None  # EAGLE-3; default DRAFT_VOCAB_SIZE (--init: the drafter's)
    num_layers: int | None = None  # DFlash; default DFLASH_LAYERS (--init: the drafter's)
    max_anchors: int = 32
    mask_token_id: int | None = None  # DFlash; default: a special token the chat never uses
    bf16: bool = True  # autocast training matmuls to bfloat16
    resume: bool = False
    init: Path | None = None  # start from the drafter saved there (fine-tuning it)
    eval_only: bool = False
    threads: int | None = None
    device: str = "auto"  # cuda where there is a GPU, else cpu
    time_limit: float | None = None  # seconds of training (regeneration not counted)
    regenerate_time_limit: float | None = None  # seconds of regeneration; a later run goes on
    no_regenerate: bool = False  # train on the work directory's samples, answer no new chats
    command: str = ""


def aux_layers_for(num_target_layers: int) -> tuple[int, ...]:
    """The target layers both drafters read (output of layer i): EAGLE-3's default low/mid/
    high choice, which DFlash uses too, so one regeneration serves both."""
    L = num_target_layers
    return (1, L // 2 - 1, L - 4)


def resolve_device(device: str) -> str:
    """`auto`: the first CUDA GPU where torch sees one, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA GPU here")
    return device


def train_drafter(args: TrainDrafterArgs) -> dict[str, Any]:
    """Run the whole pipeline; returns the report it also writes to OUT/training.json."""
    if args.method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {args.method!r}")
    if args.answers not in ANSWERS:
        raise ValueError(f"--answers must be one of {', '.join(ANSWERS)}, got {args.answers!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    import specserve  # the in-process engine; heavy, so imported when a run starts

    device = resolve_device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    work_dir = args.work_dir or args.out / "data"
    started = time.perf_counter()
    if args.eval_only:
        chats = islice(read_chats(args.data), args.held_out)
        prompts = first_turn_prompts(load_tokenizer(args.model), chats, 64, args.max_len // 2)
        report = evaluate_drafter(args, prompts, device)
        print(json.dumps(report, indent=2))
        return report
    llm = specserve.LLM(
        args.model,
        device=device,
        max_num_seqs=args.concurrency,
        num_blocks=args.concurrency * -(-args.max_len // BLOCK_SIZE) + 1,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=False,
        max_num_batched_tokens=batched_tokens_default(device),
    )
    _check_max_len(args, llm.engine.max_model_len)
    target = llm.engine.loaded.model
    layers = aux_layers_for(target.config.num_layers)
    _check_manifest(work_dir, args, target.config.vocab_size, layers)
    mask_token = None
    if args.init is not None:
        args, mask_token = _init_args(args, layers)
    elif args.method == "dflash":
        mask_token = pick_mask_token(llm.tokenizer, target.config.vocab_size, args.mask_token_id)
    first = args.held_out + args.skip_chats  # the first training chat
    chats = list(islice(read_chats(args.data), first + args.max_samples))
    if len(chats) <= first:
        raise ValueError(
            f"{args.data}: {len(chats)} chats, not more than the {args.held_out} held out"
            + (f" and the {args.skip_chats} skipped" if args.skip_chats else "")
        )
    held, train_chats = chats[: args.held_out], chats[first:]
    if args.answers == "dataset" and not any(c.answers for c in train_chats):
        raise ValueError(f"--answers dataset: {args.data} holds no assistant answers to train on")
    options = RegenerateOptions(
        args.max_len, args.max_new_tokens, args.max_turns, args.concurrency,
        wave=max(128, 2 * args.concurrency),
        time_limit=args.regenerate_time_limit, answers=args.answers,
        answer_new=not args.no_regenerate,
    )  # fmt: skip
    samples = regenerate(
        llm,
        held[: args.eval_samples] + train_chats,
        {c.id for c in held},
        work_dir,
        layers,
        options,
    )
    regenerate_seconds = time.perf_counter() - started
    del llm  # frees the KV cache; the target stays for the loss
    train = [s for s in samples if not s.held_out]
    if args.no_regenerate and not train:
        raise ValueError(
            f"--no-regenerate: {work_dir} holds no training samples for these chats; "
            "run once without it to record them"
        )
    evaluation = [s for s in samples if s.held_out]
    config = _train_config(args, target, layers, mask_token or 0, device)
    reader = ShardReader(work_dir / "shards")
    if args.init is not None:
        trainee = _load_trainee(args.init, config, target)
    else:
        trainee = build_trainee(config, target, train, reader)
    trainer = Trainer(config, trainee, target.config, train, reader, args.out)
    state = args.out / STATE_FILE
    if args.resume and state.is_file():
        trainer.load(state)
        log.info("train.resumed", step=trainer.step, of=trainer.total_steps)
    elif state.is_file() and not args.resume:
        raise ValueError(f"{state} exists: pass --resume to continue it, or use another --out")
    trainer.run()
    held_out = trainer.evaluate(evaluation)
    report = {
        "method": args.method,
        "model": args.model,
        "command": args.command,
        "seed": args.seed,
        "data": args.data,
        "answers": args.answers,
        "init": None if args.init is None else str(args.init),
        "skip_chats": args.skip_chats,
        "train_samples": len(train),
        "train_tokens": sum(s.num_tokens for s in train),
        "response_tokens": sum(len(s.response) for s in train),
        "steps": trainer.step,
        "tokens_seen": trainer.tokens_seen,
        "train_seconds": round(trainer.seconds, 1),
        "regenerate_seconds": round(regenerate_seconds, 1),
        "device": device,
        "held_out_samples": len(evaluation),
        "held_out_accuracy": [round(a, 4) for a in held_out.accuracy()],
        "held_out_expected_acceptance_length": round(1 + held_out.expected_accepted(), 3),
    }
    write_report(args.out / "training.json", report)
    return report


def batched_tokens_default(device: str) -> int:
    """Tokens per engine step while recording: a GPU prefills the data's answers in far
    larger steps than serving's default before its step time grows."""
    return GPU_BATCHED_TOKENS if torch.device(device).type == "cuda" else 2048


def micro_batch_default(device: str) -> int:
    """Padded tokens per forward pass: one sample at a time on a CPU (padding and the long
    attention rows of a padded batch cost it more than the per-sample overhead saves), tens of
    thousands on a GPU, whose steps are otherwise bound by launching small kernels."""
    return GPU_MICRO_BATCH_TOKENS if torch.device(device).type == "cuda" else 1


def num_spec_tokens(args: TrainDrafterArgs) -> int:
    """`--num-spec-tokens`, else its default: 5 EAGLE-3 TTT steps, a DFlash block of 16."""
    return args.num_spec_tokens or (5 if args.method == "eagle3" else 15)


def _train_config(
    args: TrainDrafterArgs, target, layers: tuple[int, ...], mask: int, device: str = "cpu"
) -> TrainConfig:
    k = num_spec_tokens(args)
    return TrainConfig(
        method=args.method,
        aux_layers=layers,
        epochs=args.epochs,
        max_steps=args.steps,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        batch_tokens=args.batch_tokens,
        micro_batch_tokens=args.micro_batch_tokens or micro_batch_default(device),
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
        num_spec_tokens=k,
        draft_vocab_size=DRAFT_VOCAB_SIZE
        if args.draft_vocab_size is None
        else args.draft_vocab_size,
        num_layers=DFLASH_LAYERS if args.num_layers is None else args.num_layers,
        max_anchors=args.max_anchors,
        decay_gamma=default_decay_gamma(k + 1),
        mask_token_id=mask,
        bf16=args.bf16,
        time_limit=args.time_limit,
        provenance={
            "target": args.model,
            "command": args.command,
            "seed": args.seed,
            "num_spec_tokens": k,
        },
    )


def pick_mask_token(tokenizer, vocab_size: int, explicit: int | None) -> int:
    """DFlash's mask token: the one given, else the first of `MASK_TOKEN_CANDIDATES` the
    tokenizer knows."""
    if explicit is not None:
        if not 0 <= explicit < vocab_size:
            raise ValueError(
                f"--mask-token-id {explicit} is outside the vocabulary 0..{vocab_size - 1}"
            )
        return explicit
    for name in MASK_TOKEN_CANDIDATES:
        token_id = tokenizer.token_to_id(name) if tokenizer is not None else None
        if token_id is not None and token_id < vocab_size:
            return token_id
    raise ValueError(
        "no mask token for DFlash: the tokenizer has none of "
        f"{', '.join(MASK_TOKEN_CANDIDATES)}; pass --mask-token-id"
    )


def _check_max_len(args: TrainDrafterArgs, model_max_len: int) -> None:
    if args.max_len > model_max_len:
        raise ValueError(
            f"--max-len {args.max_len} exceeds {args.model}'s maximum length {model_max_len}"
        )
    if args.max_len < 64:
        raise ValueError(f"--max-len {args.max_len} is too short to train on (64 at least)")


MANIFEST = "manifest.json"


def _check_manifest(
    work_dir: Path, args: TrainDrafterArgs, vocab_size: int, layers: tuple[int, ...]
) -> None:
    """Refuse regenerated data made by another target or with other settings."""
    expected = {
        "model": args.model,
        "vocab_size": vocab_size,
        "layers": list(layers),
        "data": args.data,
        "held_out": args.held_out,
        "max_len": args.max_len,
        "max_new_tokens": args.max_new_tokens,
        "max_turns": args.max_turns,
        "answers": args.answers,
    }
    path = work_dir / MANIFEST
    if not path.is_file():
        work_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
        return
    try:
        found = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    found.setdefault("answers", "target")  # data made before --answers was regenerated
    if found.get("vocab_size") != vocab_size or found.get("model") != args.model:
        raise ValueError(
            f"{work_dir} holds data regenerated by {found.get('model')!r} (vocabulary "
            f"{found.get('vocab_size')}), not {args.model!r} (vocabulary {vocab_size}): "
            "use another --work-dir"
        )
    different = sorted(k for k, v in expected.items() if found.get(k) != v)
    if different:
        shown = ", ".join(f"{k}={found.get(k)!r} (now {expected[k]!r})" for k in different)
        raise ValueError(f"{work_dir} was regenerated with {shown}: use another --work-dir")


def _check_drafter_target(out: Path, args: TrainDrafterArgs) -> None:
    """A drafter already in OUT must have been trained for this target and method."""
    config_path = out / "config.json"
    if not config_path.is_file():
        raise ValueError(f"no drafter in {out} (config.json missing): train one first")
    config = json.loads(config_path.read_text())
    made = config.get("specserve_training") or {}
    if made.get("target") not in (None, args.model):
        raise ValueError(
            f"the drafter in {out} was trained for {made['target']!r}, not {args.model!r}"
        )


def evaluate_drafter(
    args: TrainDrafterArgs, prompts: list[list[int]], device: str = "cpu"
) -> dict[str, Any]:
    """Mean acceptance length and per-position acceptance of the drafter in OUT on `prompts`,
    through the serving path (batched, greedy)."""
    import specserve

    _check_drafter_target(args.out, args)
    k = num_spec_tokens(args)
    llm = specserve.LLM(  # every round verifies all K drafts: acceptance of the drafter alone
        args.model,
        spec_method=args.method,
        drafter=str(args.out),
        num_spec_tokens=k,
        spec_policy="fixed",
        device=device,
    )
    served = measure(llm, prompts, max_tokens=128, batch=16)
    del llm
    stats = served.stats
    estimate = teacher_forced(args, prompts, served.outputs, device)
    return {
        "num_spec_tokens": k,
        "prompts": len(prompts),
        "mean_acceptance_length": round(stats.mean_acceptance_length, 3),
        "per_position_acceptance": [round(r, 4) for r in stats.acceptance_rate_per_position],
        "draft_rounds": stats.num_drafts,
        "teacher_forced_accuracy": [round(a, 4) for a in estimate.accuracy()],
        "teacher_forced_expected_acceptance_length": round(1 + estimate.expected_accepted(), 3),
    }


def teacher_forced(
    args: TrainDrafterArgs,
    prompts: list[list[int]],
    outputs: list[list[int]],
    device: str = "cpu",
) -> Metrics:
    """The drafter in OUT run by its training forward pass over exactly the prompts and greedy
    outputs serving measured, their target rows rebuilt by a prefill: per-position accuracy,
    from which training estimates the acceptance length. Served acceptance well below this
    estimate points at serving, not at the drafter."""
    import specserve

    saved, layers, mask = _saved_drafter(args.out, args)
    llm = specserve.LLM(args.model, device=device, enable_prefix_caching=False)
    target = llm.engine.loaded.model
    recorder = FeatureRecorder(layers)
    llm.engine.runner.recorder = recorder
    sequences = [p + o for p, o in zip(prompts, outputs, strict=True)]
    rows = prefill_rows(llm, recorder, sequences)
    del llm
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        kept = [(i, r) for i, r in enumerate(rows) if r is not None]
        firsts = write_shard(work / "served.safetensors", [(sequences[i], *r) for i, r in kept])
        samples = [
            Sample(str(i), 0, True, prompts[i], outputs[i], "", "served.safetensors", first)
            for (i, _), first in zip(kept, firsts, strict=True)
        ]
        train_config = _train_config(saved, target, layers, mask, device)
        trainee = _load_trainee(args.out, train_config, target)
        trainer = Trainer(train_config, trainee, target.config, [], ShardReader(work), work)
        return trainer.evaluate(samples)


DRAFTER_ARCHITECTURES = {"eagle3": "LlamaForCausalLMEagle3", "dflash": "DFlashDraftModel"}


def _saved_drafter(
    out: Path, args: TrainDrafterArgs
) -> tuple[TrainDrafterArgs, tuple[int, ...], int]:
    """The drafter saved in OUT as training arguments (`args` with its draft vocabulary, its
    layers and, for DFlash, its block size), the target layers it reads and its mask token."""
    _check_drafter_target(out, args)
    config = json.loads((out / "config.json").read_text())
    architecture = (config.get("architectures") or ["an unknown architecture"])[0]
    if architecture != DRAFTER_ARCHITECTURES[args.method]:
        raise ValueError(
            f"the drafter in {out} is {architecture}, not {DRAFTER_ARCHITECTURES[args.method]} "
            f"(--method {args.method})"
        )
    if args.method == "eagle3":
        layers = tuple(i - 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        k, mask = args.num_spec_tokens, 0  # TTT steps: the run's choice, not the drafter's
    else:
        layers = tuple(config["dflash_config"]["target_layer_ids"])
        k, mask = config["block_size"] - 1, config["dflash_config"]["mask_token_id"]
    saved = replace(
        args,
        num_spec_tokens=k,
        draft_vocab_size=config.get("draft_vocab_size", 0),
        num_layers=config["num_hidden_layers"],
    )
    return saved, layers, mask


def _init_args(args: TrainDrafterArgs, layers: tuple[int, ...]) -> tuple[TrainDrafterArgs, int]:
    """`--init DIR`: the run takes DIR's drafter geometry, refusing one that reads other target
    layers than the data records or that differs from a size given explicitly (a DFlash
    block, the number of DFlash layers, EAGLE-3's draft vocabulary); returns the arguments and
    the mask token to train with."""
    assert args.init is not None
    saved, init_layers, mask = _saved_drafter(args.init, args)
    if init_layers != layers:
        raise ValueError(
            f"--init {args.init}: the drafter reads target layers {list(init_layers)}, "
            f"the data records {list(layers)}"
        )
    if args.method == "dflash":
        asked = {
            "--num-spec-tokens": (args.num_spec_tokens, saved.num_spec_tokens),
            "--num-layers": (args.num_layers, saved.num_layers),
        }
    else:
        asked = {"--draft-vocab-size": (args.draft_vocab_size, saved.draft_vocab_size)}
    for flag, (given, has) in asked.items():
        if given is not None and given != has:
            raise ValueError(f"--init {args.init}: the drafter has {flag} {has}, not {given}")
    return saved, mask


def _load_trainee(out: Path, config: TrainConfig, target) -> Eagle3Trainee | DFlashTrainee:
    """The drafter saved in OUT as the trainee its training used."""
    from safetensors.torch import load_file

    state = load_file(str(out / "model.safetensors"))
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    draft_ids = state["d2t"] + torch.arange(state["d2t"].numel()) if "d2t" in state else None
    trainee = build_trainee(config, target, [], draft_ids=draft_ids)
    trainee.load_state_dict(state)
    return trainee
