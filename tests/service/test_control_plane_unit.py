"""The control plane's decisions in hard interleavings, driven message by message.

`RecordingPlane` is a test double for the socket side only: the real `ControlPlane` (real
scheduler, router, frontend, index code) runs, but what it would send is recorded, and a peer
can be marked unreachable. Workers are played by answering the recorded step batches.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from specserve.control.control_plane import ControlArgs, ControlPlane
from specserve.launch.local_redis import LocalRedis, RedisNotFound
from specserve.shared.config import AttentionType, KVGroupSpec
from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    ErrorReply,
    GenerateRequest,
    Heartbeat,
    Register,
    RequestOutput,
    RequestResult,
    Reregister,
    SamplingParams,
    StepBatch,
    StepResult,
    WorkerInfo,
)

P = PROTOCOL_VERSION


class RecordingPlane(ControlPlane):
    def __init__(self, model: str, **kwargs) -> None:
        super().__init__(ControlArgs(bind="tcp://127.0.0.1:0", model=model, **kwargs))
        self.sent: list[tuple[bytes, object]] = []
        self.unreachable: set[bytes] = set()

    def _send(self, identity: bytes, msg) -> bool:
        if identity in self.unreachable:
            return False
        self.sent.append((identity, msg))
        return True

    def register(self, worker_id: str, **fields) -> None:
        info = WorkerInfo(
            worker_id=worker_id, model=self.args.model, device="cpu",
            kv_groups=[KVGroupSpec(AttentionType.FULL, 4)], num_blocks=64, max_model_len=256,
            vocab_size=256, eos_token_ids=[], max_num_batched_tokens=512, max_num_seqs=16,
            **fields,
        )  # fmt: skip
        self._on_register(worker_id.encode(), Register(P, info))

    def generate(self, request_id: str, prompt: list[int], client: bytes = b"c1", **sampling):
        params = SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **sampling})
        self._on_generate(client, GenerateRequest(P, request_id, prompt_token_ids=prompt,
                                                  sampling=params))  # fmt: skip

    def batches(self, worker_id: str) -> list[StepBatch]:
        wid = worker_id.encode()
        return [m for i, m in self.sent if i == wid and isinstance(m, StepBatch)]

    def outputs(self, client: bytes = b"c1") -> list:
        return [
            m for i, m in self.sent if i == client and isinstance(m, RequestOutput | ErrorReply)
        ]

    def answer(self, worker_id: str, batch: StepBatch, token: int) -> None:
        """One token for every request that reaches the end of its known tokens."""
        results = []
        for new in batch.new_requests:
            done = new.num_computed_tokens + new.num_scheduled_tokens >= len(new.token_ids)
            results.append(RequestResult(new.handle, [token] if done else []))
        results += [RequestResult(d.handle, [token]) for d in batch.running]
        self._on_result(worker_id.encode(), StepResult(P, batch.step_id, results))


@pytest.fixture
def plane(llama_ckpt):
    p = RecordingPlane(str(llama_ckpt.path))
    yield p
    p.sock.close(linger=0)


def tokens(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def test_worker_lost_right_after_its_result_resumes_without_repeats(plane: RecordingPlane):
    plane.register("w0")
    plane.register("w1")
    plane.generate("r1", [1, 2, 3, 4, 5], max_tokens=3)
    plane._dispatch_all()
    a = plane.frontend.requests["r1"].worker_id
    b = "w1" if a == "w0" else "w0"
    plane.answer(a, plane.batches(a)[-1], token=10)
    plane.unreachable.add(a.encode())  # gone right after sending its next result
    plane.answer(a, plane.batches(a)[-1], token=11)
    plane._dispatch_all()
    resumed = plane.batches(b)[-1].new_requests[0]
    assert resumed.token_ids == [1, 2, 3, 4, 5, 10, 11]
    assert resumed.num_prompt_tokens == 5
    plane.answer(b, plane.batches(b)[-1], token=12)
    assert tokens(plane.outputs()) == [10, 11, 12]
    assert [o.finish_reason for o in plane.outputs() if o.finished] == ["length"]
    assert a not in plane.workers


def test_a_late_result_of_an_earlier_registration_is_ignored(plane: RecordingPlane):
    plane.register("w1")
    plane.generate("A", [1, 2, 3, 4, 5], client=b"alice", max_tokens=4)
    plane._dispatch_all()
    first = plane.batches("w1")[-1]
    plane._handle(b"alice", AbortRequest(P, "A"))
    plane.register("w1")  # the worker registers again (e.g. after a Reregister)
    plane.generate("C", [9, 9, 9, 9, 9, 9, 9], client=b"bob", max_tokens=4)
    plane._dispatch_all()
    second = plane.batches("w1")[-1]
    assert second.step_id != first.step_id
    assert second.new_requests[0].handle == first.new_requests[0].handle  # handles restart
    plane.answer("w1", first, token=66)  # the old registration's step finally answers
    assert plane.outputs(b"bob") == []
    plane.answer("w1", second, token=5)
    assert tokens(plane.outputs(b"bob")) == [5]


def test_reregister_requests_are_rate_limited(plane: RecordingPlane):
    for _ in range(5):
        plane._on_heartbeat(b"ghost#hb", Heartbeat(P, "ghost", "old-session"))
    asks = [(i, m) for i, m in plane.sent if isinstance(m, Reregister)]
    assert [i for i, _ in asks] == [b"ghost"]


def test_tokens_outside_the_vocabulary_fail_only_their_request(plane: RecordingPlane):
    plane.register("w0")
    plane.generate("bad", [1, 2, 3])
    plane.generate("good", [4, 5, 6], client=b"c2")
    plane._dispatch_all()
    batch = plane.batches("w0")[-1]
    handle = {n.request_id: n.handle for n in batch.new_requests}
    result = [RequestResult(handle["bad"], [-1]), RequestResult(handle["good"], [9])]
    plane._on_result(b"w0", StepResult(P, batch.step_id, result))
    (failed,) = plane.outputs()
    assert failed.finished and failed.finish_reason == "error"
    assert "outside the vocabulary" in failed.error
    assert tokens(plane.outputs(b"c2")) == [9]
    assert "w0" in plane.workers


def test_a_request_the_worker_never_answers_fails_and_frees_its_blocks(plane: RecordingPlane):
    plane.register("w0")
    plane.generate("a", [1, 2, 3])
    plane._dispatch_all()
    batch = plane.batches("w0")[-1]
    plane._on_result(b"w0", StepResult(P, batch.step_id, []))
    (out,) = plane.outputs()
    assert out.finish_reason == "error" and out.error == "the worker returned no result for it"
    assert plane.frontend.requests == {}
    assert plane.workers["w0"].scheduler.kv.pool.num_free_blocks == 63


def test_a_request_that_could_outgrow_the_cache_is_refused(plane: RecordingPlane):
    plane.register("w0")  # 63 usable blocks of 4 = 252 slots, max_model_len 256
    plane.generate("big", [1, 2, 3], max_tokens=300)
    (reply,) = plane.outputs()
    assert isinstance(reply, ErrorReply) and reply.request_id == "big"
    assert "can grow to 256 tokens, which needs 64 KV blocks; a worker has 63" in reply.message
    plane.generate("ok", [1, 2, 3], max_tokens=200)
    assert "ok" in plane.frontend.requests


def test_token_ids_are_checked_against_the_vocabulary_as_requests_enter(plane: RecordingPlane):
    plane.register("w0")  # vocab_size 256
    plane.generate("prompt", [1, 256])
    plane.generate("stop", [1, 2], stop_token_ids=(300,))
    replies = plane.outputs()
    assert [r.request_id for r in replies] == ["prompt", "stop"]
    assert all(isinstance(r, ErrorReply) for r in replies)
    assert "prompt token ids [256] are outside the vocabulary (size 256)" in replies[0].message
    assert "stop_token_ids [300] are outside the vocabulary (size 256)" in replies[1].message
    assert plane.frontend.requests == {}


def test_redis_refusing_writes_does_not_stop_serving(llama_ckpt, tmp_path: Path):
    try:
        redis_server = LocalRedis(tmp_path).start()
    except RedisNotFound as exc:
        pytest.skip(str(exc))
    plane = RecordingPlane(str(llama_ckpt.path), redis_url=redis_server.url)
    try:
        plane.register("w0")
        assert plane.index.up and plane.workers["w0"].writer is not None
        plane.index.client.config_set("maxmemory-policy", "noeviction")
        plane.index.client.config_set("maxmemory", "1")  # every write is now an OOM error
        plane.generate("a", list(range(1, 20)), max_tokens=2)
        plane._dispatch_all()
        assert not plane.index.up
        plane.answer("w0", plane.batches("w0")[-1], token=3)
        plane.answer("w0", plane.batches("w0")[-1], token=4)
        assert tokens(plane.outputs()) == [3, 4]
        plane.index.client.config_set("maxmemory", "0")
        plane.index.retry_at = 0
        plane._tick(time.monotonic())
        assert plane.index.up and plane.workers["w0"].writer is not None
    finally:
        plane.sock.close(linger=0)
        redis_server.close()
