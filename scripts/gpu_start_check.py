"""A GPU start as a user does it: `specserve up --device cuda:0` on a random Qwen3 checkpoint
(sliding and full layers), one greedy request through the client SDK, once per attention
backend. The tokens must agree, except that they may part ways at a near tie of the first
backend's run (top-2 log-probability gap under 0.05 nats), where two kernels may round either
way. Run from the repository root with specserve installed:

    python scripts/gpu_start_check.py                       # flashinfer against torch, cuda:0
    python scripts/gpu_start_check.py --device cpu --backends torch torch   # the mechanics
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "worker"), str(ROOT / "tests")]

from test_flashinfer_gpu import _assert_same_greedy, _random_qwen3_hybrid  # noqa: E402

from specserve.client import Client  # noqa: E402
from specserve.shared.curve import default_keys_dir  # noqa: E402
from specserve.shared.protocol import SamplingParams  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [300, 2, 77, 401, 9]]


def serve_and_ask(model: Path, device: str, backend: str, port: int) -> list:
    """Start `up`, send each prompt, stop it: [(tokens, top-2 gaps)] per prompt."""
    cmd = [
        sys.executable, "-m", "specserve.cli", "up", "--workers", "1", "--model", str(model),
        "--device", device, "--dtype", "bfloat16", "--attention-backend", backend,
        "--port", str(port),
    ]  # fmt: skip
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        for line in up.stdout:
            if "is serving" in line:
                break
            if time.monotonic() > deadline or up.poll() is not None:
                raise RuntimeError(f"`up` did not start (last line: {line.strip()})")
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=2)
        results = []
        with Client(f"tcp://127.0.0.1:{port}", keys=default_keys_dir()) as client:
            for prompt in PROMPTS:
                done = client.generate(prompt, params)
                gaps = [top[0] - top[1] for lp in done.logprobs for top in lp.top_logprobs]
                results.append((done.token_ids, gaps))
        return results
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--backends", nargs=2, default=["torch", "flashinfer"])
    parser.add_argument("--port", type=int, default=5781)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = _random_qwen3_hybrid(Path(tmp) / "model")
        runs = [
            serve_and_ask(model, args.device, backend, args.port + 10 * i)
            for i, backend in enumerate(args.backends)
        ]
    reference, other = runs
    for (ref_tokens, _), (tokens, _) in zip(reference, other, strict=True):
        print(f"{args.backends[0]}: {ref_tokens}\n{args.backends[1]}: {tokens}")
    _assert_same_greedy(other, reference)
    print(f"GPU start: {args.backends[1]} agrees with {args.backends[0]} (up to near ties)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
