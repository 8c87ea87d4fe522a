"""Real events from the scheduler, written through to Redis, answer router lookups correctly."""

from __future__ import annotations

from specserve.cache_index import IndexReader, IndexWriter, Namespace, register_worker
from specserve.cache_index.schema import digest_key
from specserve.control.request import Request
from specserve.control.scheduler import Scheduler
from specserve.shared.config import CacheConfig, KVGroupSpec, SchedulerConfig
from specserve.shared.hashing import BlockHasher, extend_block_hashes
from specserve.shared.protocol import PROTOCOL_VERSION, RequestResult, SamplingParams, StepResult

BLOCK = 4
GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


class Worker:
    """One worker's scheduler plus its index writer; the model is a script emitting token 7."""

    def __init__(self, client, ns: Namespace, worker_id: str, num_blocks: int) -> None:
        cache = CacheConfig(num_blocks=num_blocks, kv_groups=(KVGroupSpec("full", BLOCK),))
        self.scheduler = Scheduler(SchedulerConfig(max_model_len=256), cache)
        self.writer = IndexWriter(client, ns, worker_id, register_worker(client, ns, worker_id, {}))
        self.events = 0

    def run(self, prompts: dict[str, list[int]]) -> None:
        s = self.scheduler
        for rid, prompt in prompts.items():
            s.add_request(Request(rid, prompt, GREEDY))
        while s.has_unfinished_requests:
            step = s.schedule()
            results = []
            for rid in step.num_scheduled_tokens:
                req = s.requests[rid]
                done_prefill = req.num_computed_tokens >= req.num_tokens
                results.append(RequestResult(req.handle, [7] if done_prefill else []))
            s.update_from_output(step, StepResult(PROTOCOL_VERSION, step.batch.step_id, results))
            events = s.take_kv_events()
            self.events += len(events)
            self.writer.apply(events)

    def cached_prefix(self, hashes) -> int:
        pool, n = self.scheduler.kv.pool, 0
        while n < len(hashes) and pool.get_cached_block(hashes[n], 0) is not None:
            n += 1
        return n

    def pool_entries(self) -> set[bytes]:
        return {bytes((g,)) + digest_key(h) for (h, g) in self.scheduler.kv.pool._cached}


def prompt_hashes(tokens: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(BlockHasher(), hashes, tokens, BLOCK)
    return hashes


def test_router_lookup_matches_the_schedulers_cache(client, ns):
    system = list(range(100, 118))  # 18 tokens: 4 full blocks + 2
    other = list(range(500, 511))  # 11 tokens: 2 full blocks + 3
    a = Worker(client, ns, "a", num_blocks=64)
    b = Worker(client, ns, "b", num_blocks=64)
    a.run({"a1": [*system, 1, 2, 3], "a2": [*system, 4, 5, 6, 7, 8]})
    b.run({"b1": [*system[:9], 9, 9, 9, 9], "b2": [*other, 1, 1, 1, 1, 1]})
    assert a.events and b.events

    reader = IndexReader(client, ns)
    new_prompt = [*system[:17], 42, 43, 44]  # shares 17 tokens (4 full blocks) with a's prompts
    hashes = prompt_hashes(new_prompt)
    assert reader.longest_prefix(hashes) == {"a": 4, "b": 2}
    assert {"a": a.cached_prefix(hashes), "b": b.cached_prefix(hashes)} == {"a": 4, "b": 2}

    hashes = prompt_hashes([*other, 1, 1, 1, 1, 1, 2, 2])  # b's second prompt, longer
    assert reader.longest_prefix(hashes) == {"b": b.cached_prefix(hashes)} == {"b": 4}

    for worker in (a, b):
        members = client.smembers(ns.reverse_key(worker.writer.worker_id, worker.writer.epoch))
        assert members == worker.pool_entries()


def test_evictions_flow_through(client, ns):
    """A small pool evicts old prefixes; the index forgets exactly what the pool forgot."""
    worker = Worker(client, ns, "a", num_blocks=12)
    prompts = {f"r{i}": [1000 * i + t for t in range(14)] for i in range(5)}
    # A prompt of whole blocks recomputes its last block and caches a twin of it each time.
    prompts |= {f"twin{i}": list(range(8)) for i in range(3)}
    for rid, prompt in sorted(prompts.items(), key=lambda item: item[0][-1]):
        worker.run({rid: prompt})
    assert worker.writer.stats.blocks_removed > 0

    reader = IndexReader(client, ns)
    for prompt in prompts.values():
        hashes = prompt_hashes([*prompt, 0, 0])
        expected = worker.cached_prefix(hashes)
        assert reader.longest_prefix(hashes) == ({"a": expected} if expected else {})
    members = client.smembers(ns.reverse_key("a", worker.writer.epoch))
    assert members == worker.pool_entries()
