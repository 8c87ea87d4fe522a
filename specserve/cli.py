"""The `specserve` command line.

`generate` serves one prompt in-process (or asks a running service with `--url`), `control` and
`worker` run the two halves of the distributed service, `up` starts a whole local service,
`cache` inspects the Redis prefix index, `kernels` builds the CPU kernels ahead of time, `keys`
makes CURVE keys and `train-drafter` trains a drafter for a model.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specserve.launch.lifetime import die_with_launcher
from specserve.shared.hashing import HASH_ALGORITHMS
from specserve.shared.logging import configure_logging
from specserve.training.command import add_parser as train_command

if TYPE_CHECKING:
    from redis import Redis

    from specserve.cache_index import Namespace
    from specserve.control.control_plane import ControlArgs
    from specserve.control.limits import ServiceLimits
    from specserve.control.request import SpecDecodingStats
    from specserve.launch.up import UpPlan
    from specserve.shared.curve import PeerKeys
    from specserve.shared.protocol import SamplingParams
    from specserve.worker.engine import EngineArgs

ArgTarget = argparse.ArgumentParser | argparse._ArgumentGroup
DEFAULT_SERVICE_URL = "tcp://127.0.0.1:5555"
DEFAULT_WORKER_URL = "tcp://127.0.0.1:5556"  # the control plane's worker port
KEYS_ENV = "SPECSERVE_KEYS"
_SERVICE_URL = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):\d{1,5}|ipc://\S+")


class CliError(Exception):
    """A problem the user can fix: printed as `error: ...` with exit status 2, no traceback."""


def _check_worker_installed() -> None:
    """Commands that run a model need the worker extra: say so, not `No module named 'torch'`."""
    if importlib.util.find_spec("torch") is None:
        raise CliError("running a model needs torch: pip install 'specserve[worker]'")


# --- argument types --------------------------------------------------------------------------


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids takes comma-separated integers, got {text!r}"
        ) from None


def _service_url(text: str) -> str:
    """Reject a malformed address before any socket is opened (ZeroMQ would fail obscurely)."""
    if not _SERVICE_URL.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT or ipc://PATH, got {text!r}")
    return text


def _service_urls(text: str) -> tuple[str, ...]:
    """One control plane address, or several separated by commas (tried in turn)."""
    return tuple(_service_url(part.strip()) for part in text.split(","))


def _cpu_list(text: str) -> list[int]:
    from specserve.shared.cpus import parse_cpus

    try:
        return parse_cpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _worker_id(text: str) -> str:
    from specserve.shared.protocol import check_worker_id

    try:
        return check_worker_id(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _redis_url_argument(text: str) -> str:
    from specserve.cache_index.redis_url import check_redis_url_argument

    try:
        return check_redis_url_argument(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1-65535, got {value}")
    return value


# --- shared flag groups ----------------------------------------------------------------------


def _add_engine_args(p: ArgTarget) -> None:
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="a bundled model name (smollm2-135m) or a Hugging Face checkpoint dir",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations; auto: the checkpoint's own (float32 for the bundled "
        "quantized model; float16 runs as bfloat16 on CPU)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "flashinfer"],
        help="auto (the default): FlashInfer on a supported GPU where its kernels are prebuilt or "
        "nvcc can build them, else the torch backend (always on CPU)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV cache blocks (default: sized from --kv-cache-memory-mb)",
    )
    p.add_argument("--kv-cache-memory-mb", type=int, default=512)
    p.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=None,
        help="size the KV cache as this fraction (0-1] of the memory still free once the "
        "weights are loaded (CUDA's free memory; on CPU MemAvailable within the cgroup limit), "
        "instead of --kv-cache-memory-mb",
    )
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
    p.add_argument(
        "--drafter-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the drafter's weights and activations; auto: the target's, except bfloat16 for a "
        "16-bit drafter beside a float32 target on a CPU with bfloat16 kernels (half the bytes "
        "a draft streams), and a float32 drafter on a CPU reads its layers as 8-bit blocks "
        "(rounded at load); drafts are verified either way",
    )
    p.add_argument(
        "--num-spec-tokens",
        type=int,
        default=0,
        help="drafts per step (K; default: 4 for ngram, the drafter's own for eagle3/dflash)",
    )
    p.add_argument("--drafter-max-model-len", type=int, default=None)
    p.add_argument(
        "--sample-drafts",
        action="store_true",
        help="sample drafts, verified with their probabilities (default: greedy)",
    )
    p.add_argument(
        "--spec-policy",
        default="adaptive",
        choices=["adaptive", "fixed"],
        help="adaptive: verify each step only the drafts expected to pay at this batch size, "
        "from measured acceptance and step costs (down to none); fixed: always K",
    )


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory_mb=args.kv_cache_memory_mb,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=not args.no_prefix_caching,
        spec_method=args.spec_method,
        drafter=args.drafter,
        drafter_dtype=args.drafter_dtype,
        num_spec_tokens=args.num_spec_tokens,
        drafter_max_model_len=args.drafter_max_model_len,
        sample_drafts=args.sample_drafts,
        spec_policy=args.spec_policy,
    )


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of `args` as command-line words (for worker subprocesses).

    Derived from `_add_engine_args` itself, so a new engine flag is forwarded without edits here.
    """
    probe = argparse.ArgumentParser(add_help=False)
    _add_engine_args(probe)
    argv: list[str] = []
    for action in probe._actions:
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        argv += [flag] if action.nargs == 0 else [flag, str(value)]
    return argv


