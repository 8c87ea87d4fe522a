"""Property tests: random request streams through the scheduler, with invariants after every step.

`SimWorker` is a test double for a worker. It keeps each request's tokens and block tables from the
`StepBatch` deltas, returns sampled tokens and drafts without running a model, and keeps a shadow KV
store: every computed position writes an id of the token prefix it encodes into its slot
`(block_id, offset)`. A position is valid when its slot holds the prefix of the request reading it,
so reading a stale or never-computed slot through a prefix hit shows up as a mismatch.

Invariants (one helper each, checked after every schedule/update):
  1. ref counts equal the number of live block tables holding a block;
  2. the free queue holds exactly the blocks with ref_cnt 0, once each;
  3. every cached hash names the tokens of the table slot it was cached from, the KV events mirror
     the cache map, and a cached block holds the KV its hash names;
  4. every position scheduled (lookahead included) and every position read has a real block;
  5. finished and aborted requests hold nothing and are gone;
  6. no input position past max_model_len - 1, no drafts for prefill chunks, at most K drafts;
  7. num_computed_tokens equals the worker's own count of positions with valid KV.
Also: the batch survives the wire and the worker's tables match the scheduler's; prefix hits and
every step read only valid KV; stops follow the EOS / stop-id / min- and max-token / max_model_len
rules; with no arrivals every request finishes when one max-length request fits; a drained
scheduler leaves the whole pool free.
"""

from __future__ import annotations

import itertools
import os
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specserve.control.block_pool import NULL_BLOCK_ID
from specserve.control.request import Request, RequestStatus
from specserve.control.scheduler import RequestUpdate, ScheduledStep, Scheduler
from specserve.shared.config import (
    AttentionType,
    CacheConfig,
    KVGroupSpec,
    SchedulerConfig,
    SchedulingPolicy,
    SpecConfig,
    SpecMethod,
)
from specserve.shared.hashing import BlockHash, BlockHasher
from specserve.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from specserve.shared.protocol import (
    PROTOCOL_VERSION,
    RequestResult,
    SamplingParams,
    StepBatch,
    StepResult,
    decode,
    encode,
)

FULL = AttentionType.FULL
SLIDING = AttentionType.SLIDING


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- scenarios ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    cache: CacheConfig
    sched: SchedulerConfig
    vocab: int
    eos: int | None
    prefixes: tuple[tuple[int, ...], ...]
    num_steps: int


@st.composite
def kv_layouts(draw) -> tuple[KVGroupSpec, ...]:
    kind = draw(st.sampled_from(("full", "sliding", "hybrid", "hybrid", "hybrid3", "twin")))
    size = st.sampled_from((1, 2, 3, 4))
    window = st.integers(1, 12)
    if kind == "full":
        return (KVGroupSpec(FULL, draw(size)),)
    if kind == "sliding":
        return (KVGroupSpec(SLIDING, draw(size), sliding_window=draw(window)),)
    b2 = draw(size)
    b1 = b2 * draw(st.sampled_from((1, 1, 2, 4)))  # full-attention block a multiple of (or equal)
    groups = [KVGroupSpec(FULL, b1), KVGroupSpec(SLIDING, b2, sliding_window=draw(window))]
    if kind == "hybrid3":  # two sliding groups: identical specs bundle, different ones iterate
        w2 = draw(st.one_of(st.just(groups[1].sliding_window), window))
        groups.append(KVGroupSpec(SLIDING, b2, sliding_window=w2))
    elif kind == "twin":
        groups.append(KVGroupSpec(FULL, b1))
    return tuple(draw(st.permutations(groups)))


