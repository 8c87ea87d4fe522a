"""Chained block hashes for prefix caching.

A block's hash covers its parent's hash, the token ids of one *full* block and optional extra keys
(the tenant's cache salt on block 0, the adapter name on every block). Because each hash chains
over the whole prefix, equal hashes mean equal prefixes. Every control-plane replica must derive
the same keys for the shared Redis index, so the chain root comes from a fixed, configurable seed,
never from a per-process random value.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

BlockHash = bytes
"""The raw digest bytes of one block's chained hash."""

DEFAULT_HASH_SEED = "specserve/prefix-cache/v1"
HASH_ALGORITHMS = ("sha256", "xxh3_128")

_encode = msgspec.msgpack.Encoder().encode
RECENT_SEQUENCES = 8  # sequences a hasher keeps to reuse the hashes of a shared prefix


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _digest_fn(algo: str) -> Callable[[bytes], bytes]:
    if algo == "sha256":
        return _sha256
    if algo == "xxh3_128":
        try:
            import xxhash
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ValueError(
                "hash algorithm 'xxh3_128' needs the xxhash package: "
                "pip install 'specserve[fast-hash]'"
            ) from exc
        return xxhash.xxh3_128_digest
    raise ValueError(f"unknown block hash algorithm {algo!r}; choose one of {HASH_ALGORITHMS}")


@dataclass(frozen=True)
class BlockHasher:
    """Hashes full blocks with a canonical MessagePack encoding of (parent, tokens, extra keys).

    `sha256` is the default (collision-resistant, safe when tenants share a cache); `xxh3_128` is
    a faster non-cryptographic option for single-tenant deployments.
    """

    algo: str = "sha256"
    seed: str = DEFAULT_HASH_SEED
    _digest: Callable[[bytes], bytes] = field(init=False, repr=False, compare=False)
    # The last few sequences hashed from their start, with their hashes: a prefix shared with
    # one of them (a system prompt, an earlier turn, a burst of one template) is not hashed again.
    _recent: deque[_Hashed] = field(init=False, repr=False, compare=False)
    root: BlockHash = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        digest = _digest_fn(self.algo)
        object.__setattr__(self, "_digest", digest)
        object.__setattr__(self, "_recent", deque(maxlen=RECENT_SEQUENCES))
        object.__setattr__(self, "root", digest(_encode(["specserve-root", self.seed])))

    def hash_block(
        self,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: tuple | None = None,
    ) -> BlockHash:
        """Hash one full block; `parent` None means the block starts the sequence."""
        payload = _encode((parent if parent is not None else self.root, token_ids, extra_keys))
        return self._digest(payload)


def block_extra_keys(block_index: int, cache_salt: str | None, adapter: str | None) -> tuple | None:
    """Extra keys of one block: the adapter name on every block, the salt on block 0 only.

    The salt need only enter block 0: the chain carries it into every later hash.
    """
    keys: list[str] = []
    if adapter:
        keys.append(adapter)
    if cache_salt and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def extend_block_hashes(
    hasher: BlockHasher,
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    adapter: str | None = None,
) -> None:
    """Append the hashes of blocks of `token_ids` completed since the last call.

    Partial blocks are never hashed, and callers pass only verified tokens (never drafts), so a
    hash always names KV that the target model has computed or will compute for those tokens.
    """
    start_block = len(block_hashes)
    num_full = len(token_ids) // block_size
    if start_block >= num_full:
        return
    keys = (block_size, cache_salt, adapter)
    from_start = start_block == 0
    if from_start:
        block_hashes.extend(_reusable(hasher._recent, token_ids, num_full, keys))
        start_block = len(block_hashes)
    parent = block_hashes[-1] if block_hashes else hasher.root
    has_extra_keys = bool(cache_salt or adapter)
    digest = hasher._digest  # `hash_block`, inlined: this runs for every admitted block
    for i in range(start_block, num_full):
        begin = i * block_size
        extra = block_extra_keys(i, cache_salt, adapter) if has_extra_keys else None
        parent = digest(_encode((parent, token_ids[begin : begin + block_size], extra)))
        block_hashes.append(parent)
    if from_start:
        hashed = list(token_ids[: num_full * block_size])
        hasher._recent.appendleft(_Hashed(keys, hashed, list(block_hashes)))


def coarsen_block_hashes(
    block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int
) -> Sequence[BlockHash]:
    """View fine-grained hashes at a coarser block size that is a multiple of the fine one.

    Coarse block i ends where fine block (i+1)*scale-1 ends, and a chained hash already covers the
    whole prefix, so that fine hash identifies the coarse block.
    """
    if block_size == hash_block_size:
        return block_hashes
    if block_size % hash_block_size:
        raise ValueError(
            f"block size {block_size} is not a multiple of the hash block size {hash_block_size}"
        )
    scale = block_size // hash_block_size
    return list(block_hashes[scale - 1 :: scale])


class _Hashed(NamedTuple):
    keys: tuple  # (block size, cache salt, adapter): hashes are reusable only under the same
    token_ids: list[int]  # whole blocks only
    hashes: list[BlockHash]


def _reusable(
    recent: Iterable[_Hashed], token_ids: Sequence[int], num_full: int, keys: tuple
) -> list[BlockHash]:
    """The hashes of the leading blocks `token_ids` shares with the most recent sequence that
    starts with the same block (hashes chain, so a shared block prefix has the same hashes)."""
    block_size = keys[0]
    for seen in recent:
        if seen.keys != keys or seen.token_ids[:block_size] != token_ids[:block_size]:
            continue
        n = _common_blocks(seen.token_ids, token_ids, min(num_full, len(seen.hashes)), block_size)
        return seen.hashes[:n]
    return []


def _common_blocks(a: Sequence[int], b: Sequence[int], limit: int, block_size: int) -> int:
    """How many leading blocks (at most `limit`) `a` and `b` share, given that the first is
    shared: ranges of doubling length compared in C, then bisection inside the one that
    differs (a dozen comparisons where block by block would take one per block)."""
    n, step = 1, 1
    while n < limit:
        end = min(n + step, limit)
        if a[n * block_size : end * block_size] != b[n * block_size : end * block_size]:
            lo, hi = n, end  # blocks before lo are shared; one in [lo, hi) is not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if a[lo * block_size : mid * block_size] == b[lo * block_size : mid * block_size]:
                    lo = mid
                else:
                    hi = mid
            return lo
        n, step = end, step * 2
    return n