def _add_prompt_args(p: argparse.ArgumentParser, required: bool) -> None:
    prompt = p.add_mutually_exclusive_group(required=required)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", type=_token_ids, help="comma-separated token ids")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for the service's answer"
    )
    _add_key_args(p, "client", f"default: ${KEYS_ENV}; none: no authentication")


def _add_key_args(p: argparse.ArgumentParser, role: str, default: str) -> None:
    p.add_argument(
        "--keys",
        default=None,
        help=f"a key directory from `specserve keys generate`, to authenticate with CURVE "
        f"({default})",
    )
    if role != "control":
        p.add_argument(
            "--key-name",
            default=role,
            help=f"this {role}'s key pair: {role}s/NAME.key_secret in --keys (default: {role})",
        )


def _add_redis_args(p: argparse.ArgumentParser, what: str) -> None:
    """--redis-url (no password: arguments are public) and --redis-url-file."""
    p.add_argument(
        "--redis-url",
        type=_redis_url_argument,
        default=None,
        help=f"{what}: redis://HOST:PORT/DB or rediss:// (TLS), without a password (default: "
        "$SPECSERVE_REDIS_URL)",
    )
    p.add_argument(
        "--redis-url-file",
        default=None,
        metavar="PATH",
        help="read the Redis URL from this file instead, e.g. redis://:PASSWORD@HOST:PORT/DB",
    )


def redis_url(args: argparse.Namespace) -> str | None:
    """The Redis URL from --redis-url, --redis-url-file or $SPECSERVE_REDIS_URL, else None."""
    from specserve.cache_index.redis_url import resolve_redis_url

    return resolve_redis_url(args.redis_url, args.redis_url_file)


def _add_routing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routing", default="prefix", choices=["prefix", "round-robin"])
    p.add_argument("--policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--hash-algo", default="sha256", choices=HASH_ALGORITHMS)
    p.add_argument(
        "--metrics-port", type=_port, default=None, help="serve Prometheus metrics on this port"
    )


_LIMIT_HELP = {
    "max_message_bytes": "largest inbound message; a larger one drops its connection",
    "max_nesting_depth": "deepest nesting of containers in one message",
    "max_frame_objects": "most MessagePack objects in one message",
    "max_prompt_tokens": "longest prompt (also at most each worker's max_model_len - 1)",
    "max_pending_per_client": "unfinished requests one client socket may have",
    "max_registration_blocks": "KV blocks one worker may register",
    "max_registration_seqs": "max_num_seqs one worker may register",
    "max_registration_string": "characters of a registering worker's device and spec method",
    "socket_hwm": "messages queued per peer and direction; a client leaving more outputs "
    "unread counts as gone",
}


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    """`--max-...` flags for every field of ServiceLimits (control/limits.py), same defaults."""
    from specserve.control.limits import ServiceLimits

    group = p.add_argument_group("input limits (what one peer may make the control plane spend)")
    for f in dataclasses.fields(ServiceLimits):
        group.add_argument(
            "--" + f.name.replace("_", "-"), type=_positive_int, default=f.default,
            help=f"{_LIMIT_HELP[f.name]} (default: {f.default})",
        )  # fmt: skip


def service_limits(args: argparse.Namespace) -> ServiceLimits:
    from specserve.control.limits import ServiceLimits

    names = [f.name for f in dataclasses.fields(ServiceLimits)]
    return ServiceLimits(**{name: getattr(args, name) for name in names})


def limit_argv(args: argparse.Namespace) -> list[str]:
    """The limit flags that differ from their defaults, to forward to `specserve control`."""
    from specserve.control.limits import ServiceLimits

    argv = []
    for f in dataclasses.fields(ServiceLimits):
        if getattr(args, f.name) != f.default:
            argv += ["--" + f.name.replace("_", "-"), str(getattr(args, f.name))]
    return argv


