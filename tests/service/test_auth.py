"""Authenticated roles against a live service (a real Redis, a control plane on real CURVE
sockets, a worker process): forged registrations, heartbeats and results, from no key, a client
key, another worker's key or a borrowed identity, are refused; the real worker is never displaced
and a legitimate client gets exactly the greedy tokens transformers computes on the same weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest
import zmq
from hf_reference import hf_greedy
from service_harness import Service, up_ports

from specserve.client import AsyncClient, Client, ServiceUnreachable, fetch_status, get_status
from specserve.control.control_plane import ControlArgs, ControlPlane
from specserve.shared import protocol
from specserve.shared.curve import CLIENTS, WORKERS, PeerKeys, generate_keys, load_pair
from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    ErrorReply,
    Heartbeat,
    Register,
    Rejected,
    RequestResult,
    SamplingParams,
    StepResult,
)

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
N = 12
NO_REPLY_S = 1.5  # a CURVE handshake on loopback takes milliseconds


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("keys") / "keys"
    generate_keys(root, workers=("worker", "rogue"), clients=("client", "other"))
    return root


@pytest.fixture(scope="module")
def svc(llama_ckpt, redis_url: str, keys: Path, tmp_path_factory) -> Iterator[Service]:
    service = Service(
        str(llama_ckpt.path), redis_url, tmp_path_factory.mktemp("auth"), keys=str(keys)
    )
    try:
        service.start("w0")
        yield service
    finally:
        service.close()


@pytest.fixture(scope="module")
def expected(llama_ckpt) -> list[int]:
    return hf_greedy(llama_ckpt.hf_model, PROMPT, N)


def assert_still_serving(svc: Service, keys: Path, expected: list[int]) -> None:
    """The client key gets the exact greedy tokens, from the one real worker, which keeps its
    registration."""
    assert svc.plane is not None
    before = svc.plane.workers["w0"]
    with Client(svc.url, timeout=60, keys=keys) as client:
        out = client.generate(PROMPT, greedy(N))
    assert (out.token_ids, out.worker_id) == (expected, "w0")
    assert svc.workers["w0"].poll() is None
    assert svc.plane.workers == {"w0": before}


@contextmanager
def dealer(
    url: str, keys: PeerKeys | None = None, identity: bytes | None = None
) -> Iterator[zmq.Socket]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if keys is not None:
        keys.apply(sock)
    sock.connect(url)
    try:
        yield sock
    finally:
        sock.close()


def try_send(sock: zmq.Socket, frame: bytes) -> bool:
    try:
        sock.send(frame, zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


def reply(sock: zmq.Socket, timeout_s: float) -> protocol.Message | None:
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return protocol.decode(sock.recv())


def worker_info(svc: Service, worker_id: str) -> protocol.WorkerInfo:
    """The real worker's own registration claims, to forge or replay."""
    assert svc.plane is not None
    return msgspec.structs.replace(svc.plane.workers["w0"].info, worker_id=worker_id)


def real_register(svc: Service) -> bytes:
    assert svc.plane is not None
    return protocol.encode(Register(PROTOCOL_VERSION, svc.plane.workers["w0"].info))


# --- who may connect -------------------------------------------------------------------------


def test_the_client_key_is_served_exactly(svc, keys, expected) -> None:
    assert svc.plane is not None and svc.plane.authenticated
    assert (
        svc.plane.workers["w0"].key == PeerKeys.load(keys, WORKERS, "worker").pair.public.decode()
    )
    assert_still_serving(svc, keys, expected)


REFUSALS = {
    "no key": "the CURVE handshake failed: it requires keys that were not given here",
    "unknown key": "does not accept this key",
    "worker key": "does not accept this key",  # a worker's key is no client's
    "wrong control key": "the CURVE handshake failed: it requires keys that were not given here",
}


def stranger_keys(keys: Path, tmp_path: Path, who: str) -> PeerKeys | None:
    """What a client without a client key of this service connects with."""
    generate_keys(tmp_path / "stranger")
    real = PeerKeys.load(keys, CLIENTS, "client")
    other = PeerKeys.load(tmp_path / "stranger", CLIENTS, "client")
    if who == "unknown key":  # the service's public key, a pair it has never seen
        return dataclasses.replace(real, pair=other.pair)
    if who == "worker key":
        return PeerKeys.load(keys, WORKERS, "worker")
    if who == "wrong control key":  # a real client pair, another service's public key
        return dataclasses.replace(real, server=other.server)
    return None