@st.composite
def scenarios(draw, policy: SchedulingPolicy, max_steps: int = 40) -> Scenario:
    groups = draw(kv_layouts())
    max_model_len = draw(st.integers(8, 48))
    method = draw(st.sampled_from(tuple(SpecMethod)))
    k = 0 if method == SpecMethod.NONE else draw(st.integers(1, 4))
    spec = SpecConfig(method, k)
    sched = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_batched_tokens=draw(st.integers(spec.drafter_input_slots + 1, 24)),
        max_num_seqs=draw(st.integers(1, 6)),
        long_prefill_token_threshold=draw(st.one_of(st.just(0), st.integers(1, 12))),
        enable_chunked_prefill=draw(st.sampled_from((True, True, True, False))),
        policy=policy,
        spec=spec,
    )
    # A tiny pool: around what one max-length request needs, so preemption is common.
    one_request = sum(cdiv(max_model_len, g.block_size) for g in groups)
    num_blocks = one_request + 1 + draw(st.integers(-(one_request // 2), one_request))
    cache = CacheConfig(
        num_blocks=num_blocks,
        kv_groups=groups,
        enable_prefix_caching=draw(st.sampled_from((True, True, True, False))),
    )
    vocab = draw(st.integers(2, 6))
    align = cache.scheduler_block_size
    prefixes = draw(
        st.lists(
            st.integers(1, 3).flatmap(
                lambda nb: st.lists(
                    st.integers(0, vocab - 1),
                    min_size=min(nb * align, max_model_len - 1),
                    max_size=min(nb * align, max_model_len - 1),
                )
            ),
            min_size=1,
            max_size=3,
        )
    )
    return Scenario(
        cache=cache,
        sched=sched,
        vocab=vocab,
        eos=draw(st.one_of(st.none(), st.integers(0, vocab - 1))),
        prefixes=tuple(tuple(p) for p in prefixes),
        num_steps=draw(st.integers(4, max_steps)),
    )


# --- the worker test double --------------------------------------------------------------------


class Choices:
    """Where the worker double's random choices come from: hypothesis draws while the stream
    runs (so they shrink), a seeded RNG while the stream settles (so long tails stay cheap)."""

    def __init__(self, data: st.DataObject | None, rng: random.Random | None = None) -> None:
        self.data = data
        self.rng = rng

    def int(self, lo: int, hi: int, label: str | None = None) -> int:
        if self.data is not None:
            return self.data.draw(st.integers(lo, hi), label=label)
        assert self.rng is not None
        return self.rng.randint(lo, hi)


class PrefixIds:
    """Interns token prefixes: ids(tokens)[p] names tokens[: p + 1] (equal ids, equal prefixes)."""

    def __init__(self) -> None:
        self._nodes: dict[tuple[int, int], int] = {}

    def ids(self, tokens: list[int]) -> list[int]:
        out, node = [], 0
        for token in tokens:
            node = self._nodes.setdefault((node, token), len(self._nodes) + 1)
            out.append(node)
        return out


@dataclass
class WorkerRequest:
    handle: int
    request_id: str
    tokens: list[int]
    tables: list[list[int]]
    num_computed: int  # positions whose KV this worker has written with the request's own tokens
    drafts: list[int] = field(default_factory=list)  # proposed in the last result


@dataclass
class Scheduled:
    """One request's work in one step, as the worker sees it."""

    handle: int
    request_id: str
    computed_before: int
    num_scheduled: int
    drafts: list[int]

    @property
    def end_known(self) -> int:
        return self.computed_before + self.num_scheduled - len(self.drafts)


class SimWorker:
    """Plays the worker: state from StepBatch deltas, random samples and drafts, shadow KV."""

    def __init__(self, scenario: Scenario) -> None:
        self.groups = scenario.cache.kv_groups
        self.spec = scenario.sched.spec
        self.max_model_len = scenario.sched.max_model_len
        self.vocab = scenario.vocab
        self.reqs: dict[int, WorkerRequest] = {}
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}  # (block, offset) -> (group, prefix)
        self.prefix_ids = PrefixIds()
        self.stats: Counter[str] = Counter()

    def apply_batch(self, batch: StepBatch) -> list[Scheduled]:
        for handle in [*batch.preempted, *batch.finished]:
            assert handle in self.reqs, f"batch drops handle {handle}, which the worker never held"
            del self.reqs[handle]
        out: list[Scheduled] = []
        for new in batch.new_requests:
            assert new.handle not in self.reqs, f"NewRequest for held handle {new.handle}"
            wr = WorkerRequest(
                new.handle,
                new.request_id,
                list(new.token_ids),
                [list(t) for t in new.block_ids],
                new.num_computed_tokens,  # a prefix hit: checked against the shadow KV below
            )
            self.reqs[new.handle] = wr
            out.append(
                Scheduled(
                    new.handle,
                    new.request_id,
                    new.num_computed_tokens,
                    new.num_scheduled_tokens,
                    [],
                )
            )
        for delta in batch.running:
            wr = self.reqs.get(delta.handle)
            assert wr is not None, f"RunningDelta for unknown handle {delta.handle}"
            assert delta.num_computed_tokens == wr.num_computed, (
                f"{wr.request_id}: delta says {delta.num_computed_tokens} computed tokens, the "
                f"worker has KV for {wr.num_computed}"
            )
            if delta.new_block_ids is not None:
                assert len(delta.new_block_ids) == len(self.groups)
                for table, new_ids in zip(wr.tables, delta.new_block_ids, strict=True):
                    table.extend(new_ids)
            # The worker holds its own proposal; the delta says how many of it to verify.
            assert delta.num_spec_tokens <= len(wr.drafts), (
                f"{wr.request_id}: {delta.num_spec_tokens} drafts to verify, {len(wr.drafts)} held"
            )
            drafts = wr.drafts[: delta.num_spec_tokens]
            out.append(
                Scheduled(
                    delta.handle,
                    wr.request_id,
                    delta.num_computed_tokens,
                    delta.num_scheduled_tokens,
                    drafts,
                )
            )
        return out

    def block_of(self, wr: WorkerRequest, group: int, pos: int) -> int:
        bs = self.groups[group].block_size
        table = wr.tables[group]
        return table[pos // bs] if pos // bs < len(table) else NULL_BLOCK_ID

    def read_range(self, group: int, computed: int) -> range:
        """Positions earlier than `computed` that the first query at `computed` attends to."""
        spec = self.groups[group]
        if spec.attention == SLIDING:
            assert spec.sliding_window is not None
            return range(max(0, computed - spec.sliding_window + 1), computed)
        return range(computed)

    def write(self, s: Scheduled) -> None:
        """The target forward pass: KV for every scheduled position, drafts included."""
        wr = self.reqs[s.handle]
        seq = wr.tokens[: s.end_known] + s.drafts
        ids = self.prefix_ids.ids(seq)
        for g, spec in enumerate(self.groups):
            for pos in range(s.computed_before, s.computed_before + s.num_scheduled):
                block = self.block_of(wr, g, pos)
                assert block != NULL_BLOCK_ID, f"{wr.request_id}: writes position {pos} to null"
                self.kv[(block, pos % spec.block_size)] = (g, ids[pos])

    def check_reads(self, s: Scheduled) -> None:
        """Lossless: every earlier position the step attends to holds this request's KV."""
        wr = self.reqs[s.handle]
        ids = self.prefix_ids.ids(wr.tokens[: s.computed_before])
        for g, spec in enumerate(self.groups):
            for pos in self.read_range(g, s.computed_before):
                block = self.block_of(wr, g, pos)
                got = self.kv.get((block, pos % spec.block_size))
                assert got == (g, ids[pos]), (
                    f"{wr.request_id}: group {g} position {pos} (block {block}) does not hold the "
                    f"KV of this request's tokens (computed_before={s.computed_before})"
                )

    def result(self, s: Scheduled, choose: Choices, fail: bool) -> RequestResult:
        wr = self.reqs[s.handle]
        if fail:
            return RequestResult(s.handle, [], error="simulated failure")
        is_chunk = s.end_known < len(wr.tokens)
        if is_chunk:
            assert not s.drafts, f"{wr.request_id}: drafts scheduled for a prefill chunk"
            self.stats["prefill chunk"] += 1
            sampled: list[int] = []
            wr.num_computed = s.computed_before + s.num_scheduled
        else:
            accepted = choose.int(0, len(s.drafts), "accepted")
            if s.drafts:
                self.stats["all drafts accepted" if accepted == len(s.drafts) else "rejection"] += 1
            sampled = [*s.drafts[:accepted], choose.int(0, self.vocab - 1, "token")]
            wr.tokens.extend(sampled)
            wr.num_computed = s.end_known + accepted
        drafts = None
        k = self.spec.num_spec_tokens
        if k and choose.int(0, 4, "propose") > 0:  # sometimes no proposal at all
            size = choose.int(0, k, "ngram matches") if self.spec.method == SpecMethod.NGRAM else k
            drafts = [choose.int(0, self.vocab - 1, "draft") for _ in range(size)]
        wr.drafts = [] if is_chunk else list(drafts or [])
        return RequestResult(s.handle, sampled, drafts)


# --- the simulation ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CachedRecord:
    block_hash: BlockHash
    group: int
    prefixes: tuple[int, ...]  # prefix ids of the block's positions


class Simulation:
    def __init__(self, scenario: Scenario) -> None:
        self.sc = scenario
        self.cfg = scenario.sched
        self.sched = Scheduler(scenario.sched, scenario.cache)
        self.kv = self.sched.kv
        self.pool = self.kv.pool
        self.managers = self.kv.coordinator.managers
        self.groups = scenario.cache.kv_groups
        self.worker = SimWorker(scenario)
        self.hasher = BlockHasher(scenario.cache.hash_algo, scenario.cache.hash_seed)
        self.hash_bs = scenario.cache.hash_block_size
        self.expected_tokens: dict[str, list[int]] = {}
        self.all_requests: dict[str, Request] = {}
        self.gone: set[str] = set()  # finished or aborted
        self.mirror: Counter[tuple[BlockHash, int]] = Counter()  # the KV-event view of the cache
        self.records: dict[int, CachedRecord] = {}
        self._ids = itertools.count()
        self.stats: Counter[str] = Counter()  # what an example exercised, for hypothesis events

    # --- driving ---------------------------------------------------------------------------

    def add_request(self, data: st.DataObject, now: float) -> None:
        sc = self.sc
        vocab = st.integers(0, sc.vocab - 1)
        which = data.draw(st.integers(-1, len(sc.prefixes) - 1), label="prefix")
        prompt: list[int] = []
        if which >= 0:
            prefix = sc.prefixes[which]
            cut = data.draw(st.sampled_from((len(prefix), len(prefix), *range(len(prefix)))))
            prompt = list(prefix[:cut])
        prompt += data.draw(st.lists(vocab, max_size=8), label="suffix")
        prompt = prompt[: self.cfg.max_model_len - 1] or [data.draw(vocab)]
        max_tokens = data.draw(st.integers(1, 16), label="max_tokens")
        sampling = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=data.draw(st.sampled_from((0, 0, 0, max_tokens // 2))),
            stop_token_ids=tuple(data.draw(st.lists(vocab, max_size=1))),
            ignore_eos=data.draw(st.booleans()),
        )
        priority = 0
        if self.cfg.policy == SchedulingPolicy.PRIORITY:
            priority = data.draw(st.integers(0, 2), label="priority")
        rid = f"r{next(self._ids)}"
        request = Request(
            rid, prompt, sampling, eos_token_id=sc.eos, priority=priority, arrival_time=now
        )
        cfg = self.cfg
        if not cfg.enable_chunked_prefill and len(prompt) > cfg.max_num_batched_tokens:
            # Could never be scheduled in one step: refused up front, and nothing is kept.
            with pytest.raises(ValueError, match="chunked prefill is off"):
                self.sched.add_request(request)
            assert rid not in self.sched.requests
            return
        self.sched.add_request(request)
        self.all_requests[rid] = request
        self.expected_tokens[rid] = list(prompt)

    def maybe_abort(self, data: st.DataObject) -> list[str]:
        live = sorted(self.sched.requests)
        if not live or data.draw(st.integers(0, 5), label="abort?") > 0:
            return []
        victim = data.draw(st.sampled_from(live), label="abort")
        self.stats[f"abort {self.sched.requests[victim].status.name.lower()}"] += 1
        self.sched.abort_requests([victim])
        self.gone.add(victim)
        return [victim]

    def step(
        self, data: st.DataObject | None, now: float, rng: random.Random | None = None
    ) -> None:
        """One schedule/execute/update round; with `data` None only the worker chooses (by `rng`)
        and nothing arrives or is aborted."""
        choose = Choices(data, rng)
        if data is not None:
            for _ in range(data.draw(st.integers(0, 2), label="arrivals")):
                self.add_request(data, now)
            self.maybe_abort(data)
        self.check_all()

        step = self.sched.schedule()
        self.take_events(step.preempted_ids)
        self.stats["preemption"] += len(step.preempted_ids)
        for new in step.batch.new_requests:
            self.stats["prefix hit" if new.num_computed_tokens else "admission without hit"] += 1
        assert decode(encode(step.batch)) == step.batch, "the step batch does not survive the wire"
        work = self.worker.apply_batch(step.batch)
        self.check_schedule(step, work)
        for s in work:
            self.worker.write(s)
        for s in work:
            self.worker.check_reads(s)
        self.check_cached_blocks(content=True)

        if data is not None:
            self.maybe_abort(data)  # an abort while the step is in flight: its output is stale
        results = [
            self.worker.result(s, choose, fail=choose.int(0, 40, "fail?") == 0) for s in work
        ]
        updates = self.sched.update_from_output(
            step, StepResult(PROTOCOL_VERSION, step.batch.step_id, results)
        )
        self.check_updates(step, work, results, updates)
        self.take_events([])
        self.check_all()

    def settle(self, seed: int) -> None:
        """Liveness: with no arrivals, every request finishes when one max-length request fits in
        the pool (and a whole prompt fits the token budget when prefill chunking is off)."""
        cfg, cache = self.cfg, self.sc.cache
        one_request = sum(cdiv(cfg.max_model_len, g.block_size) for g in self.groups)
        if cache.num_blocks - 1 < one_request:
            return
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < cfg.max_model_len:
            return
        rng = random.Random(seed)
        limit = 50 + 4 * cfg.max_model_len * len(self.sched.requests)
        for step_no in range(limit):
            if not self.sched.has_unfinished_requests:
                return
            self.step(None, now=1e6 + step_no, rng=rng)
        raise AssertionError(
            f"no progress: {sorted(self.sched.requests)} unfinished after {limit} steps "
            f"({len(self.sched.running)} running)"
        )

    def drain(self) -> None:
        self.sched.abort_requests(sorted(self.sched.requests))
        self.gone.update(self.all_requests)
        step = self.sched.schedule()
        assert not step.num_scheduled_tokens
        self.worker.apply_batch(step.batch)
        assert not self.worker.reqs, f"worker still holds {sorted(self.worker.reqs)} after drain"
        self.take_events([])
        self.check_all()
        assert not self.sched.has_unfinished_requests
        assert self.pool.num_free_blocks == self.sc.cache.num_blocks - 1, (
            f"after draining, {self.sc.cache.num_blocks - 1 - self.pool.num_free_blocks} blocks "
            "are still not free"
        )
        assert self.kv.reset_prefix_cache()
        assert self.pool.num_cached_blocks() == 0
        events = self.sched.take_kv_events()
        assert any(isinstance(e, AllBlocksCleared) for e in events)

    # --- hashes and events -----------------------------------------------------------------

    def own_hashes(self, tokens: list[int], block_size: int) -> list[BlockHash]:
        """Chained hashes of full blocks, computed here rather than by the request."""
        fine: list[BlockHash] = []
        parent = None
        for start in range(0, len(tokens) - self.hash_bs + 1, self.hash_bs):
            parent = self.hasher.hash_block(parent, tokens[start : start + self.hash_bs], None)
            fine.append(parent)
        scale = block_size // self.hash_bs
        return fine[scale - 1 :: scale]

    def take_events(self, preempted_ids: list[str]) -> None:
        for kv_event in self.sched.take_kv_events():
            if isinstance(kv_event, BlockStored):
                assert len(kv_event.block_hashes) == len(kv_event.block_ids)
                for block_hash, block_id in zip(
                    kv_event.block_hashes, kv_event.block_ids, strict=True
                ):
                    self.mirror[(block_hash, kv_event.group)] += 1
                    self.record_stored(block_hash, block_id, kv_event.group, preempted_ids)
            elif isinstance(kv_event, BlockRemoved):
                for block_hash in kv_event.block_hashes:
                    key = (block_hash, kv_event.group)
                    assert self.mirror[key] > 0, "BlockRemoved for a hash never stored"
                    self.mirror[key] -= 1
            else:
                assert isinstance(kv_event, AllBlocksCleared)
                self.mirror.clear()
        self.mirror = +self.mirror

    def record_stored(
        self, block_hash: BlockHash, block_id: int, group: int, preempted_ids: list[str]
    ) -> None:
        """Invariant 3 at caching time: the hash is the chained hash of the slot's tokens."""
        assert block_id != NULL_BLOCK_ID, "the null block was cached"
        bs = self.groups[group].block_size
        block = self.pool.blocks[block_id]
        candidates: list[tuple[str, int]] = []
        if block.block_hash == block_hash and block.group == group:
            for rid, table in self.managers[group].req_blocks.items():
                candidates += [(rid, i) for i, b in enumerate(table) if b is block]
        for rid, index in candidates:
            tokens = self.sched.requests[rid].all_token_ids
            own = self.own_hashes(tokens, bs)
            assert index < len(own) and own[index] == block_hash, (
                f"group {group} block {block_id} cached at table index {index} of {rid} under a "
                f"hash that is not the chained hash of {rid}'s tokens there"
            )
        if not candidates:
            # Cached by a request that this same schedule() call then preempted: its table is gone.
            for rid in preempted_ids:
                tokens = self.all_requests[rid].all_token_ids
                own = self.own_hashes(tokens, bs)
                if block_hash in own:
                    candidates.append((rid, own.index(block_hash)))
            assert candidates, (
                f"group {group} block {block_id} was cached under a hash that no holder's tokens "
                "produce"
            )
        rid, index = candidates[0]
        if block.block_hash == block_hash and block.group == group:
            tokens = self.all_requests[rid].all_token_ids[: (index + 1) * bs]
            prefixes = tuple(self.worker.prefix_ids.ids(tokens)[index * bs :])
            self.records[block_id] = CachedRecord(block_hash, group, prefixes)

    # --- invariants ------------------------------------------------------------------------

    def check_all(self) -> None:
        self.check_ref_counts()
        self.check_free_queue()
        self.check_cached_blocks(content=False)
        self.check_gone_requests()

    def check_ref_counts(self) -> None:
        """Invariant 1: ref_cnt = number of live block tables holding the block."""
        holders: Counter[int] = Counter()
        groups_of: dict[int, set[int]] = {}
        for manager in self.managers:
            for rid, table in manager.req_blocks.items():
                for block in table:
                    assert self.pool.blocks[block.block_id] is block, "a table holds a stray block"
                    if not block.is_null:
                        holders[block.block_id] += 1
                        groups_of.setdefault(block.block_id, set()).add(manager.group)
                assert rid in manager.num_cached, f"{rid} has a table but no num_cached entry"
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by "
                f"{holders[block.block_id]} live block tables"
            )
            if block.ref_cnt > 1:
                assert block.block_hash is not None, (
                    f"block {block.block_id} is shared by {block.ref_cnt} tables but not cached"
                )
            assert len(groups_of.get(block.block_id, ())) <= 1, (
                f"block {block.block_id} is held by tables of groups {groups_of[block.block_id]}"
            )

    def check_free_queue(self) -> None:
        """Invariant 2: the free queue holds exactly the unreferenced non-null blocks, once each."""
        queue = self.pool.free_queue
        ids = queue.block_ids()
        assert len(ids) == len(set(ids)), f"a block is queued twice: {sorted(ids)}"
        assert NULL_BLOCK_ID not in ids, "the null block is in the free queue"
        assert len(ids) == queue.num_free == self.pool.num_free_blocks, (
            f"free queue has {len(ids)} blocks but counts {queue.num_free}"
        )
        node = queue._head
        while node.next is not None:
            assert node.next.prev is node, "free queue back links are broken"
            node = node.next
        free = set(ids)
        for block in self.pool.blocks[1:]:
            if block.ref_cnt > 0:
                assert block.block_id not in free, f"block {block.block_id} is held and free"
            else:
                assert block.block_id in free, f"block {block.block_id} is unreferenced, not free"

    def check_cached_blocks(self, content: bool) -> None:
        """Invariant 3: cached hashes, the hash map and the KV events agree; with `content`, a
        cached block's slots hold the KV of the tokens its hash names."""
        counts: Counter[tuple[BlockHash, int]] = Counter()
        assert self.pool.null_block.block_hash is None, "the null block has a hash"
        for block in self.pool.blocks[1:]:
            if block.block_hash is None:
                assert block.group == -1
                continue
            key = (block.block_hash, block.group)
            counts[key] += 1
            record = self.records.get(block.block_id)
            assert record is not None and (record.block_hash, record.group) == key, (
                f"block {block.block_id} carries a hash that no BlockStored event gave it"
            )
            found = self.pool.get_cached_block(*key)
            assert found is not None and (found.block_hash, found.group) == key, (
                f"get_cached_block misses the hash of block {block.block_id}"
            )
            if content:
                bs = self.groups[block.group].block_size
                for offset in range(bs):
                    got = self.worker.kv.get((block.block_id, offset))
                    assert got == (block.group, record.prefixes[offset]), (
                        f"cached block {block.block_id} (group {block.group}) slot {offset} does "
                        "not hold the KV its hash names"
                    )
        assert self.pool.num_cached_blocks() == sum(counts.values())
        assert counts == self.mirror, "the KV events disagree with the cache map"
        self.check_prefix_closed()

    def check_prefix_closed(self) -> None:
        """What the Redis index's bisection relies on: in a full-attention group, no block of a
        chain is cached while an earlier block of the same chain is not."""
        for group, spec in enumerate(self.groups):
            if spec.attention != FULL or spec.block_size != self.hash_bs:
                continue
            for request in self.all_requests.values():
                held = [self.pool.get_cached_block(h, group) is not None
                        for h in request.block_hashes]  # fmt: skip
                gap = held.index(False) if False in held else len(held)
                assert not any(held[gap:]), (
                    f"group {group}: request {request.request_id}'s chain is cached past a gap "
                    f"at block {gap}: {held}"
                )

    def check_gone_requests(self) -> None:
        """Invariant 5: finished or aborted requests hold nothing; only running requests hold."""
        running = {r.request_id for r in self.sched.running}
        waiting = {r.request_id for r in self.sched.waiting}
        for rid in self.gone:
            assert rid not in self.sched.requests, f"finished {rid} is still in scheduler.requests"
            assert rid not in running and rid not in waiting, f"finished {rid} is still queued"
        for manager in self.managers:
            held = set(manager.req_blocks) | set(manager.num_cached)
            assert not held & self.gone, f"finished {sorted(held & self.gone)} still hold blocks"
            assert held <= running, f"{sorted(held - running)} hold blocks but are not running"
        assert running | waiting == set(self.sched.requests)
        assert len(self.sched.running) == len(running), "a request is in running twice"

    def check_schedule(self, step: ScheduledStep, work: list[Scheduled]) -> None:
        """Invariants 4 and 6, plus the budgets and the worker's copy of the block tables."""
        cfg = self.cfg
        k = cfg.spec.num_spec_tokens
        lookahead = cfg.spec.lookahead_tokens
        assert len({s.handle for s in work}) == len(work), "a request is scheduled twice"
        assert sum(s.num_scheduled for s in work) <= cfg.max_num_batched_tokens
        assert (
            sum(s.num_scheduled + cfg.spec.drafter_input_slots for s in work)
            <= cfg.max_num_batched_tokens
        ), "the drafter's input slots overrun the input budget"
        assert len(self.sched.running) <= cfg.max_num_seqs
        assert step.total_tokens == sum(s.num_scheduled for s in work)
        for s in work:
            request = self.sched.requests[s.request_id]
            wr = self.worker.reqs[s.handle]
            assert request.status == RequestStatus.RUNNING
            assert wr.tokens == self.expected_tokens[s.request_id] == request.all_token_ids
            # Invariant 6.
            assert s.num_scheduled >= 1
            assert s.computed_before + s.num_scheduled - 1 <= cfg.max_model_len - 1, (
                f"{s.request_id}: input position {s.computed_before + s.num_scheduled - 1} "
                f"exceeds max_model_len - 1 = {cfg.max_model_len - 1}"
            )
            assert len(s.drafts) <= k, f"{s.request_id}: {len(s.drafts)} drafts with K={k}"
            assert s.end_known <= len(wr.tokens), f"{s.request_id}: scheduled past its tokens"
            if s.drafts:
                assert s.end_known == len(wr.tokens), (
                    f"{s.request_id}: drafts scheduled with a prefill chunk"
                )
            assert step.spec_token_ids.get(s.request_id, []) == s.drafts, (
                f"{s.request_id}: the scheduler verifies {step.spec_token_ids.get(s.request_id)}, "
                f"the worker's proposal starts {s.drafts}"
            )
            if s.handle in {n.handle for n in step.batch.new_requests}:
                hit = s.computed_before
                assert 0 <= hit < len(wr.tokens)
                assert hit % self.sc.cache.scheduler_block_size == 0, f"unaligned hit {hit}"
            # The worker's tables (from the wire) match the scheduler's, up to freed slots.
            sched_tables = self.kv.block_ids(request)
            for g, (mine, theirs) in enumerate(zip(wr.tables, sched_tables, strict=True)):
                assert len(mine) == len(theirs), f"{s.request_id}: group {g} table lengths differ"
                for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                    assert b in (a, NULL_BLOCK_ID), (
                        f"{s.request_id}: group {g} index {i} is block {a} on the worker but "
                        f"{b} in the scheduler"
                    )
            # Invariant 4: a real block for every position written (lookahead included) and read.
            end = min(s.computed_before + s.num_scheduled + lookahead, cfg.max_model_len)
            for g, spec in enumerate(self.groups):
                first = self.worker.read_range(g, s.computed_before).start
                table = sched_tables[g]
                for pos in range(first, end):
                    index = pos // spec.block_size
                    assert index < len(table) and table[index] != NULL_BLOCK_ID, (
                        f"{s.request_id}: group {g} position {pos} has no slot (table {table}, "
                        f"computed {s.computed_before}, scheduled {s.num_scheduled}, "
                        f"lookahead {lookahead})"
                    )

    def check_updates(
        self,
        step: ScheduledStep,
        work: list[Scheduled],
        results: list[RequestResult],
        updates: list[RequestUpdate],
    ) -> None:
        """Stop rules and invariant 7 (the scheduler's computed count is the worker's)."""
        by_id = {u.request_id: u for u in updates}
        assert len(by_id) == len(updates)
        for s, res in zip(work, results, strict=True):
            rid = s.request_id
            if rid in self.gone:  # aborted in flight: stale output
                assert rid not in by_id
                continue
            update = by_id.get(rid)
            if res.error is not None:
                assert update is not None and update.finished
                assert update.status == RequestStatus.FINISHED_ERROR
                self.gone.add(rid)
                continue
            expected = self.expected_tokens[rid]
            request = self.all_requests[rid]
            appended: list[int] = []
            allowed: set[RequestStatus] = set()
            for token in res.sampled_token_ids:
                expected.append(token)
                appended.append(token)
                allowed = self.stop_statuses(request, expected)
                if allowed:
                    break
            if not appended:
                assert update is None, f"{rid}: an update for a step without output"
                continue
            assert update is not None, f"{rid}: no update for a step with output"
            assert update.new_token_ids == appended, f"{rid}: {update.new_token_ids} != {appended}"
            assert update.finished == bool(allowed), (
                f"{rid}: finished={update.finished}, the stop rules say {sorted(allowed)} "
                f"(tokens {expected}, sampling {request.sampling})"
            )
            if allowed:
                assert update.status in allowed, f"{rid}: {update.status} not in {allowed}"
                self.stats[update.status.name.lower()] += 1
                self.gone.add(rid)
        for request in self.sched.running:
            wr = self.worker.reqs[request.handle]
            assert request.all_token_ids == self.expected_tokens[request.request_id]
            assert request.num_computed_tokens <= request.num_tokens
            assert request.num_computed_tokens == wr.num_computed, (
                f"{request.request_id}: num_computed_tokens {request.num_computed_tokens}, the "
                f"worker has KV for {wr.num_computed}"
            )
        for request in self.sched.waiting:
            assert request.num_computed_tokens == 0 and not request.spec_token_ids

    def stop_statuses(self, request: Request, tokens: list[int]) -> set[RequestStatus]:
        """Every status the stop rules allow after the last token; empty if it must go on."""
        sampling = request.sampling
        num_output = len(tokens) - request.num_prompt_tokens
        token = tokens[-1]
        out = set()
        if len(tokens) >= self.cfg.max_model_len:
            out.add(RequestStatus.FINISHED_LENGTH)
        if num_output >= sampling.min_tokens:
            eos = not sampling.ignore_eos and token == request.eos_token_id
            if eos or token in sampling.stop_token_ids:
                out.add(RequestStatus.FINISHED_STOPPED)
            if num_output >= sampling.max_tokens:
                out.add(RequestStatus.FINISHED_LENGTH)
        return out


# --- the tests ---------------------------------------------------------------------------------


def run_simulation(scenario: Scenario, data: st.DataObject) -> None:
    sim = Simulation(scenario)
    for step_no in range(scenario.num_steps):
        sim.step(data, now=float(step_no))
    sim.settle(seed=data.draw(st.integers(0, 2**32 - 1), label="settle seed"))
    sim.drain()
    for name, count in (sim.stats + sim.worker.stats).items():
        event(f"{name} ({'>=5' if count >= 5 else '1-4'})")


SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("policy", list(SchedulingPolicy))
@settings(max_examples=100, **SETTINGS)
@given(data=st.data())
def test_random_request_streams_keep_the_invariants(policy: SchedulingPolicy, data: st.DataObject):
    run_simulation(data.draw(scenarios(policy), label="scenario"), data)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("SPECSERVE_LONG_STREAMS"),
    reason="several minutes; set SPECSERVE_LONG_STREAMS=1 to run the long streams",
)
@pytest.mark.parametrize("policy", list(SchedulingPolicy))
@settings(max_examples=1000, **SETTINGS)
@given(data=st.data())
def test_random_request_streams_keep_the_invariants_long(
    policy: SchedulingPolicy, data: st.DataObject
):
    run_simulation(data.draw(scenarios(policy, max_steps=120), label="scenario"), data)


# --- minimal reproductions of violations the streams found ---------------------------------------


def _complete_step(sched: Scheduler, step: ScheduledStep, token: int = 0) -> None:
    """Worker double for hand-written cases: no output for prefill chunks, one token otherwise."""
    results = []
    for new in step.batch.new_requests:
        done = new.num_computed_tokens + new.num_scheduled_tokens == len(new.token_ids)
        results.append(RequestResult(new.handle, [token] if done else []))
    for delta in step.batch.running:
        request = next(r for r in sched.running if r.handle == delta.handle)
        done = delta.num_computed_tokens + delta.num_scheduled_tokens >= request.num_tokens
        results.append(RequestResult(delta.handle, [token] if done else []))
    sched.update_from_output(step, StepResult(PROTOCOL_VERSION, step.batch.step_id, results))


def test_preempting_an_already_scheduled_victim_does_not_leave_uncomputed_blocks_cached():
    """Priority policy: a victim already scheduled in this step loses its slot, but the blocks its
    allocation hashed at schedule time stay cached, so a later hit skips KV nobody computed."""
    sched = Scheduler(
        SchedulerConfig(max_model_len=32, long_prefill_token_threshold=3, policy="priority"),
        CacheConfig(num_blocks=5, kv_groups=(KVGroupSpec(FULL, 4),)),
    )
    low = Request("low", list(range(1, 13)), SamplingParams(), priority=1, arrival_time=0.0)
    sched.add_request(low)
    _complete_step(sched, sched.schedule())  # low computes positions 0-2
    high = Request("high", [7] * 5, SamplingParams(max_tokens=1), priority=0, arrival_time=1.0)
    sched.add_request(high)
    _complete_step(sched, sched.schedule())  # low 3-5 (block 0 cached), high 0-2
    step = sched.schedule()  # low 6-8 hashes block 1 (4-7), then high's allocation preempts it
    assert step.preempted_ids == ["low"] and "low" not in step.num_scheduled_tokens
    _complete_step(sched, step)  # positions 6 and 7 were never computed; high finishes
    step = sched.schedule()
    (resumed,) = step.batch.new_requests
    assert resumed.request_id == "low"
    # Only positions 0-5 ever had KV written, so at most block 0 (4 tokens) may hit.
    assert resumed.num_computed_tokens <= 4, (
        f"resumed with a {resumed.num_computed_tokens}-token hit over never-computed positions"
    )