# --- parser ----------------------------------------------------------------------------------


def _add_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate text for one prompt, in-process or from a running service (--url)",
        description="Generate for one prompt. Without --url the model is loaded in this process; "
        "with --url the prompt goes to a running control plane and the engine flags are ignored.",
    )
    gen.add_argument(
        "--url",
        type=_service_url,
        default=None,
        help="a running control plane (tcp://HOST:PORT): send the prompt there instead of "
        "loading the model; engine flags are then ignored",
    )
    _add_client_args(gen)
    _add_engine_args(gen.add_argument_group("engine (in-process only: ignored with --url)"))
    _add_prompt_args(gen, required=True)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)


def _add_control(sub: argparse._SubParsersAction) -> None:
    ctl = sub.add_parser("control", help="run the control plane (scheduler, router, index)")
    ctl.add_argument("--bind", default="tcp://*:5555", help="ZeroMQ address for clients")
    ctl.add_argument(
        "--worker-bind", default=None, help="ZeroMQ address for workers (default: --bind's port+1)"
    )
    _add_key_args(ctl, "control", "needed to listen beyond loopback, unless --insecure")
    ctl.add_argument(
        "--insecure",
        action="store_true",
        help="listen on a non-loopback address without keys (only on a network where every "
        "peer is trusted: anyone reaching the worker port can act as a worker)",
    )
    _add_redis_args(ctl, "the prefix index (default: none)")
    ctl.add_argument("--model", default="smollm2-135m", help="the model the workers serve")
    ctl.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=3.0,
        help="seconds without a heartbeat before a worker counts as dead",
    )
    ctl.add_argument(
        "--step-timeout",
        type=float,
        default=120.0,
        help="seconds a worker may take for one step before its requests move elsewhere",
    )
    _add_routing_args(ctl)
    ctl.add_argument(
        "--advertise-url",
        default=None,
        help="where other control planes reach this one's client port, to forward requests "
        "(default: --bind, a wildcard host replaced by this host's address)",
    )
    ctl.add_argument(
        "--forward-min-tokens",
        type=int,
        default=32,
        help="with several control planes on one Redis index: send a request to the plane "
        "whose worker caches at least this many more of its tokens than any worker here "
        "(0: never forward)",
    )
    ctl.add_argument(
        "--resume-hold",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="how long a request its client resumed here waits for the worker that holds its "
        "KV (moving here after its control plane died) before it is computed again elsewhere",
    )
    _add_limit_args(ctl)
    _add_ready_file_arg(ctl, "while at least one worker is registered")
    ctl.set_defaults(func=cmd_control)


def _add_worker(sub: argparse._SubParsersAction) -> None:
    wrk = sub.add_parser("worker", help="run one GPU/CPU worker for a control plane")
    wrk.add_argument(
        "--control",
        type=_service_urls,
        default=(DEFAULT_WORKER_URL,),
        help="the control plane's worker port (its --bind port + 1 unless --worker-bind); "
        "several, separated by commas: serve one, and move to the next when it goes",
    )
    _add_key_args(wrk, "worker", "needed when the control plane runs with --keys")
    wrk.add_argument("--worker-id", type=_worker_id, default=None, help="default: host and pid")
    wrk.add_argument("--heartbeat-interval", type=float, default=0.5, help="seconds")
    _add_thread_args(wrk)
    _add_ready_file_arg(wrk, "while it is registered with a control plane and serving")
    wrk.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM the control plane moves this worker's requests to others, then lets it "
        "exit; it exits after this many seconds at most (a second SIGTERM stops it at once)",
    )
    _add_engine_args(wrk)
    wrk.set_defaults(func=cmd_worker)


def _add_ready_file_arg(p: argparse.ArgumentParser, when: str) -> None:
    p.add_argument(
        "--ready-file",
        default=None,
        metavar="PATH",
        help=f"a file that exists {when} (for a Kubernetes exec probe: test -f PATH)",
    )


def _add_thread_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="threads for the model (default: one per core this worker may use: its CPU "
        "affinity, within a cgroup CPU quota)",
    )
    p.add_argument(
        "--cpus",
        type=_cpu_list,
        default=None,
        help="pin the worker to these cores, e.g. 0-3 or 0,2 (default: not pinned)",
    )


