"""Events a block pool emits when its prefix cache changes; the global Redis index consumes them.

Stored events are emitted at scheduling time (when blocks are hashed, before their KV exists), so
the index never lags the scheduler. Freeing a request emits nothing: its blocks stay cached until
they are reused for other data, which emits `BlockRemoved`.
"""

from __future__ import annotations

import msgspec

from specserve.shared.hashing import BlockHash


class BlockStored(msgspec.Struct, frozen=True, tag="stored"):
    """Blocks of one request newly cached in KV group `group`."""

    block_hashes: list[BlockHash]
    block_ids: list[int]
    parent_hash: BlockHash | None
    group: int


class BlockRemoved(msgspec.Struct, frozen=True, tag="removed"):
    """Cached blocks evicted (reused for new data) in KV group `group`."""

    block_hashes: list[BlockHash]
    group: int


class AllBlocksCleared(msgspec.Struct, frozen=True, tag="cleared"):
    """The whole prefix cache of this pool was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
