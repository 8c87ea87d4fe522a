"""Prefix routing across control planes: two planes on one Redis index, two workers each. A
request of a prefix family sent to either plane lands on the worker that holds the prefix (the
plane it reached forwards it to the plane that owns that worker and relays the outputs), and
each worker is scheduled by one plane only. A forwarded stream outlives the plane it went to.
Real processes, sockets and Redis throughout.
"""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
import sys
import time

import pytest
from service_harness import WORKER_ENGINE, ControlProcess, wait_for, wait_healthy
from test_control_failover import uninterrupted

from specserve.cache_index import Namespace, connect, list_workers
from specserve.cache_index.schema import key_model_name
from specserve.client import Client, RequestFailed, get_status
from specserve.launch.local_redis import free_port
from specserve.shared.protocol import SamplingParams

PREFIX = [(11 * j) % 250 + 1 for j in range(64)]  # 16 blocks of 4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def family(i: int) -> list[int]:
    return PREFIX + [(29 * i + 3 * j) % 250 + 1 for j in range(8)]


def wait_for_line(plane: ControlProcess, pattern: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, plane.log.read_text()):
        assert time.monotonic() < deadline, f"{pattern!r} not logged:\n{plane.log.read_text()}"
        time.sleep(0.05)


def test_a_prefix_family_lands_on_its_worker_whichever_plane_it_reaches(
    planes, llama_ckpt, redis_url
):
    model = str(llama_ckpt.path)
    a = planes("a", "a0", "a1")
    b = planes("b", "b0", "b1")
    with Client(a.url, timeout=60) as client:
        first = client.generate(family(0), GREEDY)
    holder = first.worker_id
    assert holder in ("a0", "a1")
    wait_for_line(b, r"peer.connected\s+url=" + re.escape(a.url))  # b can forward to a

    prompts = [family(i) for i in range(1, 7)]
    done = []
    with Client(a.url, timeout=60) as to_a, Client(b.url, timeout=60) as to_b:
        for i, prompt in enumerate(prompts):
            done.append((to_a if i % 2 == 0 else to_b).generate(prompt, GREEDY))
    expected = uninterrupted(llama_ckpt, [family(0), *prompts], [GREEDY] * 7)
    assert [first.token_ids] + [c.token_ids for c in done] == expected
    # Every family member ran on the prefix's worker with the whole prefix cached.
    assert [(c.worker_id, c.num_cached_tokens) for c in done] == [(holder, 64)] * 6
    forwarded = re.findall(r"request.forwarded\s+cached_tokens=(\d+)", b.log.read_text())
    assert forwarded == ["64"] * 3
    assert "request.forwarded" not in a.log.read_text()  # a forwarded request stays put

    # One scheduler per worker: each plane registered only its own workers, and the index
    # has one owner session for each.
    for plane, own in ((a, {"a0", "a1"}), (b, {"b0", "b1"})):
        log = plane.log.read_text()
        assert set(re.findall(r"worker.registered\s.*worker=(\S+)", log)) == own
    ns = Namespace(key_model_name(model), WORKER_ENGINE["block_size"])
    owners = {r.worker_id: r.info["session"] for r in list_workers(connect(redis_url), ns)}
    assert owners["a0"] == owners["a1"] != owners["b0"] == owners["b1"]

    # kill -9 of the plane a stream was forwarded to: the plane it came to serves it on.
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    with Client(b.url, timeout=60) as client:
        stream = client.stream(family(9), long)
        tokens = list(next(stream).token_ids)
        a.kill()
        for out in stream:
            tokens.extend(out.token_ids)
    assert tokens == uninterrupted(llama_ckpt, [family(9)], [long])[0]
    assert re.search(r"request.taken_back\s.*connection dropped", b.log.read_text())