def _add_api(sub: argparse._SubParsersAction) -> None:
    api = sub.add_parser(
        "api",
        help="serve the OpenAI-compatible HTTP API for a running control plane",
        description="An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics) over the client SDK. Stateless: run as many as you like "
        "beside one control plane.",
    )
    api.add_argument(
        "--control",
        type=_service_urls,
        default=(DEFAULT_SERVICE_URL,),
        help="the control plane; several, separated by commas, are tried in turn when the one "
        "in use goes away (requests in flight resume there)",
    )
    _add_key_args(api, "client", "needed when the control plane runs with --keys")
    api.add_argument("--host", default="127.0.0.1", help="address to listen on")
    api.add_argument("--port", type=_port, default=8000)
    _add_api_serving_args(api)
    api.add_argument(
        "--tokenizer",
        default=None,
        help="bundled model or checkpoint directory whose tokenizer names tokens in logprobs "
        "and echoes token prompts (default: the control plane's model)",
    )
    api.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds a request may take"
    )
    api.set_defaults(func=cmd_api)


def _add_api_serving_args(p: ArgTarget) -> None:
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name HTTP clients give (default: the served model's)",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=_positive_int,
        default=256,
        help="requests the HTTP API serves at once; more get 429",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=32 << 20,
        help="the largest HTTP request body the API reads; a larger one gets 413",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help=f"require 'Authorization: Bearer KEY' on /v1/... with a key from this file (one "
        f"per line; # comments); or one key in ${API_KEY_ENV} (default: no HTTP authentication)",
    )


def api_serving_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--max-concurrent-requests", str(args.max_concurrent_requests)]
    argv += ["--max-body-bytes", str(args.max_body_bytes)]
    if args.served_model_name is not None:
        argv += ["--served-model-name", args.served_model_name]
    if args.api_key_file is not None:
        argv += ["--api-key-file", os.path.abspath(args.api_key_file)]
    return argv


