"""`check_frame`: exact object counts on real encodings, and every kind of malformed or
oversized frame refused with its reason, without recursion."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.shared.msgpack_walk import FrameShapeError, check_frame, leading_fields

enc = msgspec.msgpack.encode


def reference(value: object) -> tuple[int, int]:
    """(objects, depth) of a decoded value, map keys counted as objects."""
    if isinstance(value, dict):
        inner = [reference(k) for k in value] + [reference(v) for v in value.values()]
    elif isinstance(value, list):
        inner = [reference(v) for v in value]
    else:
        return 1, 0
    return 1 + sum(n for n, _ in inner), 1 + max((d for _, d in inner), default=0)


scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=300)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=60,
)


@settings(max_examples=300, deadline=None)
@given(values)
def test_counts_and_depth_match_the_decoded_value(value) -> None:
    data = enc(value)
    items, depth = reference(msgspec.msgpack.decode(data))
    assert check_frame(data, max_depth=depth) == items
    if depth:
        with pytest.raises(FrameShapeError, match=f"nested deeper than {depth - 1} levels"):
            check_frame(data, max_depth=depth - 1)
    with pytest.raises(FrameShapeError, match=f"more than {items - 1} objects"):
        check_frame(data, max_depth=depth, max_items=items - 1)


@pytest.mark.parametrize("size", [255, 256, 257, 1000, 70_000])
@pytest.mark.parametrize(
    "element",
    [0, 127, -1, -32, 200, 40_000, 2**31, 2**63, 2**64 - 1, -129, -(2**40), 0.5, 1e300, None, True],
)
def test_long_number_arrays_are_counted_exactly(size: int, element: object) -> None:
    data = enc({"ids": [element] * size, "tail": [[1, 2], "x"]})
    total = 1 + 2 + (1 + size) + (1 + 3 + 1)  # map, keys, ids, tail
    assert check_frame(data, max_depth=3) == total
    with pytest.raises(FrameShapeError, match=f"^more than {total - 1} objects in one frame$"):
        check_frame(data, max_depth=3, max_items=total - 1)


def test_a_container_inside_a_run_of_numbers_is_still_walked() -> None:
    value = [*range(600), [[["deep"]]], *range(300)]
    data = enc(value)
    assert check_frame(data, max_depth=4) == 1 + 900 + 4
    with pytest.raises(FrameShapeError, match="nested deeper than 3 levels"):
        check_frame(data, max_depth=3)


def test_a_thousand_nested_arrays_in_a_kilobyte_are_refused_without_recursion() -> None:
    data = b"\x91" * 100_000 + b"\xc0"
    with pytest.raises(FrameShapeError, match=r"^nested deeper than 32 levels$"):
        check_frame(data, max_depth=32)
    assert check_frame(b"\x91" * 32 + b"\xc0", max_depth=32) == 33
    with pytest.raises(FrameShapeError, match=r"^nested deeper than 32 levels$"):
        check_frame(b"\x91" * 32 + b"\x90", max_depth=32)  # an empty array is a level too


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\xdd\xff\xff\xff\xff", "a container at offset 0 claims 4294967295 elements; "
         "the frame has 0 bytes left"),
        (b"\xdf\x80\x00\x00\x00\x01", "a container at offset 0 claims 4294967296 elements; "
         "the frame has 1 bytes left"),
        (b"\x92\x01", "a container at offset 0 claims 2 elements; the frame has 1 bytes left"),
        (b"\x92\xcd\x01\x02", "truncated at byte 4: 1 more object(s) expected"),
        (b"\xdb\xff\xff\xff\xffab", "truncated after one object (7 bytes)"),
        (b"\xcd\x01", "truncated after one object (2 bytes)"),
        (b"\x01\x02", "1 trailing bytes after one object (2 bytes)"),
        (b"\xc1", "byte 0xc1 at offset 0 starts no MessagePack object"),
        (b"\x91\xc1", "byte 0xc1 at offset 1 starts no MessagePack object"),
        (b"", "truncated at byte 0: 1 more object(s) expected"),
    ],
)  # fmt: skip
def test_malformed_frames_name_their_fault(data: bytes, reason: str) -> None:
    with pytest.raises(FrameShapeError) as err:
        check_frame(data, max_depth=32)
    assert str(err.value) == reason


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_either_pass_or_fail_cleanly(data: bytes) -> None:
    try:
        check_frame(data, max_depth=8)
    except FrameShapeError:
        return
    # Accepted: msgspec reads it (or refuses it) without recursing past the limit.
    with contextlib.suppress(msgspec.DecodeError, TypeError, ValueError):
        msgspec.msgpack.decode(data)


@pytest.mark.parametrize(
    ("value", "fields"),
    [
        ({"type": "generate", "version": 1, "request_id": "r", "x": [1]},
         {"type": "generate", "version": 1, "request_id": "r"}),
        ({"a": -(2**63), "b": 2**64 - 1, "c": -5, "d": "é" * 100},
         {"a": -(2**63), "b": 2**64 - 1, "c": -5, "d": "é" * 100}),
        ({"a": 1, "b": "x" * 257, "c": 2}, {"a": 1}),  # a long string ends the scan
        ({"a": 1, "b": None, "c": 2}, {"a": 1}),
        ({"a": 1, 2: "b"}, {"a": 1}),
        ([1, 2], {}),
        ({}, {}),
        ({str(i): i for i in range(20)}, {"0": 0, "1": 1, "2": 2, "3": 3}),
    ],
)  # fmt: skip
def test_leading_fields_reads_only_leading_short_scalars(value, fields) -> None:
    assert leading_fields(enc(value)) == fields


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_leading_fields_never_raises(data: bytes) -> None:
    assert isinstance(leading_fields(b"\x83" + data), dict)
