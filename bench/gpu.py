"""Decode-step benchmark on a CUDA GPU: torch vs FlashInfer attention, against the
memory-bandwidth floor.

For each model (a Llama-3-8B-shaped model with random bf16 weights, and the bundled SmolLM2
in bf16), backend and batch size, every request sits at `--context` tokens of (unwritten,
zero) context and decodes `--steps` tokens greedily, the way `ModelRunner` runs a step: build
the metadata from host lists, copy ids/positions up, forward, logits, argmax read back.

Floor: a decode step must read every weight once (the embedding table only for the B rows it
looks up, unless it doubles as the LM head) plus each request's attended K/V, so
`floor = (weight bytes + KV bytes) / measured device copy bandwidth`, where the bandwidth is
that of a large device-to-device copy (bytes read + bytes written per second).

    python bench/gpu.py
    python bench/gpu.py --models smollm2 --batches 1 16 64 --context 2048 --steps 32
    python bench/gpu.py --models llama3-8b --profile   # where each step's time goes
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable

import torch

from specserve.worker.attention.base import AttentionBackend, SequenceStep
from specserve.worker.attention.selection import select_backend
from specserve.worker.kv_cache import PagedKVCache
from specserve.worker.loader import build_model
from specserve.worker.model_registry import load_target
from specserve.worker.models import DecoderModel

DTYPE = torch.bfloat16
BLOCK_SIZE = 16


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def llama3_8b_config() -> dict:
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    )  # fmt: skip


def random_llama_state(config: dict, device: str) -> dict[str, torch.Tensor]:
    """HF-named random bf16 weights, generated on the device (seconds, not minutes)."""
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def w(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=DTYPE, device=device).normal_(0.0, 0.02)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=DTYPE, device=device)

    state = {
        "model.embed_tokens.weight": w(v, h),
        "model.norm.weight": ones(h),
        "lm_head.weight": w(v, h),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": w(q, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, q),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
        }
    return state


def load_llama3_8b(backend: AttentionBackend) -> DecoderModel:
    config = llama3_8b_config()
    state = random_llama_state(config, "cuda")
    model = build_model(config, state, DTYPE, "cuda", backend)
    del state
    return model


def load_smollm2(backend: AttentionBackend) -> DecoderModel:
    return load_target("smollm2-135m", DTYPE, "cuda", backend).model


MODELS: dict[str, Callable[[AttentionBackend], DecoderModel]] = {
    "llama3-8b": load_llama3_8b,
    "smollm2": load_smollm2,
}


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes per second moved by a device-to-device copy (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    return 2 * nbytes * repeats / seconds


def weight_bytes_per_step(model: DecoderModel, batch: int) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:  # the embedding table is only gathered, B rows
        emb = model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
        total += batch * emb.shape[1] * emb.element_size()
    return total


def kv_bytes_per_step(model: DecoderModel, seq_lens: list[int]) -> int:
    c = model.config
    per_token_layer = 2 * c.num_kv_heads * c.head_dim * model.dtype.itemsize
    total = 0
    for group in c.kv_groups:
        for s in seq_lens:
            keys = s if group.sliding_window is None else min(s, group.sliding_window)
            total += keys * len(group.layer_ids) * per_token_layer
    return total


def run_decode(
    model: DecoderModel, batch: int, context: int, steps: int, warmup: int
) -> dict[str, float]:
    c = model.config
    blocks_per_req = -(-(context + steps + warmup + 1) // BLOCK_SIZE)
    num_blocks = batch * blocks_per_req + 1
    cache = PagedKVCache(
        c.kv_groups, num_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim, DTYPE, "cuda"
    )
    tables = [
        list(range(1 + r * blocks_per_req, 1 + (r + 1) * blocks_per_req)) for r in range(batch)
    ]
    backend = model.backend
    seq_lens = [context] * batch
    tokens = [1] * batch
    build_s = 0.0
    measured_kv = 0

    def step() -> None:
        nonlocal tokens, build_s
        for r in range(batch):
            seq_lens[r] += 1
        t0 = time.perf_counter()
        meta = backend.build_metadata(
            [
                SequenceStep(1, s, [t] * len(c.kv_groups))
                for s, t in zip(seq_lens, tables, strict=True)
            ],
            c.kv_groups,
            BLOCK_SIZE,
            "cuda",
        )
        build_s += time.perf_counter() - t0
        ids = torch.tensor(tokens, dtype=torch.int64, device="cuda")
        pos = torch.tensor([s - 1 for s in seq_lens], dtype=torch.int64, device="cuda")
        hidden = model(ids, pos, meta, cache)
        tokens = model.compute_logits(hidden).argmax(dim=-1).tolist()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    build_s = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        measured_kv += kv_bytes_per_step(model, seq_lens)
        step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return {
        "step_s": elapsed / steps,
        "build_s": build_s / steps,
        "kv_bytes": measured_kv / steps,
    }


def profile_decode(model: DecoderModel, batch: int, context: int, steps: int = 10) -> str:
    """Where a step's time goes: wall time against the GPU's kernel time, and kernel launches
    (a step far above its kernel time is bound by the host issuing them)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run_decode(model, batch, context, 3, 3)  # warm the shapes first
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run_decode(model, batch, context, steps, 0)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) / steps * 1e3
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    launches = sum(e.count for e in kernels) / steps
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:5]
    lines = [
        f"  profile: wall {wall_ms:.2f} ms/step (under the profiler), GPU kernels {gpu_ms:.2f} "
        f"ms/step, {launches:.0f} launches/step"
    ]
    for e in top:
        lines.append(f"    {e.self_device_time_total / 1e3 / steps:7.3f} ms  {e.key[:90]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--backends", nargs="+", default=["torch", "flashinfer"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after each timed run, profile 10 steps: wall time against GPU kernel time",
    )
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            "bench/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
            "run it on a GPU machine with `pip install 'specserve[gpu]'` for FlashInfer.",
            file=sys.stderr,
        )
        return 2
    torch.set_grad_enabled(False)
    log(f"device: {torch.cuda.get_device_name()} (torch {torch.__version__})")
    log("measuring device copy bandwidth ...")
    bandwidth = copy_bandwidth()
    log(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s")

    rows = []
    for model_name in args.models:
        for backend_name in args.backends:
            try:
                backend = select_backend(backend_name, "cuda", DTYPE)
            except ValueError as exc:
                log(f"skip {model_name}/{backend_name}: {exc}")
                continue
            log(f"loading {model_name} with the {backend_name} backend ...")
            model = MODELS[model_name](backend)
            for batch in args.batches:
                log(
                    f"{model_name}/{backend_name}: batch {batch}, context {args.context}, "
                    f"{args.warmup} warmup + {args.steps} timed steps ..."
                )
                try:
                    r = run_decode(model, batch, args.context, args.steps, args.warmup)
                except torch.cuda.OutOfMemoryError as exc:
                    log(f"  out of memory: {exc}")
                    torch.cuda.empty_cache()
                    continue
                floor = (weight_bytes_per_step(model, batch) + r["kv_bytes"]) / bandwidth
                rows.append((model_name, backend_name, batch, r, floor))
                log(
                    f"  {r['step_s'] * 1e3:.2f} ms/step, {batch / r['step_s']:.0f} tok/s, "
                    f"host build {r['build_s'] * 1e3:.2f} ms, floor {floor * 1e3:.2f} ms "
                    f"({floor / r['step_s']:.0%} of floor speed)"
                )
                if args.profile:
                    log(profile_decode(model, batch, args.context))
            del model, backend
            gc.collect()
            torch.cuda.empty_cache()

    header = (
        f"{'model':<10} {'backend':<10} {'batch':>5} {'ms/step':>8} {'tok/s':>8} "
        f"{'build ms':>8} {'floor ms':>8} {'floor/step':>10}"
    )
    print("\n" + header)
    print("-" * len(header))
    for model_name, backend_name, batch, r, floor in rows:
        print(
            f"{model_name:<10} {backend_name:<10} {batch:>5} {r['step_s'] * 1e3:>8.2f} "
            f"{batch / r['step_s']:>8.0f} {r['build_s'] * 1e3:>8.2f} {floor * 1e3:>8.2f} "
            f"{floor / r['step_s']:>10.0%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