API_KEY_ENV = "SPECSERVE_API_KEY"


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The HTTP API's keys, from --api-key-file or $SPECSERVE_API_KEY (never from the command
    line, where every user of the machine could read them)."""
    if args.api_key_file is None:
        key = os.environ.get(API_KEY_ENV, "").strip()
        return (key,) if key else ()
    try:
        text = Path(args.api_key_file).read_text()
    except OSError as exc:
        raise CliError(f"cannot read --api-key-file: {exc}") from None
    keys = tuple(k for k in (line.strip() for line in text.splitlines()) if k and k[0] != "#")
    if not keys:
        raise CliError(f"--api-key-file {args.api_key_file} holds no key")
    return keys


def _add_up(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser(
        "up",
        help="start Redis, a control plane and workers locally; optionally answer one prompt",
        description="Start a local service: Redis (unless --redis-url), a control plane on "
        "127.0.0.1:--port and --workers workers. Without --prompt it serves until Ctrl-C; with "
        "--prompt it answers that prompt, stops everything and exits.",
    )
    up.add_argument("--workers", type=_positive_int, default=1)
    up.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="threads per worker (default: each worker is pinned to its own share of the "
        "cores and runs one thread per core of it)",
    )
    up.add_argument(
        "--no-pin",
        action="store_true",
        help="let every worker use every core (one thread per core each): better when the "
        "load is uneven (one busy worker gets the whole machine), ~10%% worse when every "
        "worker is busy",
    )
    up.add_argument(
        "--control-planes",
        type=_positive_int,
        default=1,
        help="active-active control planes sharing the Redis index; plane i takes ports "
        "--port + 2i (clients) and + 2i + 1 (workers); workers and the API move to a live one "
        "when theirs goes, and requests in flight resume there",
    )
    up.add_argument(
        "--port", type=_port, default=5555, help="control plane port on 127.0.0.1 (clients)"
    )
    _add_redis_args(up, "use this Redis instead of a private one")
    up.add_argument(
        "--ready-timeout", type=float, default=300.0, help="seconds to wait for the workers"
    )
    _add_routing_args(up)
    _add_limit_args(up)
    _add_engine_args(up.add_argument_group("engine (every worker)"))
    _add_prompt_args(up, required=False)
    _add_sampling_args(up)
    up.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for the service's answer"
    )
    up.add_argument(
        "--keys",
        default=None,
        help=f"the service's key directory, generated if empty (default: ${KEYS_ENV}, else "
        "$SPECSERVE_CACHE_DIR/keys, i.e. ~/.cache/specserve/keys)",
    )
    up.add_argument(
        "--insecure", action="store_true", help="no authentication (loopback only anyway)"
    )
    up.add_argument(
        "--api-port",
        type=_port,
        default=8000,
        help="port of the OpenAI-compatible HTTP API on 127.0.0.1 (started when serving)",
    )
    up.add_argument("--no-api", action="store_true", help="serve without the HTTP API")
    _add_api_serving_args(up)
    up.set_defaults(func=cmd_up, key_name="client")


def _add_cache(sub: argparse._SubParsersAction) -> None:
    cache = sub.add_parser("cache", help="inspect the Redis prefix index")
    views = cache.add_subparsers(dest="view", required=True)
    helps = {
        "stats": "workers, block counts and key counts per namespace",
        "workers": "the worker registry per namespace",
        "lookup": "which workers hold the prefix of a prompt",
    }
    for name, text in helps.items():
        view = views.add_parser(name, help=text, description=text)
        _add_redis_args(view, "the index")
        view.add_argument(
            "--model",
            default=None,
            help="one namespace's model; default: every namespace found in Redis (a SCAN)",
        )
        view.add_argument("--block-size", type=_positive_int, default=16, help="with --model")
        view.add_argument(
            "--hash-algo", default="sha256", choices=HASH_ALGORITHMS, help="with --model"
        )
        view.add_argument(
            "--json",
            action="store_true",
            help="print JSON: one object with --model, else a list with one per namespace",
        )
        if name == "lookup":
            _add_prompt_args(view, required=True)
        view.set_defaults(func=cmd_cache)


def _add_kernels(sub: argparse._SubParsersAction) -> None:
    kernels = sub.add_parser(
        "kernels", help="build or inspect the CPU kernels; prebuild the FlashInfer kernels"
    )
    actions = kernels.add_subparsers(dest="action", required=True)
    helps = {
        "build": "compile the CPU kernels for this CPU ahead of time (e.g. in an image build) "
        "and print the library's path",
        "status": "where the CPU kernels are looked for, and whether this CPU's library is there",
    }
    for name, text in helps.items():
        action = actions.add_parser(name, help=text, description=text)
        action.add_argument(
            "--dir",
            default=None,
            help="the kernels directory (default: $SPECSERVE_KERNELS_DIR, else "
            "$SPECSERVE_CACHE_DIR/kernels, else ~/.cache/specserve/kernels)",
        )
        if name == "build":
            action.add_argument(
                "--force", action="store_true", help="compile even if the library is there"
            )
        action.set_defaults(func=cmd_kernels_build if name == "build" else cmd_kernels_status)
    text = (
        "compile FlashInfer's attention kernels ahead of time (no GPU needed; nvcc and the CUDA "
        "toolkit are) and install them where FlashInfer loads them without compiling"
    )
    flashinfer = actions.add_parser("flashinfer", help=text, description=text)
    flashinfer.add_argument(
        "--arch",
        nargs="+",
        default=["9.0a"],
        help="CUDA targets, as FLASHINFER_CUDA_ARCH_LIST names them (default: 9.0a, "
        "H100/H200; 8.0 for A100, 8.9 for L4/L40S)",
    )
    flashinfer.add_argument(
        "--head-dims", nargs="+", type=int, default=[64, 128, 256], help="model head dims"
    )
    flashinfer.add_argument(
        "--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16"]
    )
    flashinfer.set_defaults(func=cmd_kernels_flashinfer)


def _add_keys(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("keys", help="make CURVE keys for the control plane, workers, clients")
    actions = keys.add_subparsers(dest="action", required=True)
    text = (
        "write DIR/control.key(_secret), DIR/workers/NAME.key(_secret) and "
        "DIR/clients/NAME.key(_secret) (mode 0600, folders 0700); existing keys are never "
        "overwritten"
    )
    gen = actions.add_parser("generate", help=text, description=text)
    gen.add_argument("dir", help="the key directory")
    gen.add_argument("--workers", default="worker", help="comma-separated worker key names")
    gen.add_argument("--clients", default="client", help="comma-separated client key names")
    gen.set_defaults(func=cmd_keys_generate)


def cmd_keys_generate(args: argparse.Namespace) -> int:
    from specserve.shared.curve import generate_keys

    names = {}
    for role in ("workers", "clients"):
        names[role] = tuple(n.strip() for n in getattr(args, role).split(",") if n.strip())
        for name in names[role]:
            if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", name):
                raise CliError(f"key name {name!r} must be 1-64 characters from [A-Za-z0-9._-]")
    for path in generate_keys(args.dir, names["workers"], names["clients"]):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve", description="LLM serving with speculative decoding."
    )
    _add_logging_args(parser, None, False)
    sub = parser.add_subparsers(dest="command", required=True)
    commands = (
        _add_generate, _add_control, _add_worker, _add_up, _add_api, _add_cache, _add_kernels,
        _add_keys, train_command,
    )  # fmt: skip
    for add in commands:
        add(sub)
    # The logging flags also work after the subcommand (`specserve control --log-json`); there
    # they default to "not given", so they never undo the same flag given before it.
    for command in _leaf_parsers(sub):
        _add_logging_args(command, argparse.SUPPRESS, argparse.SUPPRESS)
    return parser


def _add_logging_args(parser: argparse.ArgumentParser, level_default, json_default) -> None:
    parser.add_argument(
        "--log-level", default=level_default, help="debug, info, warning (default: info)"
    )
    parser.add_argument(
        "--log-json", action="store_true", default=json_default, help="log one JSON per line"
    )


def _leaf_parsers(sub: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    leaves = []
    for command in sub.choices.values():
        nested = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
        leaves.extend(_leaf_parsers(nested[0]) if nested else [command])
    return leaves


# --- generate --------------------------------------------------------------------------------


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags, validated before any model loads or request leaves."""
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
    params.validate()
    return params


