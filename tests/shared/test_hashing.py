import hashlib
import random

import msgspec
import pytest

from specserve.shared.hashing import (
    BlockHasher,
    block_extra_keys,
    coarsen_block_hashes,
    extend_block_hashes,
)


def test_block_hash_is_sha256_of_canonical_msgpack_triple():
    hasher = BlockHasher()
    expected_root = hashlib.sha256(
        msgspec.msgpack.encode(["specserve-root", "specserve/prefix-cache/v1"])
    ).digest()
    assert hasher.root == expected_root
    expected = hashlib.sha256(msgspec.msgpack.encode([expected_root, [0, 1, 2], None])).digest()
    assert hasher.hash_block(None, [0, 1, 2]) == expected
    child = hasher.hash_block(expected, [3, 4, 5], ("lora-a",))
    assert (
        child == hashlib.sha256(msgspec.msgpack.encode([expected, [3, 4, 5], ["lora-a"]])).digest()
    )


def test_same_seed_same_keys_in_every_replica_and_seed_changes_them():
    a, b = BlockHasher(seed="s1"), BlockHasher(seed="s1")
    assert a.hash_block(None, [1, 2]) == b.hash_block(None, [1, 2])
    assert BlockHasher(seed="s2").hash_block(None, [1, 2]) != a.hash_block(None, [1, 2])


def test_extra_keys_salt_only_on_block_zero_and_adapter_everywhere():
    assert block_extra_keys(0, None, None) is None
    assert block_extra_keys(0, "tenant", None) == ("tenant",)
    assert block_extra_keys(1, "tenant", None) is None
    assert block_extra_keys(3, "tenant", "lora") == ("lora",)
    assert block_extra_keys(0, "tenant", "lora") == ("lora", "tenant")


def test_only_full_blocks_are_hashed_and_chain_extends_incrementally():
    hasher = BlockHasher()
    tokens = list(range(55))
    hashes: list[bytes] = []
    extend_block_hashes(hasher, hashes, tokens, 16)
    assert len(hashes) == 3  # 55 tokens: three full blocks, the partial tail is not hashed
    assert hashes[0] == hasher.hash_block(None, tokens[:16])
    assert hashes[1] == hasher.hash_block(hashes[0], tokens[16:32])
    tokens += [7] * 9  # the fourth block fills up
    extend_block_hashes(hasher, hashes, tokens, 16)
    assert len(hashes) == 4
    assert hashes[3] == hasher.hash_block(hashes[2], tokens[48:64])


def test_salt_changes_every_block_through_the_chain():
    hasher = BlockHasher()
    tokens = list(range(48))
    plain: list[bytes] = []
    salted: list[bytes] = []
    extend_block_hashes(hasher, plain, tokens, 16)
    extend_block_hashes(hasher, salted, tokens, 16, cache_salt="tenant-a")
    assert all(p != s for p, s in zip(plain, salted, strict=True))


def test_xxh3_option_differs_and_is_128_bits():
    fast = BlockHasher(algo="xxh3_128")
    assert len(fast.hash_block(None, [1, 2, 3])) == 16
    assert fast.hash_block(None, [1, 2, 3]) != BlockHasher().hash_block(None, [1, 2, 3])
    assert fast.hash_block(None, [1, 2, 3]) == BlockHasher(algo="xxh3_128").hash_block(
        None, [1, 2, 3]
    )


def test_unknown_algorithm_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown block hash algorithm 'md5'"):
        BlockHasher(algo="md5")


def test_coarse_view_takes_the_hash_that_ends_each_coarse_block():
    fine = [b"A", b"B", b"C", b"D", b"E"]
    assert coarsen_block_hashes(fine, 16, 32) == [b"B", b"D"]
    assert coarsen_block_hashes(fine, 16, 16) is fine
    with pytest.raises(ValueError, match="not a multiple"):
        coarsen_block_hashes(fine, 16, 24)


def _chain(hasher: BlockHasher, tokens: list[int], salt: str | None = None) -> list:
    """The reference: every block hashed from its parent, nothing reused."""
    out, parent = [], None
    for i in range(len(tokens) // 4):
        extra = ("t1",) if salt and i == 0 else None
        parent = hasher.hash_block(parent, tokens[4 * i : 4 * i + 4], extra)
        out.append(parent)
    return out


def test_a_prefix_shared_with_a_recent_sequence_reuses_its_hashes_exactly():
    """Sequences that share leading blocks with one hashed lately take those hashes over; every
    hash still equals the block-by-block chain, whatever is shared: all, part, a salt, nothing."""
    hasher = BlockHasher()
    head = list(range(1, 13))  # 3 blocks of 4
    cases = [
        ([*head, 7, 7, 7, 7, 8], None),  # first: nothing to reuse
        ([*head, 9, 9, 9, 9], None),  # 3 blocks reused
        ([*head[:6], 5, 5, 5, 5, 5, 5], None),  # 1 block reused, the 2nd differs half way
        ([*head, 7, 7, 7, 7], "t1"),  # same tokens, another salt: nothing reused
        ([*head, 7, 7, 7, 7], None),  # back to the first sequence
        ([99] * 8, None),
        (head[:3], None),  # not one full block
    ]
    for tokens, salt in cases:
        out: list = []
        extend_block_hashes(hasher, out, tokens, 4, cache_salt=salt)
        assert out == _chain(BlockHasher(), tokens, salt), (tokens, salt)
    reused = hasher._recent[0]
    assert reused.token_ids == [99] * 8 and len(reused.hashes) == 2


def test_reused_hashes_match_the_chain_for_any_shared_length():
    """Random pairs sharing 0-40 leading blocks (and sometimes part of the next): the reused
    hashes always equal the block-by-block chain."""
    rng = random.Random(0)
    hasher, reference = BlockHasher(), BlockHasher()
    for _ in range(200):
        base = [rng.randrange(50) for _ in range(4 * rng.randint(1, 40) + rng.randint(0, 3))]
        shared = rng.randint(0, len(base))
        tail = [rng.randrange(50, 99) for _ in range(rng.randint(0, 30))]
        for tokens in (base, base[:shared] + tail):
            out: list = []
            extend_block_hashes(hasher, out, tokens, 4)
            assert out == _chain(reference, tokens)