def test_a_plane_whose_workers_are_down_serves_through_another(planes, llama_ckpt, tmp_path):
    """A plane whose only worker died holds a new request while no other plane has a live
    worker, forwards it as soon as one does, forwards the next at once, and says in its status
    (and through an HTTP API's /health) that it can serve: no 503 while another plane could."""
    a = planes("a")
    own = planes.workers([a], "a0")
    a.wait_workers(1)
    b = planes("b")  # no worker yet
    own.workers["a0"].kill()
    wait_for(lambda: get_status(a.url).live_workers == 0, 20, "a0 was never removed")
    assert get_status(a.url).peer_workers == 0

    with concurrent.futures.ThreadPoolExecutor(1) as pool, Client(a.url, timeout=60) as client:
        held = pool.submit(client.generate, family(0), GREEDY)
        time.sleep(1.0)
        assert not held.done()  # nowhere to go yet: held, not refused
        planes.workers([b], "b0")
        b.wait_workers(1)
        first = held.result(timeout=60)
        second = client.generate(family(1), GREEDY)  # the thread is done with the client
    expected = uninterrupted(llama_ckpt, [family(0), family(1)], [GREEDY] * 2)
    assert [first.token_ids, second.token_ids] == expected
    assert (first.worker_id, second.worker_id) == ("b0", "b0")
    forwarded = re.findall(r"request.forwarded\s.*no_live_worker_here=(\w+)", a.log.read_text())
    assert forwarded == ["True", "True"]
    status = get_status(a.url)
    assert (status.live_workers, status.peer_workers) == (0, 1)
    # What the plane it went to refuses as invalid reaches the client at once: with no worker
    # of its own, a knew no bound to check it against, and none here could serve it later.
    too_long = [(3 * j) % 250 + 1 for j in range(300)]  # the workers' max_model_len is 256
    with Client(a.url, timeout=30) as client, pytest.raises(RequestFailed, match="max_model_len"):
        client.generate(too_long, GREEDY)
    assert re.search(r"request.refused_by_peer\s.*code=invalid", a.log.read_text())

    # Requests under way on a's new worker when it dies go on at b's at once: the stream
    # from the tokens its client has, the one not streamed (its client has nothing) from its
    # prompt; each equal to a run without the failure.
    second = planes.workers([a], "a1")
    a.wait_workers(1)
    lone = [(7 * j) % 250 + 1 for j in range(40)]  # no prefix b0 holds: served by a1
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        Client(a.url, timeout=60) as client,
        Client(a.url, timeout=60) as other,  # a Client is for one thread
    ):
        whole = pool.submit(other.generate, lone, long)
        stream = client.stream(lone, long)
        first_out = next(stream)
        tokens = list(first_out.token_ids)
        # both under way before the kill: the unstreamed one accepted, then a few steps more
        # (batched with the stream's, it has output of its own by then)
        wait_for(lambda: get_status(a.url).requests_in_flight == 2, 20, "never both in flight")
        while len(tokens) < len(first_out.token_ids) + 4:
            tokens.extend(next(stream).token_ids)
        second.workers["a1"].kill()
        tokens += [t for out in stream for t in out.token_ids]
        unstreamed = whole.result(timeout=60)
    assert first_out.worker_id == "a1" and len(first_out.token_ids) < 200
    assert unstreamed.worker_id == "b0"
    assert tokens == unstreamed.token_ids == uninterrupted(llama_ckpt, [lone], [long])[0]
    under_way = re.findall(r"request.forwarded\s.*under_way=(\w+)", a.log.read_text())
    assert under_way == ["False"] * 3 + ["True"] * 2

    port = free_port()
    api = subprocess.Popen(
        [sys.executable, "-m", "specserve.cli", "api", "--control", a.url, "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "api.log").open("wb"),
    )  # fmt: skip
    try:
        health = wait_healthy(f"http://127.0.0.1:{port}", timeout_s=60).json()
        assert (health["status"], health["live_workers"], health["peer_workers"]) == ("ok", 0, 1)
    finally:
        api.terminate()
        api.wait(30)
