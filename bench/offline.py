"""Offline generation against vLLM: prefill and output throughput on ShareGPT prompts.

Usage: .venv/bin/python bench/offline.py [--dtype float32|bfloat16] [--rounds 2]
    [--prompts 64] [--max-tokens 128] [--temperature 1.0 --top-p 0.95 --top-k 50]

Needs `bash scripts/setup_peer.sh` (vLLM's CPU build in .venv-peer). specserve's `LLM` and
vLLM's `LLM` each run in their own process, one after the other and round after round
(specserve, vLLM, specserve, vLLM, ...), on the same weights (the bundled SmolLM2-135M-Instruct
dequantized once into a Hugging Face directory, cast to `--dtype` at load), the same prompts
(ShareGPT first user turns through the chat template, at most 512 tokens) and the same settings:
2 threads, 64 sequences, 2048 batched tokens, max_model_len 2048, prefix caching off (every
repeat is cold), greedy unless `--temperature` (then sampled with the same temperature, top-p
and top-k in both, unseeded), EOS ignored. Each process times every case twice after a warm-up
and reports its best; the table gives the median over rounds and specserve / vLLM.

Cases: `prefill` (every prompt at once, one output token: prompt tokens/s), `prefill 1 by 1`
(each prompt alone, one output token, as prompts of every length reach a server: each of the
two runs takes every other prompt, lengths the other run mostly did not meet), `batch 1` (four
prompts one at a time), `batch 16` (16 prompts together) and `all` (every prompt together), the
last three in output tokens/s. Greedy outputs of the `all` case are compared token by token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from http_api import PEER_BIN, peer_model_dir, vllm_env
from machine import cpu_model

from specserve.shared.tokenizer import load_tokenizer
from specserve.training.corpus import read_sharegpt
from specserve.training.evaluate import first_turn_prompts

SETTINGS = dict(max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=2048)
CASES = ("prefill", "prefill 1 by 1", "batch 1", "batch 16", "all")

# Both engines run this, each with its own `load` and `generate`: a case's rate is its best of
# two timed runs after one warm-up. The output is one line: RESULT and JSON.
MEASURE = r"""
import json, sys, time

def measure(load, generate, prompts, max_tokens):
    load()
    # Each case: the batches of its two timed runs (the same twice, except `prefill 1 by 1`,
    # whose runs take every other prompt: each run meets mostly lengths the other did not).
    cases = {
        "prefill": ([[prompts]] * 2, 1),
        "prefill 1 by 1": ([[[p] for p in prompts[i::2]] for i in (0, 1)], 1),
        "batch 1": ([[[p] for p in prompts[:4]]] * 2, max_tokens),
        "batch 16": ([[prompts[:16]]] * 2, max_tokens),
        "all": ([[prompts]] * 2, max_tokens),
    }
    generate(prompts[:4], 4)  # warm-up
    rates, outputs = {}, None
    for name, (runs, tokens) in cases.items():
        best = 0.0
        for batches in runs:
            start = time.perf_counter()
            got = [generate(batch, tokens) for batch in batches]
            seconds = time.perf_counter() - start
            if tokens == 1:  # prompt tokens
                count = sum(len(p) for b in batches for p in b)
            else:
                count = sum(len(b) for b in batches) * tokens
            best = max(best, count / seconds)
        rates[name] = best
        if name == "all":
            outputs = got[0]
    print("RESULT " + json.dumps({"rates": rates, "outputs": outputs}), flush=True)
"""

SPECSERVE = r"""
import torch
from specserve.llm import LLM
from specserve.shared.logging import configure_logging
from specserve.shared.protocol import SamplingParams

def main():
    args = json.loads(sys.argv[1])
    configure_logging("warning")
    engine = {}

    def load():
        engine["llm"] = LLM(args["model"], dtype=args["dtype"], enable_prefix_caching=False,
                            kv_cache_memory_mb=4096, **args["settings"])

    def generate(batch, tokens):
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, **args["sampling"])
        return [out.token_ids for out in engine["llm"].generate(batch, params)]

    measure(load, generate, args["prompts"], args["max_tokens"])

main()
"""

VLLM = r"""
def main():
    from vllm import LLM, SamplingParams
    args = json.loads(sys.argv[1])
    engine = {}

    def load():
        engine["llm"] = LLM(args["model"], dtype=args["dtype"], enable_prefix_caching=False,
                            **args["settings"])

    def generate(batch, tokens):
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, **args["sampling"])
        prompts = [{"prompt_token_ids": p} for p in batch]
        outs = engine["llm"].generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    measure(load, generate, args["prompts"], args["max_tokens"])

if __name__ == "__main__":  # vLLM starts its engine in child processes
    main()
"""


def log(msg: str) -> None:
    print(f"[offline-bench] {msg}", file=sys.stderr, flush=True)


def run_engine(engine: str, args: dict, tmp: Path) -> dict:
    if engine == "specserve":
        python, env, body = sys.executable, dict(os.environ), SPECSERVE
    else:
        python, env, body = str(PEER_BIN / "python"), vllm_env(), VLLM
    script = tmp / f"measure_{engine}.py"  # (named "specserve.py" it would shadow the package)
    script.write_text(MEASURE + body)
    log(f"{engine}: loading and measuring")
    proc = subprocess.run(
        [python, str(script), json.dumps(args)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    (result,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(result.removeprefix("RESULT "))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k")
    args = p.parse_args()
    if not (PEER_BIN / "python").exists():
        sys.exit("no .venv-peer: run `bash scripts/setup_peer.sh` first")
    model = peer_model_dir()
    tokenizer = load_tokenizer(str(model))
    prompts = first_turn_prompts(tokenizer, read_sharegpt(), args.prompts, args.max_prompt_tokens)
    sampling = dict(temperature=args.temperature, top_p=args.top_p)
    if args.top_k:  # vLLM reads 0 as no top-k as we do, but older releases wanted -1
        sampling["top_k"] = args.top_k
    job = dict(model=str(model), dtype=args.dtype, prompts=prompts,
               max_tokens=args.max_tokens, settings=SETTINGS, sampling=sampling)  # fmt: skip
    rates: dict[str, list[dict[str, float]]] = {"specserve": [], "vllm": []}
    outputs: dict[str, list[list[int]]] = {}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for engine in rates:
                got = run_engine(engine, job, Path(tmp))
                rates[engine].append(got["rates"])
                outputs[engine] = got["outputs"]
                loads.append(os.getloadavg()[0])
    same = sum(a == b for a, b in zip(outputs["specserve"], outputs["vllm"], strict=True))
    tokens = sum(map(len, prompts))
    how = "greedy" if args.temperature == 0 else ", ".join(f"{k} {v}" for k, v in sampling.items())
    print(
        f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores; {args.dtype}; {len(prompts)} "
        f"ShareGPT prompts ({tokens} tokens), {args.max_tokens} output tokens, {how}; median "
        f"of {args.rounds} rounds; load average {min(loads):.2f}-{max(loads):.2f}"
    )
    print(f"{'case':<14} {'unit':<14} {'specserve':>10} {'vLLM':>10} {'ratio':>7}")
    for case in CASES:
        ours = statistics.median(r[case] for r in rates["specserve"])
        theirs = statistics.median(r[case] for r in rates["vllm"])
        unit = "prompt tok/s" if case.startswith("prefill") else "output tok/s"
        print(f"{case:<14} {unit:<14} {ours:>10.1f} {theirs:>10.1f} {ours / theirs:>6.2f}x")
    if args.temperature == 0:
        print(f"greedy outputs identical on {same} of {len(prompts)} prompts")


if __name__ == "__main__":
    main()
