"""Write-through of one worker's block-pool events into the index, one round trip per step.

The control plane allocates blocks itself, so it writes the index at scheduling time, when the
pool emits its events. The writer keeps a reference count per (group, hash): the pool may cache
one hash in several blocks (identical content is not de-duplicated), and the index must keep the
entry until the last of them is evicted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from redis import Redis

from specserve.cache_index.client import check_client
from specserve.cache_index.errors import (
    IndexFenced,
    IndexOutOfSync,
    IndexUnavailable,
    unavailable_as_index_error,
)
from specserve.cache_index.registry import bump_epoch
from specserve.cache_index.schema import (
    Namespace,
    check_worker_id,
    digest_key,
    fenced_member,
    reverse_member,
)
from specserve.shared.hashing import BlockHash
from specserve.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

CachedEntries = Iterable[tuple[int, BlockHash]]
"""A worker's whole prefix cache as (KV group, block hash) pairs; duplicates allowed."""


@dataclass
class WriterStats:
    """Counters for metrics; a block counts when its entry appears in or leaves Redis."""

    blocks_written: int = 0
    blocks_removed: int = 0
    unknown_removes: int = 0  # BlockRemoved for a hash this writer never stored
    clears: int = 0
    resyncs: int = 0
    round_trips: int = 0
    batches_applied: int = 0
    batches_dropped: int = 0  # batches lost while Redis was unavailable or out of sync


