"""The whole service with real parts: Redis, ZeroMQ sockets, worker processes, the client SDK.

Outputs are checked token for token against transformers' greedy decoding on the same weights.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
import urllib.request

import msgspec
import pytest
import zmq
from hf_reference import hf_greedy
from service_harness import WORKER_ENGINE, Service

from specserve.cache_index import IndexReader, connect, list_workers
from specserve.client import AsyncClient, Client, RequestFailed
from specserve.launch.local_redis import LocalRedis, free_port
from specserve.llm import LLM
from specserve.shared import protocol
from specserve.shared.hashing import BlockHasher, extend_block_hashes
from specserve.shared.protocol import PROTOCOL_VERSION, GenerateRequest, SamplingParams
from specserve.worker.engine import EngineArgs, WorkerEngine

BLOCK = 4


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def shared_prefix_prompts(groups: int, per_group: int, prefix_len: int = 24) -> list[list[int]]:
    """`groups` system prompts of `prefix_len` tokens, each followed by distinct user turns."""
    out = []
    for g in range(groups):
        system = [(17 * g + 5 * i + 3) % 250 + 1 for i in range(prefix_len)]
        for u in range(per_group):
            out.append(system + [(31 * u + 7 * j + g) % 250 + 1 for j in range(4 + u % 5)])
    return out


async def generate_all(url: str, prompts: list[list[int]], params: SamplingParams) -> list:
    async with AsyncClient(url, timeout=120) as client:
        return await asyncio.gather(*(client.generate(p, params) for p in prompts))


def test_shared_prefix_requests_match_transformers_and_land_on_their_prefix(
    service: Service, llama_ckpt
) -> None:
    plane = service.start_control()
    service.start_worker("w0", max_num_seqs=64)  # room for the burst: no load spill-over
    service.start_worker("w1", max_num_seqs=64)
    service.wait_workers({"w0", "w1"})
    prompts = shared_prefix_prompts(groups=4, per_group=17)
    warm = prompts[::17]  # one request per group caches its system prompt somewhere
    rest = [p for i, p in enumerate(prompts) if i % 17]
    params = greedy(6)

    warm_out = asyncio.run(generate_all(service.url, warm, params))
    home = {tuple(p[:24]): out.worker_id for p, out in zip(warm, warm_out, strict=True)}
    assert set(home.values()) == {"w0", "w1"}  # cold requests spread over both workers
    outs = asyncio.run(generate_all(service.url, rest, params))  # 64 at once

    for prompt, out in zip(warm + rest, warm_out + outs, strict=True):
        assert out.token_ids == hf_greedy(llama_ckpt.hf_model, prompt, 6)
        assert out.finish_reason == "length"
    # Every later request of a group went to the worker holding its system prompt, and found
    # all 6 of its blocks there.
    for prompt, out in zip(rest, outs, strict=True):
        assert out.worker_id == home[tuple(prompt[:24])]
        assert out.num_cached_tokens == 24
    hit = plane.metrics.sample("specserve_prefix_hit_tokens_total")
    queried = plane.metrics.sample("specserve_prefix_query_tokens_total")
    assert hit == 64 * 24
    assert hit / queried > 0.7

    # The index speaks the documented schema, and says who holds each system prompt.
    client = connect(service.redis_url)
    ns = plane.workers["w0"].namespace
    keys = list(client.scan_iter(match=ns.base + b":*", count=1000))
    base = re.escape(ns.base)
    pattern = re.compile(
        base + rb":(live|epochs|fenced|worker:w[01]|w:w[01]:\d+|b0:[\x00-\xff]{16})", re.DOTALL
    )
    assert keys and all(pattern.fullmatch(k) for k in keys), [
        k for k in keys if not pattern.fullmatch(k)
    ]
    reader = IndexReader(client, ns)
    for system, worker_id in home.items():
        hashes: list = []
        extend_block_hashes(BlockHasher(), hashes, list(system), BLOCK)
        assert reader.longest_prefix(hashes)[worker_id] == 6

    # A burst sharing a prefix nobody caches yet stays together: the router remembers where it
    # sent the first one before the scheduler (and the index) has seen it.
    cold = [[240 - i for i in range(24)] + [u + 1, u + 2, u + 3] for u in range(8)]
    burst = asyncio.run(generate_all(service.url, cold, params))
    assert len({out.worker_id for out in burst}) == 1


def test_kill_9_worker_mid_stream_loses_and_repeats_nothing(service: Service, llama_ckpt) -> None:
    plane = service.start_control()
    service.start_worker("w0", max_num_seqs=2)
    victim = service.start_worker("w1", max_num_seqs=2)
    service.wait_workers({"w0", "w1"})
    prompts = shared_prefix_prompts(groups=4, per_group=8, prefix_len=12)
    # Even requests are greedy; odd ones sample with a seed (draws are keyed by output position,
    # so a resumed request continues exactly as an uninterrupted one).
    params = [
        greedy(40) if i % 2 == 0 else SamplingParams(max_tokens=40, seed=100 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    streamed: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    workers_seen: dict[int, list[str]] = {i: [] for i in range(len(prompts))}
    killed: list[float] = []

    async def consume(client: AsyncClient, i: int) -> None:
        async for out in client.stream(prompts[i], params[i]):
            streamed[i].extend(out.token_ids)
            if out.worker_id:
                workers_seen[i].append(out.worker_id)
            if not killed and out.token_ids and workers_seen[i][0] == "w1":
                victim.send_signal(signal.SIGKILL)
                killed.append(time.monotonic())

    async def run() -> None:
        async with AsyncClient(service.url, timeout=120) as client:
            await asyncio.gather(*(consume(client, i) for i in range(len(prompts))))

    asyncio.run(run())
    assert killed, "the victim never produced a token"
    assert victim.wait(timeout=10) == -signal.SIGKILL
    assert set(plane.workers) == {"w0"}
    resumed = plane.metrics.sample("specserve_requests_resumed_total")
    assert resumed and resumed > 0
    # Streams that had begun on w1 continued on w0; requests still queued on w1 started on w0.
    moved = [i for i, seen in workers_seen.items() if seen == ["w1", "w0"]]
    assert moved and resumed >= len(moved)
    assert all(seen in (["w0"], ["w1"], ["w1", "w0"]) for seen in workers_seen.values())
    uninterrupted = LLM(str(llama_ckpt.path), **WORKER_ENGINE).generate(prompts, params)
    for i, prompt in enumerate(prompts):
        assert streamed[i] == uninterrupted[i].token_ids, i
        if i % 2 == 0:
            assert streamed[i] == hf_greedy(llama_ckpt.hf_model, prompt, 40), i

    # The dead worker's entries stopped counting: lookups and the registry no longer see it.
    client = connect(service.redis_url)
    ns = plane.workers["w0"].namespace
    hashes: list = []
    extend_block_hashes(BlockHasher(), hashes, prompts[moved[0]], BLOCK)
    assert "w1" not in IndexReader(client, ns).longest_prefix(hashes)
    records = {r.worker_id: r for r in list_workers(client, ns)}
    assert not records["w1"].live and records["w0"].live


def test_sigterm_drains_a_worker_under_load_and_loses_nothing(service: Service, llama_ckpt):
    """SIGTERM: the worker asks to leave, the control plane moves its requests (after its step
    in flight came back) to the other worker, releases it, and it exits 0 at once; every stream
    completes exactly as an uninterrupted run."""
    plane = service.start_control()
    service.start_worker("w0", max_num_seqs=4)
    leaving = service.start_worker("w1", max_num_seqs=4)
    service.wait_workers({"w0", "w1"})
    prompts = shared_prefix_prompts(groups=4, per_group=6, prefix_len=12)
    params = [
        greedy(40) if i % 2 == 0 else SamplingParams(max_tokens=40, seed=7 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    streamed: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    workers_seen: dict[int, list[str]] = {i: [] for i in range(len(prompts))}
    signalled: list[float] = []

    async def consume(client: AsyncClient, i: int) -> None:
        async for out in client.stream(prompts[i], params[i]):
            streamed[i].extend(out.token_ids)
            if out.worker_id:
                workers_seen[i].append(out.worker_id)
            if not signalled and len(streamed[i]) >= 8 and workers_seen[i][0] == "w1":
                leaving.send_signal(signal.SIGTERM)
                signalled.append(time.monotonic())

    async def run() -> None:
        async with AsyncClient(service.url, timeout=120) as client:
            await asyncio.gather(*(consume(client, i) for i in range(len(prompts))))

    asyncio.run(run())
    assert signalled, "w1 never produced a token"
    assert leaving.wait(timeout=20) == 0
    assert time.monotonic() - signalled[0] < 20  # released, not the 30 s drain timeout
    assert set(plane.workers) == {"w0"}
    assert "worker.released" in (service.logdir / "w1.log").read_text()
    moved = [i for i, seen in workers_seen.items() if seen == ["w1", "w0"]]
    assert moved
    uninterrupted = LLM(str(llama_ckpt.path), **WORKER_ENGINE).generate(prompts, params)
    for i in range(len(prompts)):
        assert streamed[i] == uninterrupted[i].token_ids, i


def test_the_control_planes_ready_file_follows_its_workers(llama_ckpt, redis_url, tmp_path):
    ready = tmp_path / "control-ready"
    service = Service(str(llama_ckpt.path), redis_url, tmp_path, ready_file=str(ready))
    try:
        service.start_control()
        time.sleep(0.5)
        assert not ready.exists()  # no worker yet
        worker = service.start_worker("w0")
        service.wait_workers({"w0"})
        deadline = time.monotonic() + 5
        while not ready.exists():
            assert time.monotonic() < deadline, "ready file not written"
            time.sleep(0.05)
        worker.kill()
        deadline = time.monotonic() + 15  # the heartbeat timeout (2 s) and a tick
        while ready.exists():
            assert time.monotonic() < deadline, "ready file kept without workers"
            time.sleep(0.1)
    finally:
        service.close()
    assert not ready.exists()


def test_a_joining_worker_takes_over_queued_requests(service: Service, llama_ckpt) -> None:
    """Requests queued on a busy worker that never started move to a worker that joins: it
    serves some of them at once, and every output is still exact."""
    plane = service.start_control()
    service.start_worker("w0", max_num_seqs=2)
    service.wait_workers({"w0"})
    prompts = shared_prefix_prompts(groups=40, per_group=1, prefix_len=8)  # no shared prefix
    params = greedy(200)
    served: dict[int, str] = {}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}

    async def consume(client: AsyncClient, i: int) -> None:
        async for out in client.stream(prompts[i], params):
            tokens[i].extend(out.token_ids)
            if out.worker_id:
                served[i] = out.worker_id

    async def run() -> None:
        async with AsyncClient(service.url, timeout=120) as client:
            tasks = [asyncio.ensure_future(consume(client, i)) for i in range(len(prompts))]
            scheduler = plane.workers["w0"].scheduler
            # w0 is busy and every request has reached it: the rest wait in its queue.
            while not any(tokens.values()) or len(scheduler.requests) < len(prompts):
                await asyncio.sleep(0.05)
            assert len(scheduler.unstarted_waiting()) >= 30
            service.start_worker("w1", max_num_seqs=2)
            await asyncio.gather(*tasks)

    asyncio.run(run())
    assert set(served.values()) == {"w0", "w1"}
    assert sum(w == "w1" for w in served.values()) >= 5
    uninterrupted = LLM(str(llama_ckpt.path), **WORKER_ENGINE).generate(prompts, params)
    for i in range(len(prompts)):
        assert tokens[i] == uninterrupted[i].token_ids, i


def test_joining_worker_gets_load_and_control_restart_reregisters(
    service: Service, llama_ckpt
) -> None:
    service.start_control()
    service.start_worker("w0")
    service.wait_workers({"w0"})
    prompts = shared_prefix_prompts(groups=8, per_group=1, prefix_len=8)
    with Client(service.url, timeout=60) as client:
        first = client.generate(prompts[0], greedy(4))
        assert first.worker_id == "w0"
        service.start_worker("w1")
        service.wait_workers({"w0", "w1"})
        outs = [client.generate(p, greedy(4)) for p in prompts[1:]]
    assert {o.worker_id for o in outs} == {"w0", "w1"}  # cold prompts alternate once w1 is idle

    service.stop_control()
    plane = service.start_control()  # same port: the workers' sockets reconnect
    service.wait_workers({"w0", "w1"}, timeout=30)
    assert plane.session != ""
    with Client(service.url, timeout=60) as client:
        outs = [client.generate(p, greedy(5)) for p in prompts[:4]]
    for prompt, out in zip(prompts[:4], outs, strict=True):
        assert out.token_ids == hf_greedy(llama_ckpt.hf_model, prompt, 5)


def raw_exchange(url: str, frames: list[bytes], expect: int) -> list[protocol.Message]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    try:
        for frame in frames:
            sock.send(frame)
        replies = []
        while len(replies) < expect:
            assert sock.poll(20_000), f"no reply after {len(replies)} of {expect}"
            reply = protocol.decode(sock.recv())  # (outputs of one step come in one frame)
            replies += reply.outputs if isinstance(reply, protocol.OutputBatch) else [reply]
        return replies
    finally:
        sock.close()


def test_bad_input_gets_clear_errors_and_harms_no_one(service: Service, llama_ckpt) -> None:
    plane = service.start_control()
    service.start_worker("w0")
    service.wait_workers({"w0"})
    url = service.url

    def generate(request_id: str, **fields) -> bytes:
        return protocol.encode(GenerateRequest(PROTOCOL_VERSION, request_id, **fields))

    unknown_type = msgspec.msgpack.encode({"type": "teleport", "version": PROTOCOL_VERSION})
    future = msgspec.msgpack.encode({"type": "generate", "version": 99, "request_id": "v"})
    bad_temperature = msgspec.msgpack.encode(
        {"type": "generate", "version": PROTOCOL_VERSION, "request_id": "t",
         "prompt_token_ids": [1, 2], "sampling": {"temperature": -1.0}}
    )  # fmt: skip
    replies = raw_exchange(
        url,
        [
            b"\x00garbage",
            unknown_type,
            future,
            bad_temperature,
            generate("long", prompt_token_ids=[5] * 300, sampling=greedy(2)),
            generate("vocab", prompt_token_ids=[1, 9999], sampling=greedy(2)),
            generate("both", prompt="hi", prompt_token_ids=[1], sampling=greedy(2)),
            generate("ok", prompt_token_ids=[1, 2, 3], sampling=greedy(3), stream=False),
        ],
        expect=8,
    )
    errors = [r for r in replies if isinstance(r, protocol.ErrorReply)]
    assert len(errors) == 7
    text = [e.message for e in errors]
    assert "malformed frame" in text[0]
    assert "unknown message type 'teleport'" in text[1]
    assert "unsupported protocol version 99" in text[2]
    assert "temperature must be a finite number >= 0" in text[3] and errors[3].request_id == "t"
    assert "at most 255 prompt tokens" in text[4] and errors[4].request_id == "long"
    assert "outside the vocabulary" in text[5]
    assert "exactly one of prompt" in text[6]
    (ok,) = [r for r in replies if isinstance(r, protocol.RequestOutput)]
    assert ok.finished and ok.token_ids == hf_greedy(llama_ckpt.hf_model, [1, 2, 3], 3)

    # A client that vanishes mid-stream: its request is aborted, the others are unaffected.
    ctx = zmq.Context.instance()
    leaver = ctx.socket(zmq.DEALER)
    leaver.setsockopt(zmq.LINGER, 0)
    leaver.connect(url)
    leaver.send(generate("leaver", prompt_token_ids=[4, 5, 6], sampling=greedy(200)))
    with Client(url, timeout=60) as client:
        rid = client.submit([7, 8, 9, 10], greedy(30))
        assert leaver.poll(20_000)
        first = protocol.decode(leaver.recv())
        assert isinstance(first, protocol.RequestOutput) and first.request_id == "leaver"
        leaver.close()
        other = client.result(rid)
    assert other.token_ids == hf_greedy(llama_ckpt.hf_model, [7, 8, 9, 10], 30)
    deadline = time.monotonic() + 10
    while plane.metrics.sample("specserve_requests_total", {"reason": "abort"}) != 1.0:
        assert time.monotonic() < deadline, "the vanished client's request was not aborted"
        time.sleep(0.05)
    assert "leaver" not in plane.frontend.requests
    with pytest.raises(RequestFailed, match="at most 255"), Client(url, timeout=30) as client:
        client.generate([1] * 400, greedy(1))
    assert service.workers["w0"].poll() is None  # nothing took the worker down


def test_redis_outage_keeps_serving_then_resyncs_and_metrics_are_scraped(
    llama_ckpt, tmp_path
) -> None:
    (tmp_path / "redis").mkdir()
    redis_server = LocalRedis(tmp_path / "redis").start()  # restartable on the same port
    metrics_port = free_port()
    service = Service(str(llama_ckpt.path), redis_server.url, tmp_path, metrics_port=metrics_port)
    try:
        plane = service.start_control()
        service.start_worker("w0")
        service.start_worker("w1")
        service.wait_workers({"w0", "w1"})
        prompts = shared_prefix_prompts(groups=2, per_group=3, prefix_len=16)
        with Client(service.url, timeout=60) as client:
            home = {i: client.generate(prompts[i], greedy(4)).worker_id for i in (0, 3)}
            assert set(home.values()) == {"w0", "w1"}
            redis_server.stop()
            outs = [client.generate(p, greedy(4)) for p in prompts]
        assert not plane.index.up
        for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
            assert out.token_ids == hf_greedy(llama_ckpt.hf_model, prompt, 4)
            # Local routing from the control plane's own pools still finds the prefix.
            assert out.worker_id == home[i // 3 * 3]
            assert out.num_cached_tokens >= 16  # the system prompt (or all of a repeat)

        redis_server.start()  # empty: no registry, no entries
        deadline = time.monotonic() + 15
        client = connect(redis_server.url)
        ns = plane.workers["w0"].namespace
        while not (plane.index.up and len(list_workers(client, ns)) == 2):
            assert time.monotonic() < deadline, "the index was not rebuilt after Redis returned"
            time.sleep(0.1)
        reader = IndexReader(client, ns)
        for i in (0, 3):
            hashes: list = []
            extend_block_hashes(BlockHasher(), hashes, prompts[i], BLOCK)
            assert reader.longest_prefix(hashes)[home[i]] == len(prompts[i]) // BLOCK

        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        assert 'specserve_requests_total{reason="length"} 8.0' in body
        assert 'specserve_worker_up{worker="w0"} 1.0' in body
        assert "specserve_time_to_first_token_seconds_count 8.0" in body
        assert re.search(r'specserve_index_errors_total\{op="\w+"\} [1-9]', body)
    finally:
        service.close()
        redis_server.close()


def test_a_stuck_worker_is_removed_and_its_request_resumes(llama_ckpt, redis_url, tmp_path):
    """A worker that heartbeats but never returns its step (a hung device; played here by a
    scripted peer on a real socket) loses its requests to a healthy worker."""
    service = Service(str(llama_ckpt.path), redis_url, tmp_path, step_timeout_s=1.0)
    stop = threading.Event()
    ctx = zmq.Context.instance()
    info = WorkerEngine(EngineArgs(model=str(llama_ckpt.path), **WORKER_ENGINE)).info("stuck")
    try:
        plane = service.start_control()
        stuck = ctx.socket(zmq.DEALER)
        stuck.setsockopt(zmq.IDENTITY, b"stuck")
        stuck.setsockopt(zmq.LINGER, 0)
        stuck.connect(service.worker_url)
        stuck.send(protocol.encode(protocol.Register(PROTOCOL_VERSION, info)))
        assert stuck.poll(10_000)
        welcome = protocol.decode(stuck.recv())
        assert isinstance(welcome, protocol.Welcome)

        def beat() -> None:
            hb = ctx.socket(zmq.DEALER)
            hb.setsockopt(zmq.IDENTITY, b"stuck#hb")
            hb.setsockopt(zmq.LINGER, 0)
            hb.connect(service.worker_url)
            while not stop.wait(0.2):
                hb.send(
                    protocol.encode(protocol.Heartbeat(PROTOCOL_VERSION, "stuck", welcome.session))
                )
            hb.close()

        threading.Thread(target=beat, daemon=True).start()
        with Client(service.url, timeout=60) as client:
            rid = client.submit([3, 1, 4, 1, 5], greedy(6))
            assert stuck.poll(10_000)  # the step arrives and is never answered
            assert isinstance(protocol.decode(stuck.recv()), protocol.StepBatch)
            deadline = time.monotonic() + 10
            while "stuck" in plane.workers:
                assert time.monotonic() < deadline, "the stuck worker was not removed"
                time.sleep(0.05)
            service.start_worker("w0")
            out = client.result(rid)
        assert out.token_ids == hf_greedy(llama_ckpt.hf_model, [3, 1, 4, 1, 5], 6)
        assert out.worker_id == "w0"
        assert plane.metrics.sample("specserve_requests_resumed_total") == 1.0
    finally:
        stop.set()
        service.close()


def test_speculative_workers_stay_lossless_and_report_acceptance(service: Service, llama_ckpt):
    plane = service.start_control()
    # fixed: every round verifies K, so both requests report drafts (adaptive may verify none)
    service.start_worker("w0", spec_method="ngram", num_spec_tokens=3, spec_policy="fixed")
    service.wait_workers({"w0"})
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7], [1, 2, 3, 4, 1, 2, 3, 4, 1]]
    outs = asyncio.run(generate_all(service.url, prompts, greedy(24)))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(llama_ckpt.hf_model, prompt, 24)
    stats = [out.spec for out in outs]
    assert all(s is not None and s.num_drafts > 0 for s in stats)
    for s in stats:
        assert sum(s.accepted_counts) == s.num_drafts
        assert sum(a * n for a, n in enumerate(s.accepted_counts)) == s.num_accepted_tokens
    assert plane.metrics.sample("specserve_acceptance_length_count") == 2.0