def _prompt(args: argparse.Namespace) -> str | list[int]:
    return args.prompt if args.prompt is not None else args.prompt_ids


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    if args.url is not None:
        return generate_remote(args.url, args, params)
    _check_worker_installed()
    from specserve.llm import LLM

    llm = LLM(args.model, **_engine_kwargs(args))
    (out,) = llm.generate(_prompt(args), params, chat=args.chat)
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


def generate_remote(url: str, args: argparse.Namespace, params: SamplingParams) -> int:
    """One prompt through a running service: streamed text, or one JSON object with --json."""
    import zmq

    from specserve.client import Client, ServiceError

    try:
        keys = args.keys or os.environ.get(KEYS_ENV) or None
        with Client(url, timeout=args.timeout, keys=keys, key_name=args.key_name) as client:
            if args.json:
                completion = client.generate(_prompt(args), params, chat=args.chat)
                print(json.dumps(completion_json(completion)))
                return 0
            _print_stream(client.stream(_prompt(args), params, chat=args.chat))
            return 0
    except (ServiceError, zmq.ZMQError) as exc:
        raise CliError(f"{url}: {exc}") from None


def completion_json(completion: Any) -> dict:
    import msgspec

    result = {
        "request_id": completion.request_id,
        "prompt_token_ids": completion.prompt_token_ids,
        "token_ids": completion.token_ids,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "num_cached_tokens": completion.num_cached_tokens,
        "worker_id": completion.worker_id,
    }
    if getattr(completion, "spec", None) is not None:
        from specserve.control.request import SpecDecodingStats

        result["spec"] = spec_summary(SpecDecodingStats(**msgspec.structs.asdict(completion.spec)))
    return result


def _print_stream(outputs: Iterable[Any]) -> None:
    """Write text (or token ids, for a model without a tokenizer) as it arrives."""
    wrote = wrote_ids = False
    try:
        for out in outputs:
            if out.text is not None:
                sys.stdout.write(out.text)
            elif out.token_ids:
                sys.stdout.write(("," if wrote_ids else "") + ",".join(map(str, out.token_ids)))
                wrote_ids = True
            sys.stdout.flush()
            wrote = wrote or bool(out.text or out.token_ids)
    finally:
        if wrote:
            sys.stdout.write("\n")
            sys.stdout.flush()


# --- control and worker ----------------------------------------------------------------------


def control_args(args: argparse.Namespace) -> ControlArgs:
    from specserve.control.control_plane import ControlArgs

    return ControlArgs(
        bind=args.bind,
        worker_bind=args.worker_bind,
        keys=args.keys,
        insecure=args.insecure,
        redis_url=redis_url(args),
        model=args.model,
        routing=args.routing,
        heartbeat_timeout_s=args.heartbeat_timeout,
        step_timeout_s=args.step_timeout,
        metrics_port=args.metrics_port,
        policy=args.policy,
        hash_algo=args.hash_algo,
        limits=service_limits(args),
        ready_file=args.ready_file,
        advertise_url=args.advertise_url,
        forward_min_tokens=args.forward_min_tokens,
        resume_hold_s=args.resume_hold,
    )


def cmd_control(args: argparse.Namespace) -> int:
    from specserve.control.control_plane import run_control

    return run_control(control_args(args))


def worker_engine_args(args: argparse.Namespace) -> EngineArgs:
    from specserve.worker.engine import EngineArgs

    return EngineArgs(model=args.model, **_engine_kwargs(args))


def cmd_api(args: argparse.Namespace) -> int:
    from specserve.api import ApiSettings, run_api

    settings = ApiSettings(
        control=args.control,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        tokenizer=args.tokenizer,
        max_concurrent_requests=args.max_concurrent_requests,
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout,
        keys=_peer_keys(args, "clients"),
        key_name=args.key_name,
        api_keys=api_keys(args),
    )
    return run_api(settings)


