"""The `specserve` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from specserve.control.request import SpecDecodingStats
from specserve.shared.logging import configure_logging


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids takes comma-separated integers, got {text!r}"
        ) from None


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="a bundled model name (smollm2-135m) or a Hugging Face checkpoint dir",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument(
        "--attention-backend",
        default="torch",
        choices=["auto", "torch", "flashinfer"],
        help="auto picks FlashInfer on a supported GPU (default: torch)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV cache blocks (default: sized from --kv-cache-memory-mb)",
    )
    p.add_argument("--kv-cache-memory-mb", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--spec-method",
        default="none",
        choices=["none", "ngram", "eagle3", "dflash"],
        help="speculative decoding method",
    )
    p.add_argument("--drafter", default=None, help="drafter checkpoint dir (eagle3, dflash)")
    p.add_argument("--num-spec-tokens", type=int, default=0, help="drafts per step (K)")
    p.add_argument("--drafter-max-model-len", type=int, default=None)
    p.add_argument(
        "--sample-drafts",
        action="store_true",
        help="sample drafts, verified with their probabilities (default: greedy)",
    )


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory_mb=args.kv_cache_memory_mb,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=not args.no_prefix_caching,
        spec_method=args.spec_method,
        drafter=args.drafter,
        num_spec_tokens=args.num_spec_tokens,
        drafter_max_model_len=args.drafter_max_model_len,
        sample_drafts=args.sample_drafts,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve", description="LLM serving with speculative decoding."
    )
    parser.add_argument("--log-level", default=None, help="debug, info, warning (default: info)")
    parser.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, served in-process")
    _add_engine_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", type=_token_ids, help="comma-separated token ids")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve.llm import LLM
    from specserve.shared.protocol import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    params.validate()  # fail before loading the model
    llm = LLM(args.model, **_engine_kwargs(args))
    prompt = args.prompt if args.prompt is not None else args.prompt_ids
    (out,) = llm.generate(prompt, params, chat=args.chat)
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    if args.json:
        result = {
            "prompt_token_ids": out.prompt_token_ids,
            "token_ids": out.token_ids,
            "text": out.text,
            "finish_reason": out.finish_reason,
        }
        if out.spec_stats is not None and args.spec_method != "none":
            result["spec"] = spec_summary(out.spec_stats)
        print(json.dumps(result))
    else:
        print(out.text if out.text is not None else ",".join(map(str, out.token_ids)))
        if out.spec_stats is not None and args.spec_method != "none":
            print(f"[spec] {json.dumps(spec_summary(out.spec_stats))}", file=sys.stderr)
    return 0


def spec_summary(stats: SpecDecodingStats) -> dict:
    return {
        "mean_acceptance_length": round(stats.mean_acceptance_length, 3),
        "acceptance_rate_per_position": [round(r, 3) for r in stats.acceptance_rate_per_position],
        "drafts": stats.num_drafts,
        "draft_tokens": stats.num_draft_tokens,
        "accepted_tokens": stats.num_accepted_tokens,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_json or None)
    try:
        return cmd_generate(args)
    except ValueError as exc:  # bad input: a clear message, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
