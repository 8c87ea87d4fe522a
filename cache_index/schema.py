"""Key schema of the prefix index: names, value encodings and their validation.

Every key lives under one namespace, ``<prefix>:{<model>|bs<block size>|<algo>.<fingerprint>}``.
The braces are a Redis Cluster hash tag, so a namespace sits in one slot and the Lua scripts may
touch several of its keys. Block hashes are stored as the first 16 raw bytes of the digest: keys
are binary-safe, 16 bytes keep 128 bits (an accidental collision needs ~2^64 blocks) and are half
the size of hex. See docs/cache_index.md for the full layout and redis-cli examples.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from specserve.shared.config import CacheConfig
from specserve.shared.hashing import DEFAULT_HASH_SEED, HASH_ALGORITHMS, BlockHash
from specserve.shared.protocol import check_worker_id

DIGEST_BYTES = 16
"""Leading digest bytes kept per block hash in keys and reverse-set members."""

MAX_GROUPS = 256
"""KV groups are one byte in reverse-set members."""

_MODEL = r"[A-Za-z0-9._/+-]{1,128}"
_PREFIX = r"[A-Za-z0-9._-]{1,32}"
_MODEL_RE = re.compile(_MODEL)
_PREFIX_RE = re.compile(_PREFIX)
_BASE_RE = re.compile(
    rf"(?P<prefix>{_PREFIX}):\{{(?P<model>{_MODEL})\|bs(?P<block_size>[1-9][0-9]*)"
    r"\|(?P<algo>[A-Za-z0-9_]+)\.(?P<fingerprint>[0-9a-f]{8})\}"
)
_EPOCHS_SUFFIX = b":epochs"


def hash_fingerprint(algo: str, seed: str) -> str:
    """8 hex digits that change with the hash algorithm or seed: mismatched hashers never meet."""
    return hashlib.sha256(f"{algo}\x00{seed}".encode()).hexdigest()[:8]


def key_model_name(model: str) -> str:
    """The model's name in index keys: itself when it fits the schema, else its last path
    component followed by a stable digest of the whole (checkpoint paths can be long or unusual)."""
    if _MODEL_RE.fullmatch(model):
        return model
    tail = re.sub(r"[^A-Za-z0-9._-]", "_", model.rstrip("/").rsplit("/", 1)[-1])[:48] or "model"
    return f"{tail}-{hashlib.sha256(model.encode()).hexdigest()[:12]}"


def digest_key(block_hash: BlockHash) -> bytes:
    """The 16 leading bytes of a block hash, as used in keys."""
    if len(block_hash) < DIGEST_BYTES:
        raise ValueError(f"block hash has {len(block_hash)} bytes; at least {DIGEST_BYTES} needed")
    return bytes(block_hash[:DIGEST_BYTES])


def check_group(group: int) -> int:
    if not 0 <= group < MAX_GROUPS:
        raise ValueError(f"KV group {group} out of range [0, {MAX_GROUPS})")
    return group


def reverse_member(group: int, block_hash: BlockHash) -> bytes:
    """Reverse-set member: one byte of KV group, then the 16 digest bytes."""
    return bytes((check_group(group),)) + digest_key(block_hash)


def split_reverse_member(member: bytes) -> tuple[int, bytes]:
    if len(member) != DIGEST_BYTES + 1:
        raise ValueError(f"malformed reverse-set member {member!r}")
    return member[0], member[1:]


def fenced_member(worker_id: str, epoch: int) -> bytes:
    return f"{worker_id}@{epoch}".encode()


def split_fenced_member(member: bytes | str) -> tuple[str, int]:
    text = member.decode() if isinstance(member, bytes) else member
    worker_id, _, epoch = text.rpartition("@")
    return worker_id, int(epoch)


class UnknownHasher(ValueError):
    """A well-formed namespace whose hash algorithm or seed is not the one given: its block keys
    cannot be recomputed from token ids here (a fingerprint cannot be inverted)."""


@dataclass(frozen=True)
class Namespace:
    """Which index a key belongs to: one per (model, block size, hash algorithm and seed).

    The tenant's cache salt and the adapter name are already inside the block hashes (see
    `specserve.shared.hashing.block_extra_keys`), so tenants share a namespace safely.
    """

    model: str
    block_size: int
    hash_algo: str = "sha256"
    hash_seed: str = DEFAULT_HASH_SEED
    prefix: str = "ssi"
    base: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _MODEL_RE.fullmatch(self.model):
            raise ValueError(
                f"model name {self.model!r} must be 1-128 characters from [A-Za-z0-9._/+-]"
            )
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.hash_algo not in HASH_ALGORITHMS:
            raise ValueError(f"hash_algo must be one of {HASH_ALGORITHMS}, got {self.hash_algo!r}")
        if not _PREFIX_RE.fullmatch(self.prefix):
            raise ValueError(f"key prefix {self.prefix!r} must be 1-32 characters [A-Za-z0-9._-]")
        fp = hash_fingerprint(self.hash_algo, self.hash_seed)
        tag = f"{self.model}|bs{self.block_size}|{self.hash_algo}.{fp}"
        object.__setattr__(self, "base", f"{self.prefix}:{{{tag}}}".encode())

    def __hash__(self) -> int:
        # `base` spells out every field that tells namespaces apart, and bytes cache their hash:
        # routing looks namespaces up in dicts for every request.
        return hash(self.base)

    @classmethod
    def for_cache(cls, model: str, cache: CacheConfig, prefix: str = "ssi") -> Namespace:
        """The namespace of a worker's cache config; hashes are taken at the finest block size."""
        return cls(model, cache.hash_block_size, cache.hash_algo, cache.hash_seed, prefix)

    @classmethod
    def for_model(cls, model: str, block_size: int, hash_algo: str = "sha256") -> Namespace:
        """The namespace a control plane serving `model` (its `--model`, maybe a path) uses."""
        return cls(key_model_name(model), block_size, hash_algo)

    @classmethod
    def parse(cls, base: bytes | str, hash_seed: str = DEFAULT_HASH_SEED) -> Namespace:
        """The namespace whose keys start with `base`, hashed with `hash_seed`.

        ValueError when `base` is not a namespace; `UnknownHasher` when it is one whose algorithm
        or seed differs, because then its keys cannot be recomputed here.
        """
        text = base.decode(errors="replace") if isinstance(base, bytes) else base
        m = _BASE_RE.fullmatch(text)
        if m is None:
            raise ValueError(f"{text!r} is not an index namespace")
        algo = m["algo"]
        if algo not in HASH_ALGORITHMS or m["fingerprint"] != hash_fingerprint(algo, hash_seed):
            raise UnknownHasher(f"{text!r} was hashed with another algorithm or seed")
        return cls(m["model"], int(m["block_size"]), algo, hash_seed, m["prefix"])

    @staticmethod
    def epochs_key_pattern(prefix: str = "ssi") -> bytes:
        """SCAN pattern matching every namespace's epochs key, which outlives the workers: how
        operator tools find namespaces (never used on a request path)."""
        return prefix.encode() + b":{*}" + _EPOCHS_SUFFIX

    @classmethod
    def from_epochs_key(cls, key: bytes, hash_seed: str = DEFAULT_HASH_SEED) -> Namespace:
        """The namespace of an epochs key (see `parse` for the errors)."""
        if not key.endswith(_EPOCHS_SUFFIX):
            raise ValueError(f"{key!r} is not an epochs key")
        return cls.parse(key.removesuffix(_EPOCHS_SUFFIX), hash_seed)

    # --- key names ------------------------------------------------------------------------

    @property
    def live_key(self) -> bytes:
        """HASH worker id -> live epoch: the fence every lookup reads."""
        return self.base + b":live"

    @property
    def epochs_key(self) -> bytes:
        """HASH worker id -> last issued epoch (HINCRBY, never decreases)."""
        return self.base + _EPOCHS_SUFFIX

    @property
    def fenced_key(self) -> bytes:
        """SET of `<worker>@<epoch>` whose entries await background deletion."""
        return self.base + b":fenced"

    def worker_key(self, worker_id: str) -> bytes:
        """HASH of one worker's registry record (epoch, state, timestamps, info)."""
        return self.base + b":worker:" + check_worker_id(worker_id).encode()

    def reverse_key(self, worker_id: str, epoch: int) -> bytes:
        """SET of reverse members (group byte + digest) written by one worker epoch."""
        return self.base + b":w:" + check_worker_id(worker_id).encode() + b":%d" % epoch

    def block_prefix(self, group: int) -> bytes:
        """Block keys of one KV group are this prefix followed by the 16 digest bytes."""
        return self.base + b":b%d:" % check_group(group)

    def block_key(self, group: int, block_hash: BlockHash) -> bytes:
        """HASH worker id -> epoch of the workers holding one block of one KV group."""
        return self.block_prefix(group) + digest_key(block_hash)

    def block_key_from_member(self, member: bytes) -> bytes:
        group, digest = split_reverse_member(member)
        return self.base + b":b%d:" % group + digest
