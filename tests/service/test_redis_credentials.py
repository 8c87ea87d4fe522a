"""A Redis password never sits on a process's command line: `--redis-url` refuses one, and
`--redis-url-file` or SPECSERVE_REDIS_URL bring it instead, against a real password-protected
Redis; `specserve up` hands it to its control plane in the environment, never in arguments."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from hf_reference import hf_greedy
from service_harness import start_up, up_ports

from specserve.cache_index import connect
from specserve.cache_index.redis_url import REDIS_URL_ENV, redact, resolve_redis_url
from specserve.cli import build_parser
from specserve.client import Client
from specserve.launch.local_redis import LocalRedis, RedisNotFound
from specserve.shared.protocol import SamplingParams

PASSWORD = "s3cret-Pw"


def specserve(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "specserve.cli", *argv]
    full_env = {k: v for k, v in os.environ.items() if k != REDIS_URL_ENV} | (env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=full_env)


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A private Redis that requires PASSWORD, its URL with the password, and that URL in a
    file only this user can read."""
    try:
        server = LocalRedis(tmp_path).start()
    except RedisNotFound as exc:
        pytest.skip(str(exc))
    try:
        admin = redis.Redis(host="127.0.0.1", port=server.port)
        admin.config_set("requirepass", PASSWORD)  # at run time: not in the server's argv
        admin.close()
        url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
        path = tmp_path / "redis-url"
        path.write_text(url + "\n")
        path.chmod(0o600)
        yield url, path
    finally:
        server.close()


# --- where the URL comes from ----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["control"],
        ["up"],
        ["cache", "stats"],
        ["cache", "workers"],
    ],
)
@pytest.mark.parametrize(
    "url",
    [f"redis://:{PASSWORD}@r:6379/0", f"rediss://app:{PASSWORD}@r/0", "redis://r/0?password=x"],
)
def test_a_password_on_the_command_line_is_refused_saying_where_it_goes(argv, url, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*argv, "--redis-url", url])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--redis-url must not hold a password" in err
    assert "--redis-url-file PATH" in err and REDIS_URL_ENV in err
    assert PASSWORD not in err and "password=x" not in err


def test_the_url_comes_from_the_flag_then_the_file_then_the_environment(tmp_path):
    path = tmp_path / "url"
    path.write_text(f"  rediss://:{PASSWORD}@db:6380/2\n")
    env = {REDIS_URL_ENV: "redis://from-env:6379/0"}
    assert resolve_redis_url("redis://flag:1/0", None, env) == "redis://flag:1/0"
    assert resolve_redis_url(None, str(path), env) == f"rediss://:{PASSWORD}@db:6380/2"
    assert resolve_redis_url(None, None, env) == "redis://from-env:6379/0"
    assert resolve_redis_url(None, None, {}) is None
    with pytest.raises(ValueError, match="not both"):
        resolve_redis_url("redis://flag:1/0", str(path), {})
    with pytest.raises(ValueError, match=f"--redis-url-file {tmp_path / 'nope'}: No such file"):
        resolve_redis_url(None, str(tmp_path / "nope"), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_redis_url(None, str(tmp_path / "empty"), {})
    path.write_text(f"http://:{PASSWORD}@db/0")
    with pytest.raises(ValueError, match=r"redis://, rediss:// \(TLS\) or unix://") as err:
        resolve_redis_url(None, str(path), {})
    assert PASSWORD not in str(err.value) and "http://:***@db/0" in str(err.value)
    # rediss:// is TLS all the way to the client.
    tls = connect(f"rediss://:{PASSWORD}@db:6380/2")
    assert tls.connection_pool.connection_class is redis.SSLConnection
    assert tls.connection_pool.connection_kwargs["password"] == PASSWORD
    assert redact(f"rediss://:{PASSWORD}@db:6380/2") == "rediss://:***@db:6380/2"


# --- against a password-protected Redis ------------------------------------------------------


def test_cache_views_read_the_password_from_a_file_or_the_environment(secured):
    url, path = secured
    bare = re.sub(r":[^:@/]+@", "", url)  # the same server without the password
    refused = specserve("cache", "stats", "--redis-url", bare, "--json")
    assert refused.returncode == 2 and re.search(r"(?i)\bauth", refused.stderr), refused.stderr
    by_file = specserve("cache", "stats", "--redis-url-file", str(path), "--json")
    assert by_file.returncode == 0, by_file.stderr
    assert json.loads(by_file.stdout) == []
    by_env = specserve("cache", "workers", "--json", env={REDIS_URL_ENV: url})
    assert by_env.returncode == 0, by_env.stderr
    assert json.loads(by_env.stdout) == []
    none = specserve("cache", "stats")
    assert none.returncode == 2
    assert "give --redis-url or --redis-url-file, or set SPECSERVE_REDIS_URL" in none.stderr


def test_up_gives_its_control_plane_the_password_by_environment_only(secured, llama_ckpt):
    url, path = secured
    port, api_port = up_ports()
    argv = [
        "up", "--workers", "1", "--port", str(port), "--model", str(llama_ckpt.path),
        "--redis-url-file", str(path), "--num-blocks", "64", "--block-size", "4",
        "--max-model-len", "256",
        "--api-port", str(api_port),
    ]  # fmt: skip
    # Serving means the worker is live in the index: the control plane authenticated.
    up, lines = start_up(argv)
    try:
        pids = {
            name: int(pid)
            for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", "".join(lines))
        }
        assert set(pids) == {"control", "worker-0", "api"}
        for name, pid in [*pids.items(), ("up", up.pid)]:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert PASSWORD.encode() not in cmdline, name
        control_env = Path(f"/proc/{pids['control']}/environ").read_bytes().split(b"\0")
        assert f"{REDIS_URL_ENV}={url}".encode() in control_env
        for child in ("worker-0", "api"):  # only the control plane talks to Redis
            assert PASSWORD.encode() not in Path(f"/proc/{pids[child]}/environ").read_bytes()
        keys = os.environ["SPECSERVE_KEYS"]  # where `up` made its keys
        with Client(f"tcp://127.0.0.1:{port}", timeout=60, keys=keys) as client:
            params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
            out = client.generate([1, 2, 3], params)
        assert out.token_ids == hf_greedy(llama_ckpt.hf_model, [1, 2, 3], 5)
        admin = connect(url)
        try:  # the control plane wrote its index into the protected Redis
            assert list(admin.scan_iter(match=b"ssi:*:live", count=1000))
        finally:
            admin.close()
        up.terminate()
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    log = "".join(lines)
    assert PASSWORD not in log
    assert "redis redis://:***@127.0.0.1:" in log
