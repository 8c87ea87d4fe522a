"""Rendered and run: the chart's containers, started as processes on this machine.

The chart is rendered with the Helm SDK; the Redis, control plane, worker and HTTP API containers'
commands, arguments and environment are taken exactly as rendered, with only what a pod has
that a process here does not mapped: Service names to 127.0.0.1, the mounted Secret to a key
directory made by `specserve keys generate`, each pod's emptyDirs to its own temporary
directory, $(VAR) references expanded as the kubelet expands them. Then a request is served
through them, over ZeroMQ with the SDK and over HTTP: the chart's wiring is what runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_chart import FULLNAME, _container, _render, needs_helm

from specserve.client import Client, SamplingParams, get_status
from specserve.launch.local_redis import free_port
from specserve.shared.curve import generate_keys

VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _pod_env(container: dict[str, Any], pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it (fieldRef and $(VAR) expanded)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = VAR.sub(lambda m: env.get(m.group(1), m.group(0)), item["value"])
        elif item["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[item["name"]] = pod_name
        else:
            raise AssertionError(f"no stand-in for {item}")
    return env


def _process(
    container: dict[str, Any], pod_name: str, mapping: dict[str, str], log: Path
) -> subprocess.Popen:
    """Start the container's command as a process: its image's `specserve` is ours."""
    env = _pod_env(container, pod_name)

    # One pass, longest first, so a path that was mapped is never mapped again.
    pattern = re.compile("|".join(re.escape(k) for k in sorted(mapping, key=len, reverse=True)))

    def mapped(word: str) -> str:
        word = VAR.sub(lambda m: env.get(m.group(1), m.group(0)), word)
        return pattern.sub(lambda m: mapping[m.group(0)], word)

    argv = [mapped(w) for w in container["command"] + container.get("args", [])]
    if argv[0] == "specserve":
        argv = [sys.executable, "-m", "specserve.cli", *argv[1:]]
    process_env = {**os.environ, **{k: mapped(v) for k, v in env.items()}}
    process_env["OMP_NUM_THREADS"] = "1"
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=process_env)


@needs_helm
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")
def test_the_rendered_chart_serves_a_request(tmp_path: Path) -> None:
    port, worker_port, metrics_port, api_port, redis_port = (free_port() for _ in range(5))
    objs = _render(
        "--set", f"control.port={port},control.workerPort={worker_port}",
        "--set", f"control.metricsPort={metrics_port},api.port={api_port}",
        "--set", "worker.kvCacheMemoryMb=64",
    )  # fmt: skip
    keys = tmp_path / "keys"
    generate_keys(keys)
    redis = _container(objs[("Deployment", f"{FULLNAME}-redis")])
    control = _container(objs[("Deployment", f"{FULLNAME}-control")])
    worker = _container(objs[("Deployment", f"{FULLNAME}-worker")])
    api = _container(objs[("Deployment", f"{FULLNAME}-api")])
    processes: list[subprocess.Popen] = []

    def start(container: dict[str, Any], name: str, extra: dict[str, str] | None = None):
        pod = tmp_path / name  # this pod's emptyDirs
        (pod / "tmp").mkdir(parents=True)
        (pod / "cache").mkdir()
        mapping = {
            f"{FULLNAME}-redis:6379": f"127.0.0.1:{redis_port}",
            f"{FULLNAME}-control:": "127.0.0.1:",
            "tcp://*:": "tcp://127.0.0.1:",
            "/etc/specserve/keys": str(keys),
            "/var/cache/specserve": str(pod / "cache"),
            "/tmp": str(pod / "tmp"),
            **(extra or {}),
        }
        processes.append(_process(container, f"{name}-pod", mapping, tmp_path / f"{name}.log"))
        return pod

    try:
        # as rendered, plus a port of its own (this machine may already run a Redis on 6379)
        redis_argv = redis["command"] + redis["args"] + ["--port", str(redis_port)]
        processes.append(subprocess.Popen(redis_argv, stdout=subprocess.DEVNULL, cwd=tmp_path))
        control_pod = start(control, "control")
        worker_pod = start(worker, "worker")
        start(api, "api")
        url = f"tcp://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if get_status(url, keys=keys).live_workers == 1:
                    break
            except Exception:
                pass
            for p in processes:
                assert p.poll() is None, "".join(
                    (tmp_path / f"{n}.log").read_text()[-2000:] for n in ("control", "worker")
                )
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
            time.sleep(0.5)
        # the readiness files the probes test
        ready_deadline = time.monotonic() + 10
        while not (control_pod / "tmp" / "specserve-ready").exists():
            assert time.monotonic() < ready_deadline
            time.sleep(0.2)
        assert (worker_pod / "tmp" / "specserve-ready").exists()

        params = SamplingParams(max_tokens=8, temperature=0.0)
        with Client(url, keys=keys, timeout=120) as client:
            out = client.generate("The capital of France is", params)
        assert len(out.token_ids) == 8 and out.worker_id == "worker-pod"
        body = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 8,
                "temperature": 0}  # fmt: skip
        api_url = f"http://127.0.0.1:{api_port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{api_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "api.log").read_text()[-3000:]
            time.sleep(0.5)
        reply = httpx.post(f"{api_url}/v1/completions", json=body, timeout=120).json()
        assert reply["choices"][0]["text"] == out.text
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        assert "specserve_workers 1.0" in metrics
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
            p.wait(10)
