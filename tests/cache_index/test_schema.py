"""Pins the documented key schema (docs/cache_index.md) with raw Redis commands."""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from index_testing import drop_namespace

from specserve.cache_index import (
    IndexWriter,
    Namespace,
    UnknownHasher,
    mark_dead,
    register_worker,
)
from specserve.cache_index.schema import hash_fingerprint, key_model_name
from specserve.shared.config import CacheConfig, KVGroupSpec
from specserve.shared.hashing import BlockHasher
from specserve.shared.kv_events import BlockStored


def digest(i: int) -> bytes:
    return hashlib.sha256(b"block-%d" % i).digest()


def test_namespace_prefix_is_model_block_size_and_hasher_fingerprint():
    ns = Namespace("SmolLM2-135M", 16)
    # The fingerprint of the default hasher is pinned: changing it orphans every deployed index.
    assert hash_fingerprint("sha256", "specserve/prefix-cache/v1") == "2e39edff"
    assert ns.base == b"ssi:{SmolLM2-135M|bs16|sha256.2e39edff}"
    assert Namespace("SmolLM2-135M", 16, hash_seed="other").base != ns.base
    assert Namespace("SmolLM2-135M", 32).base != ns.base
    assert Namespace("SmolLM2-135M", 16, "xxh3_128").base.startswith(
        b"ssi:{SmolLM2-135M|bs16|xxh3_128."
    )
    cache = CacheConfig(64, (KVGroupSpec("full", 32), KVGroupSpec("sliding", 16, 64)))
    assert Namespace.for_cache("m", cache).block_size == 16  # hashes at the finest block size


@pytest.mark.parametrize(
    "ns",
    [
        Namespace("SmolLM2-135M", 16),
        Namespace("org/model+v1.2_x", 64, "xxh3_128"),
        Namespace("m", 1, prefix="staging.ssi"),
    ],
)
def test_a_namespace_parses_back_from_its_keys(ns):
    assert Namespace.parse(ns.base) == ns
    assert Namespace.from_epochs_key(ns.epochs_key) == ns
    seeded = Namespace(ns.model, ns.block_size, ns.hash_algo, "custom seed", ns.prefix)
    assert Namespace.parse(seeded.base, hash_seed="custom seed") == seeded


@pytest.mark.parametrize(
    "base",
    [
        b"ssi:{m|bs16|sha256.2e39edff}:live",
        b"ssi:{m|bs016|sha256.2e39edff}",
        b"ssi:{m|bs0|sha256.2e39edff}",
        b"ssi:{a b|bs16|sha256.2e39edff}",
        b"ssi:m|bs16|sha256.2e39edff",
        b"\xff:{m|bs16|sha256.2e39edff}",
    ],
)
def test_parse_rejects_what_is_not_a_namespace(base):
    with pytest.raises(ValueError, match="not an index namespace") as caught:
        Namespace.parse(base)
    assert not isinstance(caught.value, UnknownHasher)


def test_parse_refuses_a_namespace_it_cannot_rehash():
    other_seed = Namespace("m", 16, hash_seed="other")
    for base in (other_seed.base, b"ssi:{m|bs16|md5.2e39edff}"):
        with pytest.raises(UnknownHasher):
            Namespace.parse(base)
    with pytest.raises(ValueError, match="not an epochs key"):
        Namespace.from_epochs_key(Namespace("m", 16).live_key)
    assert Namespace.epochs_key_pattern() == b"ssi:{*}:epochs"


def test_a_served_model_is_named_as_the_keys_allow():
    assert Namespace.for_model("/ckpt/My Model", 16).model == key_model_name("/ckpt/My Model")
    assert Namespace.for_model("smollm2-135m", 32, "xxh3_128") == Namespace(
        "smollm2-135m", 32, "xxh3_128"
    )


@pytest.mark.parametrize("model", ["", "a b", "x{y}", "a:b", "x" * 129])
def test_bad_model_names_are_rejected(model):
    with pytest.raises(ValueError, match="model name"):
        Namespace(model, 16)


@pytest.mark.parametrize("worker_id", ["", "a:b", "w@1", "ü", "x" * 65])
def test_bad_worker_ids_are_rejected(worker_id):
    with pytest.raises(ValueError, match="worker id"):
        Namespace("m", 16).worker_key(worker_id)


def test_short_hashes_are_rejected():
    with pytest.raises(ValueError, match="16 needed"):
        Namespace("m", 16).block_key(0, b"\x01" * 8)


def test_exact_keys_and_encodings(client, ns):
    base = ns.base
    h0, h1, h2 = digest(0), digest(1), digest(2)
    epoch = register_worker(client, ns, "w1", {"addr": "tcp://10.0.0.5:5555"})
    assert epoch == 1
    writer = IndexWriter(client, ns, "w1", epoch)
    writer.apply([BlockStored([h0, h1], [3, 4], None, 0), BlockStored([h2], [9], None, 1)])

    b0 = base + b":b0:" + h0[:16]
    b1 = base + b":b0:" + h1[:16]
    b2 = base + b":b1:" + h2[:16]
    reverse = base + b":w:w1:1"
    worker = base + b":worker:w1"
    assert set(client.scan_iter(match=base + b"*")) == {
        base + b":epochs",
        base + b":live",
        worker,
        reverse,
        b0,
        b1,
        b2,
    }
    assert client.type(b0) == b"hash"
    assert client.hgetall(b0) == {b"w1": b"1"}
    assert client.hgetall(b1) == {b"w1": b"1"}
    assert client.hgetall(b2) == {b"w1": b"1"}
    assert client.smembers(reverse) == {b"\x00" + h0[:16], b"\x00" + h1[:16], b"\x01" + h2[:16]}
    assert client.hgetall(base + b":live") == {b"w1": b"1"}
    assert client.hgetall(base + b":epochs") == {b"w1": b"1"}
    record = client.hgetall(worker)
    assert record[b"epoch"] == b"1" and record[b"state"] == b"live"
    assert int(record[b"heartbeat_ms"]) == int(record[b"registered_ms"]) > 1.6e12
    assert msgspec.json.decode(record[b"info"]) == {"addr": "tcp://10.0.0.5:5555"}

    # Fencing only touches the registry; the janitor deletes the entries later.
    assert mark_dead(client, ns, "w1") == 1
    assert client.hgetall(base + b":live") == {}
    assert client.smembers(base + b":fenced") == {b"w1@1"}
    assert client.hget(worker, b"state") == b"dead"
    assert client.hgetall(b0) == {b"w1": b"1"}

    # Re-registration bumps the epoch counter; the new epoch gets its own reverse set.
    assert register_worker(client, ns, "w1", {}) == 2
    assert client.hgetall(base + b":epochs") == {b"w1": b"2"}
    assert client.hgetall(base + b":live") == {b"w1": b"2"}


def test_block_keys_match_the_scheduler_hashes(client):
    """The key of a prompt's block is derived from the same chained hash the scheduler uses."""
    ns = Namespace("m", 4)
    hasher = BlockHasher()
    first = hasher.hash_block(None, [1, 2, 3, 4])
    assert ns.block_key(0, first) == ns.base + b":b0:" + first[:16]
    drop_namespace(client, ns)