def cmd_worker(args: argparse.Namespace) -> int:
    _check_worker_installed()
    from specserve.shared import cpus

    cpus.set_spin_default()  # before torch is imported
    if args.cpus is not None:
        cpus.pin(args.cpus)
    threads = args.threads or len(cpus.usable_cpus())
    from specserve.worker.worker_process import run_worker

    return run_worker(
        worker_engine_args(args),
        args.control,
        worker_id=args.worker_id,
        heartbeat_interval_s=args.heartbeat_interval,
        keys=_peer_keys(args, "workers"),
        drain_timeout_s=args.drain_timeout,
        threads=threads,
        ready_file=args.ready_file,
    )


def _peer_keys(args: argparse.Namespace, role: str) -> PeerKeys | None:
    """A worker's or client's keys, loaded before any slow work so that a bad path fails fast."""
    from specserve.shared.curve import PeerKeys

    if args.keys is None:
        return None
    return PeerKeys.load(args.keys, role, args.key_name)


# --- up --------------------------------------------------------------------------------------


def _check_model(model: str) -> None:
    """Fail in milliseconds, not after the workers have started, on a model that cannot load."""
    from pathlib import Path

    from specserve.shared.tokenizer import BUNDLED_MODELS

    if model not in BUNDLED_MODELS and not Path(model).is_dir():
        raise CliError(
            f"model {model!r} is neither a bundled model ({', '.join(BUNDLED_MODELS)}) "
            "nor a checkpoint directory"
        )


def _log_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--log-level", args.log_level] if args.log_level else []
    return argv + (["--log-json"] if args.log_json else [])


def up_plan(args: argparse.Namespace) -> UpPlan:
    """What `up` starts, as plain values (the launcher knows nothing of argparse)."""
    from specserve.launch.up import UpPlan

    control = ["--routing", args.routing, "--policy", args.policy, "--hash-algo", args.hash_algo]
    if args.metrics_port is not None:
        control += ["--metrics-port", str(args.metrics_port)]
    control += limit_argv(args)
    return UpPlan(
        model=args.model,
        block_size=args.block_size,
        hash_algo=args.hash_algo,
        workers=args.workers,
        control_planes=args.control_planes,
        threads_per_worker=args.threads,
        pin=not args.no_pin,
        port=args.port,
        redis_url=redis_url(args),
        control_flags=control,
        worker_flags=engine_argv(args),
        log_flags=_log_argv(args),
        ready_timeout_s=args.ready_timeout,
        keys=args.keys,
        api_flags=api_serving_argv(args),
        api_port=None
        if args.no_api or args.prompt is not None or args.prompt_ids is not None
        else args.api_port,
    )


def cmd_up(args: argparse.Namespace) -> int:
    from specserve.launch.up import LaunchError, run_up

    _check_worker_installed()
    _check_model(args.model)
    if not args.insecure:
        from specserve.shared.curve import default_keys_dir, ensure_keys

        args.keys = args.keys or os.environ.get(KEYS_ENV) or str(default_keys_dir())
        if ensure_keys(args.keys):
            print(f"[up] generated the service's keys in {args.keys}", file=sys.stderr)
    else:
        args.keys = None
    plan = up_plan(args)
    on_ready: Callable[[str], int] | None = None
    if args.prompt is not None or args.prompt_ids is not None:
        params = sampling_params(args)  # checked before anything starts

        def on_ready(url: str) -> int:
            return generate_remote(url, args, params)

    try:
        return run_up(plan, on_ready)
    except LaunchError as exc:
        raise CliError(str(exc)) from None


# --- cache -----------------------------------------------------------------------------------


def _cache_namespaces(client: Redis, args: argparse.Namespace) -> list[Namespace]:
    """The namespace of --model, else every namespace in Redis (notes on those we cannot read)."""
    from specserve.cache_index import Namespace, discover_namespaces

    if args.model is not None:
        return [Namespace.for_model(args.model, args.block_size, args.hash_algo)]
    found = discover_namespaces(client)
    for key in found.unknown_hasher:
        print(f"note: skipping {key}: unknown hash seed", file=sys.stderr)
    return found.namespaces


def _cache_report(client: Redis, ns: Namespace, args: argparse.Namespace) -> dict:
    """One view of one namespace, as plain JSON values."""
    import msgspec

    from specserve.cache_index import lookup_prompt_blocks, stats, worker_list

    if args.view == "stats":
        report = stats(client, ns)
    elif args.view == "workers":
        report = worker_list(client, ns)
    else:
        model = args.model if args.model is not None else ns.model  # the path, not its key name
        report = lookup_prompt_blocks(client, ns, _lookup_tokens(args, model))
    return msgspec.to_builtins(report)