@pytest.mark.parametrize("who", sorted(REFUSALS))
def test_a_client_without_a_client_key_is_refused_at_once(
    svc, keys, expected, tmp_path, who
) -> None:
    """Refused by the handshake, and told so at the first send with the reason, not after the
    client's timeout (60 s here); nothing reaches the service, which goes on serving."""
    client_keys = stranger_keys(keys, tmp_path, who)
    with Client(svc.url, timeout=60, keys=client_keys) as client:
        start = time.monotonic()
        with pytest.raises(ServiceUnreachable, match=REFUSALS[who]):
            client.generate(PROMPT, greedy(N))
        assert time.monotonic() - start < 5
        with pytest.raises(ServiceUnreachable, match=REFUSALS[who]):  # and again, at once
            client.generate(PROMPT, greedy(N), timeout=60)
    assert_still_serving(svc, keys, expected)


def test_an_async_client_without_a_key_is_refused_at_once(svc, keys, expected) -> None:
    async def run() -> None:
        async with AsyncClient(svc.url, timeout=60) as client:
            with pytest.raises(ServiceUnreachable, match=REFUSALS["no key"]):
                await client.generate(PROMPT, greedy(N))

    start = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - start < 5
    assert_still_serving(svc, keys, expected)


@pytest.mark.parametrize("who", ["no key", "client key", "unknown key"])
def test_a_forged_registration_without_a_worker_key_never_lands(
    svc, keys, expected, tmp_path, who
) -> None:
    if who == "client key":
        forger = PeerKeys.load(keys, CLIENTS, "client")
    elif who == "unknown key":
        generate_keys(tmp_path / "stranger")
        forger = PeerKeys.load(tmp_path / "stranger", WORKERS, "worker")
    else:
        forger = None
    fake = protocol.encode(Register(PROTOCOL_VERSION, worker_info(svc, "fake")))
    for url in (svc.worker_url, svc.url):
        with dealer(url, forger, b"fake#1") as sock:
            # A refused handshake can leave the socket with no connection at all: then the
            # sends cannot even be queued, which is the same outcome.
            try_send(sock, fake)
            try_send(sock, real_register(svc))  # a replayed registration of the real worker
            got = reply(sock, NO_REPLY_S)
        # Nothing gets through the handshake, except a client key on the client port, which
        # is told that registrations are not taken there.
        if url == svc.url and who == "client key":
            assert isinstance(got, ErrorReply) and "does not accept Register" in got.message
        else:
            assert got is None
    assert_still_serving(svc, keys, expected)


# --- a worker key misbehaving ----------------------------------------------------------------


def test_a_second_registration_under_a_live_worker_id_is_refused(svc, keys, expected) -> None:
    rogue = PeerKeys.load(keys, WORKERS, "rogue")
    for identity in (b"w0", b"w0#hb", b"rogue#1"):
        with dealer(svc.worker_url, rogue, identity) as sock:
            sock.send(real_register(svc))  # replayed, and under the live id
            got = reply(sock, 20)
        assert isinstance(got, Rejected) and "registered by a live worker" in got.reason
    assert_still_serving(svc, keys, expected)


def test_forged_results_and_heartbeats_change_nothing(svc, keys, expected) -> None:
    assert svc.plane is not None
    real = svc.plane.workers["w0"]
    rogue = PeerKeys.load(keys, WORKERS, "rogue")
    forged = [RequestResult(handle=0, sampled_token_ids=[7])]
    with dealer(svc.worker_url, rogue, b"w0") as sock:
        for step_id in (0, 1 << 32, (1 << 32) + 1):  # the first step ids of the registrations
            sock.send(protocol.encode(StepResult(PROTOCOL_VERSION, step_id, forged)))
        sock.send(protocol.encode(Heartbeat(PROTOCOL_VERSION, "w0", real.token)))  # stolen token
        sock.send(protocol.encode(Heartbeat(PROTOCOL_VERSION, "w0", "")))
        got = reply(sock, NO_REPLY_S)
    assert got is None or isinstance(got, protocol.Reregister)
    assert_still_serving(svc, keys, expected)


def test_heartbeats_of_another_key_do_not_keep_a_frozen_worker_alive(
    llama_ckpt, redis_url, keys, expected, tmp_path
) -> None:
    service = Service(str(llama_ckpt.path), redis_url, tmp_path, keys=str(keys))
    try:
        plane = service.start("w1")
        proc = service.workers["w1"]
        token = plane.workers["w1"].token
        rogue = PeerKeys.load(keys, WORKERS, "rogue")
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            with dealer(service.worker_url, rogue, b"w1#x#hb") as sock:
                deadline = time.monotonic() + 10
                while "w1" in plane.workers and time.monotonic() < deadline:
                    sock.send(protocol.encode(Heartbeat(PROTOCOL_VERSION, "w1", token)))
                    time.sleep(0.1)
            assert "w1" not in plane.workers  # removed on time despite the forged heartbeats
        finally:
            os.kill(proc.pid, signal.SIGCONT)
    finally:
        service.close()


