"""`specserve train-drafter`: its flags (torch-free, so `specserve --help` stays fast) and run."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

DEFAULTS_NOTE = (
    "Regenerates the chats' answers with the target (recording its hidden states) into the "
    "work directory, then trains the drafter into OUT in the format vLLM, SGLang and specserve "
    "load, checkpointing as it goes (--resume continues). OUT/training.json reports the run."
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-drafter",
        help="train an EAGLE-3 or DFlash drafter for a model",
        description=DEFAULTS_NOTE,
    )
    p.add_argument("--method", required=True, choices=["eagle3", "dflash"])
    p.add_argument("--model", default="smollm2-135m", help="bundled name or HF checkpoint dir")
    p.add_argument("--out", required=True, type=Path, help="where the drafter goes")
    p.add_argument(
        "--data",
        default="sharegpt",
        help="'sharegpt' (needs specserve[train]) or a JSONL file of chats or prompts",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="regenerated data (default OUT/data); both drafters can share one",
    )
    p.add_argument("--max-samples", type=int, default=2000, help="training chats")
    p.add_argument("--held-out", type=int, default=200, help="leading chats never trained on")
    p.add_argument(
        "--skip-chats",
        type=int,
        default=0,
        help="training chats passed over before --max-samples are taken (ones an --init "
        "drafter already trained on)",
    )
    p.add_argument("--max-len", type=int, default=1024, help="tokens per sample")
    p.add_argument("--max-new-tokens", type=int, default=384, help="tokens per answer")
    p.add_argument("--max-turns", type=int, default=2, help="user turns answered per chat")
    p.add_argument(
        "--answers",
        default="target",
        choices=["target", "dataset"],
        help="target: the target regenerates every answer (what it will be verified against); "
        "dataset: train on the data's own answers, each run through the target once as a "
        "prompt (far cheaper; held-out chats are still regenerated for evaluation)",
    )
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--batch-tokens", type=int, default=8192, help="tokens per optimizer step")
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="padded tokens per forward pass, a step accumulating its micro-batches (default: "
        "one sample at a time on a CPU, 32768 on a GPU; lower it if a step runs out of memory)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=25, help="steps between checkpoints")
    p.add_argument(
        "--num-spec-tokens",
        type=int,
        default=None,
        help="EAGLE-3: steps unrolled (default 5); DFlash: block size - 1 (15)",
    )
    p.add_argument(
        "--draft-vocab-size", type=int, default=None, help="EAGLE-3 (default 8192; --init: its own)"
    )
    p.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="DFlash drafter layers (default 2; --init: its own)",
    )
    p.add_argument("--mask-token-id", type=int, default=None, help="DFlash")
    p.add_argument("--max-anchors", type=int, default=32, help="DFlash blocks per sample")
    p.add_argument("--concurrency", type=int, default=64, help="answers generated at once")
    p.add_argument("--no-bf16", action="store_true", help="train matmuls in float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--device", default="auto", help="auto (a CUDA GPU where there is one), cpu, cuda[:N]"
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="train at most this long: the step count (and its LR schedule) is fitted to the "
        "pace of the steps so far, every few steps",
    )
    p.add_argument(
        "--regenerate-time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="regenerate at most this long (between waves of 2x --concurrency chats; one always "
        "runs), then train on the chats done; a later run continues the regeneration",
    )
    p.add_argument(
        "--no-regenerate",
        action="store_true",
        help="train on the samples already in the work directory, answering no new chats (it "
        "then only reads the directory, so runs with other settings can share it side by side)",
    )
    p.add_argument("--resume", action="store_true", help="continue OUT's last checkpoint")
    p.add_argument(
        "--init",
        type=Path,
        default=None,
        metavar="DIR",
        help="start from the drafter in DIR (same method and target; a bundled drafter's "
        "directory, say) instead of a fresh one: its geometry and draft vocabulary are kept",
    )
    p.add_argument(
        "--eval-only",
        action="store_true",
        help="measure OUT's drafter on held-out prompts through the serving path",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specserve.training.pipeline import TrainDrafterArgs, train_drafter

    derived = {"bf16": not args.no_bf16, "command": shlex.join(["specserve", *sys.argv[1:]])}
    given = {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(TrainDrafterArgs)
        if field.name not in derived and hasattr(args, field.name)
    }  # the flags are named as the fields they set
    train_drafter(TrainDrafterArgs(**given, **derived))
    return 0