def cmd_cache(args: argparse.Namespace) -> int:
    import redis

    from specserve.cache_index import CacheIndexError, connect
    from specserve.cache_index.redis_url import REDIS_URL_ENV, redact

    url = redis_url(args)
    if url is None:
        raise CliError(f"give --redis-url or --redis-url-file, or set {REDIS_URL_ENV}")
    client = connect(url, socket_timeout=5.0, connect_timeout=2.0)
    try:
        reports = [_cache_report(client, ns, args) for ns in _cache_namespaces(client, args)]
    except (CacheIndexError, redis.RedisError) as exc:
        raise CliError(f"redis at {redact(url)}: {exc}") from None
    finally:
        client.close()
    if args.json:
        print(json.dumps(reports[0] if args.model is not None else reports))
    elif not reports:
        print(f"no specserve index in {redact(url)}", file=sys.stderr)
    else:
        print("\n\n".join(_render(args.view, report) for report in reports))
    return 0


def _lookup_tokens(args: argparse.Namespace, model: str) -> list[int]:
    """The prompt's token ids, tokenized as the control plane would for `model`."""
    if args.prompt_ids is not None:
        return args.prompt_ids
    from specserve.shared.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise CliError(f"model {model!r} has no tokenizer: pass --prompt-ids")
    return tokenizer.encode_prompt(args.prompt, args.chat)


# --- cache: readable output ------------------------------------------------------------------


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Left-aligned columns, two spaces apart."""
    cells = [[str(c) for c in headers], *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _render(view: str, report: dict) -> str:
    body = {"stats": _render_stats, "workers": _render_workers, "lookup": _render_lookup}[view]
    return f"{report['namespace']}\n{body(report)}"


def _render_stats(s: dict) -> str:
    summary = table(
        ["live workers", "live entries", "fenced epochs", "fenced entries", "block keys <=",
         "registry keys", "db keys"],
        [[s["live_workers"], s["live_entries"], s["fenced_epochs"], s["fenced_entries"],
          s["block_keys_upper_bound"], s["registry_keys"], s["db_keys"]]],
    )  # fmt: skip
    rows = [[w["worker_id"], w["epoch"], _yes(w["live"]), w["blocks"]] for w in s["workers"]]
    return f"{summary}\n\n{table(['worker', 'epoch', 'live', 'blocks'], rows)}"


def _ms_time(ms: int | None) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _render_workers(report: dict) -> str:
    rows = [
        [w["worker_id"], w["epoch"], _yes(w["live"]), w["state"],
         f"{w['heartbeat_age_ms'] / 1000:.1f}s", _ms_time(w["registered_ms"]),
         json.dumps(w["info"], separators=(",", ":"))]
        for w in report["workers"]
    ]  # fmt: skip
    headers = ["worker", "epoch", "live", "state", "heartbeat age", "registered (UTC)", "info"]
    return table(headers, rows)


def _render_lookup(r: dict) -> str:
    head = (
        f"tokens {r['num_tokens']}, full blocks {r['num_full_blocks']}, "
        f"best worker {r['best_worker'] or '-'}"
    )
    rows = [[w, n, r["usable_blocks"][w]] for w, n in sorted(r["matched_blocks"].items())]
    hashes = "\n".join(f"  {i:>4}  {h}" for i, h in enumerate(r["block_hashes"]))
    parts = [head, table(["worker", "matched blocks", "usable blocks"], rows)]
    return "\n\n".join([*parts, f"block hashes:\n{hashes}"] if hashes else parts)


# --- kernels ---------------------------------------------------------------------------------


def cmd_kernels_build(args: argparse.Namespace) -> int:
    """Compile and load the library (a build that does not load fails here, not in a worker)."""
    _check_worker_installed()
    from pathlib import Path

    from specserve.worker.cpu import kernels

    try:
        path = kernels.build(Path(args.dir) if args.dir else None, force=args.force)
        kernels.open_library(path)
    except kernels.KernelsUnavailable as exc:
        raise CliError(f"cannot build the CPU kernels: {exc}") from None
    print(path)
    return 0


def cmd_kernels_flashinfer(args: argparse.Namespace) -> int:
    _check_worker_installed()
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        raise CliError("FlashInfer is not installed: pip install 'specserve[gpu]'")
    from specserve.worker.attention import flashinfer_aot

    for path in flashinfer_aot.build(args.head_dims, args.dtypes, args.arch):
        print(path)
    return 0


def cmd_kernels_status(args: argparse.Namespace) -> int:
    _check_worker_installed()
    from pathlib import Path

    from specserve.worker.cpu import kernels

    for key, value in kernels.status(Path(args.dir) if args.dir else None).items():
        print(f"{key}: {value}")
    return 0


# --- entry point -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    die_with_launcher()  # a child of `specserve up` never outlives it
    try:
        configure_logging(args.log_level, args.log_json or None)
        return args.func(args)
    except (CliError, ValueError) as exc:  # bad input: a clear message, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