# --- starting without keys -------------------------------------------------------------------


def test_a_non_loopback_bind_without_keys_refuses_unless_insecure(llama_ckpt) -> None:
    port, _ = up_ports()  # the worker port, port + 1, must be free too
    args = ControlArgs(bind=f"tcp://0.0.0.0:{port}", model=str(llama_ckpt.path))
    with pytest.raises(
        ValueError, match=r"refusing to listen on tcp://0\.0\.0\.0:\d+ without keys"
    ):
        ControlPlane(args)
    plane = ControlPlane(ControlArgs(**{**args.__dict__, "insecure": True}))
    assert plane.worker_endpoint.endswith(f":{port + 1}")
    plane._close_sockets()


def test_unauthenticated_ports_still_keep_the_roles_apart(
    llama_ckpt, redis_url, expected, tmp_path
):
    """Without keys (loopback), the client port takes no worker message and the worker port no
    client message."""
    service = Service(str(llama_ckpt.path), redis_url, tmp_path)
    try:
        service.start("w0")
        fake = protocol.encode(Register(PROTOCOL_VERSION, worker_info(service, "fake")))
        with dealer(service.url, identity=b"fake") as sock:
            sock.send(fake)
            got = reply(sock, 20)
        assert isinstance(got, ErrorReply) and "does not accept Register" in got.message
        with dealer(service.worker_url) as sock:
            request = protocol.GenerateRequest(PROTOCOL_VERSION, "r1", prompt_token_ids=PROMPT)
            sock.send(protocol.encode(request))
            assert reply(sock, NO_REPLY_S) is None
        with Client(service.url, timeout=60) as client:
            assert client.generate(PROMPT, greedy(N)).token_ids == expected
        assert service.plane is not None and set(service.plane.workers) == {"w0"}
    finally:
        service.close()


def test_keys_generate_writes_private_pairs_and_never_overwrites(tmp_path) -> None:
    root = tmp_path / "k"
    cmd = [sys.executable, "-m", "specserve.cli", "keys", "generate", str(root)]
    done = subprocess.run([*cmd, "--workers", "gpu-0,gpu-1"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert names == [
        "clients/client.key", "clients/client.key_secret", "control.key", "control.key_secret",
        "workers/gpu-0.key", "workers/gpu-0.key_secret", "workers/gpu-1.key",
        "workers/gpu-1.key_secret",
    ]  # fmt: skip
    for path in [root, root / "workers", root / "clients"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for path in root.rglob("*.key_secret"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    before = (root / "control.key_secret").read_bytes()
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 2 and "never overwritten" in again.stderr
    assert (root / "control.key_secret").read_bytes() == before


def test_a_status_probe_without_a_key_is_refused_at_once(svc, keys, expected) -> None:
    """`get_status` / `fetch_status` say why at once, not after their timeout."""
    for probe in (
        lambda: get_status(svc.url, timeout=30),
        lambda: asyncio.run(fetch_status(svc.url, timeout=30)),
    ):
        start = time.monotonic()
        with pytest.raises(ServiceUnreachable, match=REFUSALS["no key"]):
            probe()
        assert time.monotonic() - start < 5
    status = get_status(svc.url, keys=PeerKeys.load(keys, CLIENTS, "client"))
    assert status.live_workers == 1
    assert_still_serving(svc, keys, expected)


def test_the_control_key_is_a_client_on_the_client_port_only(svc, keys, expected) -> None:
    """Control planes forward requests to each other as clients, under the service's control
    pair: the client port admits it, the worker port does not."""
    pair = load_pair(keys / "control.key_secret")
    control = PeerKeys(pair.public, pair)
    with dealer(svc.url, control) as sock:
        try_send(sock, protocol.encode(protocol.StatusRequest(PROTOCOL_VERSION)))
        got = reply(sock, 10.0)
    assert isinstance(got, protocol.ServiceStatus) and got.live_workers == 1
    with dealer(svc.worker_url, control, b"fake#2") as sock:
        try_send(sock, protocol.encode(Register(PROTOCOL_VERSION, worker_info(svc, "fake"))))
        assert reply(sock, NO_REPLY_S) is None
    assert_still_serving(svc, keys, expected)