class IndexWriter:
    """Writes one worker's prefix-cache state under its current epoch.

    `snapshot`, if given, returns the worker's whole cache (e.g. from its block pool); after a
    dropped batch, `apply` then resyncs from it by itself instead of raising `IndexOutOfSync`.
    One writer per (worker, epoch): the control plane that schedules the worker owns it.
    """

    def __init__(
        self,
        client: Redis,
        namespace: Namespace,
        worker_id: str,
        epoch: int,
        *,
        snapshot: Callable[[], CachedEntries] | None = None,
        max_commands: int = 10_000,
    ) -> None:
        if max_commands < 2:
            raise ValueError("max_commands must be at least 2")
        self.client = check_client(client)
        self.ns = namespace
        self.worker_id = check_worker_id(worker_id)
        self.epoch = epoch
        self.snapshot = snapshot
        self.max_commands = max_commands
        self.stats = WriterStats()
        self.needs_resync = False
        self.fenced = False
        self._held: dict[tuple[int, bytes], int] = {}
        self._field = worker_id.encode()

    @property
    def num_entries(self) -> int:
        """Distinct (group, hash) entries this writer holds in the index."""
        return len(self._held)

    # --- the hot path -----------------------------------------------------------------------

    def apply(self, events: Sequence[KVEvent]) -> None:
        """Write one step's events: one pipelined round trip (two if they hold AllBlocksCleared).

        Raises `IndexUnavailable` (the batch is dropped and counted; the next call resyncs or
        raises `IndexOutOfSync`) or `IndexFenced`; never a raw Redis connection error.
        """
        if self.fenced:
            raise IndexFenced(f"worker {self.worker_id} epoch {self.epoch} is fenced")
        if self.needs_resync:
            if self.snapshot is None:
                self.stats.batches_dropped += 1
                raise IndexOutOfSync(
                    f"worker {self.worker_id}: a batch was dropped; call resync() first"
                )
            self.resync(self.snapshot())
            return
        last_clear = max(
            (i for i, event in enumerate(events) if isinstance(event, AllBlocksCleared)),
            default=-1,
        )
        if last_clear >= 0:
            # Whatever came before the last clear is gone with it.
            events = events[last_clear + 1 :]
            self._guard(self._new_epoch, "clear")
            self._held.clear()
            self.stats.clears += 1
        commands = self._compile(events)
        if commands:
            self._guard(lambda: self._send(commands), "apply")
        self.stats.batches_applied += 1

    def _compile(self, events: Iterable[KVEvent]) -> list[tuple]:
        """Turn events into commands, updating the reference counts (rebuilt by resync if lost)."""
        ns, held, field, epoch = self.ns, self._held, self._field, self.epoch
        reverse = ns.reverse_key(self.worker_id, epoch)
        commands: list[tuple] = []
        for event in events:
            if isinstance(event, BlockStored):
                group, added = event.group, []
                prefix = ns.block_prefix(group)
                for block_hash in event.block_hashes:
                    key = (group, digest_key(block_hash))
                    count = held.get(key, 0)
                    held[key] = count + 1
                    if count == 0:
                        commands.append(("HSET", prefix + key[1], field, epoch))
                        added.append(reverse_member(group, key[1]))
                if added:
                    commands.append(("SADD", reverse, *added))
                    self.stats.blocks_written += len(added)
            elif isinstance(event, BlockRemoved):
                group, gone = event.group, []
                prefix = ns.block_prefix(group)
                for block_hash in event.block_hashes:
                    key = (group, digest_key(block_hash))
                    count = held.get(key)
                    if count is None:
                        self.stats.unknown_removes += 1
                    elif count > 1:
                        held[key] = count - 1
                    else:
                        del held[key]
                        commands.append(("HDEL", prefix + key[1], field))
                        gone.append(reverse_member(group, key[1]))
                if gone:
                    commands.append(("SREM", reverse, *gone))
                    self.stats.blocks_removed += len(gone)
        return commands

    def _send(self, commands: list[tuple]) -> None:
        """Pipelines of at most `max_commands`, each ending with a read of the fence."""
        step = self.max_commands - 1
        for start in range(0, len(commands), step):
            pipe = self.client.pipeline(transaction=False)
            for command in commands[start : start + step]:
                pipe.execute_command(*command)
            pipe.hget(self.ns.live_key, self.worker_id)
            replies = pipe.execute()
            self.stats.round_trips += 1
            live = replies[-1]
            if live is None or int(live) != self.epoch:
                self._on_fenced()

    def _on_fenced(self) -> None:
        # Writes may have landed after the janitor swept this epoch: queue it for another sweep.
        self.fenced = True
        self.client.sadd(self.ns.fenced_key, fenced_member(self.worker_id, self.epoch))
        self.stats.round_trips += 1
        raise IndexFenced(f"worker {self.worker_id} epoch {self.epoch} is fenced")

    def _new_epoch(self) -> None:
        epoch = bump_epoch(self.client, self.ns, self.worker_id, self.epoch)
        self.stats.round_trips += 1
        if epoch < 0:
            self.fenced = True
            why = "superseded by a newer registration" if epoch == -1 else "marked dead"
            raise IndexFenced(f"worker {self.worker_id} epoch {self.epoch} is {why}")
        self.epoch = epoch

    def _guard(self, action: Callable[[], None], what: str) -> None:
        try:
            with unavailable_as_index_error(f"{what} for worker {self.worker_id}"):
                action()
        except IndexUnavailable:
            self.needs_resync = True
            self.stats.batches_dropped += 1
            raise

    # --- recovery ---------------------------------------------------------------------------

    def resync(self, all_cached: CachedEntries) -> int:
        """Rewrite this worker's whole state under a new epoch and return it.

        The new epoch fences every entry written before (including any that a dropped batch
        should have removed) at once; the janitor deletes them later. Entries are written in
        pipelines of at most `max_commands`.
        """
        if self.fenced:
            raise IndexFenced(f"worker {self.worker_id} epoch {self.epoch} is fenced")
        counts: dict[tuple[int, bytes], int] = {}
        for group, block_hash in all_cached:
            key = (group, digest_key(block_hash))
            counts[key] = counts.get(key, 0) + 1
        self.needs_resync = True  # until every batch below has landed
        try:
            with unavailable_as_index_error(f"resync for worker {self.worker_id}"):
                self._new_epoch()
                self._held = counts
                self._send(self._full_state_commands(counts))
        except IndexUnavailable:
            self.stats.batches_dropped += 1
            raise
        self.needs_resync = False
        self.stats.resyncs += 1
        self.stats.blocks_written += len(counts)
        return self.epoch

    def _full_state_commands(self, counts: dict[tuple[int, bytes], int]) -> list[tuple]:
        ns, field, epoch = self.ns, self._field, self.epoch
        reverse = ns.reverse_key(self.worker_id, epoch)
        commands: list[tuple] = []
        members: list[bytes] = []
        chunk = max(1, min(1024, self.max_commands // 2))
        for group, digest in counts:
            commands.append(("HSET", ns.block_key(group, digest), field, epoch))
            members.append(reverse_member(group, digest))
            if len(members) == chunk:
                commands.append(("SADD", reverse, *members))
                members = []
        if members:
            commands.append(("SADD", reverse, *members))
        return commands
