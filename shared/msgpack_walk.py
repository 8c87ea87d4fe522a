"""A bounded look at a raw MessagePack frame before anything decodes it.

msgspec decodes nested containers by recursion, so a ~1 KB frame of nested arrays exhausts the
interpreter's recursion limit (a `RecursionError`, which is not a decode error); and a header
may claim 2^32 elements in a 6-byte frame. `check_frame` walks the frame's structure with an
explicit stack (no recursion, no allocation per element) and refuses it when it nests deeper
than `max_depth`, holds more than `max_items` objects, claims more elements or bytes than the
frame has, or is not exactly one well-formed object. Scalars and strings are skipped by length,
never decoded.
"""

from __future__ import annotations

import re

__all__ = ["FrameLimitError", "FrameShapeError", "check_frame", "leading_fields"]


class FrameShapeError(ValueError):
    """The frame is not one well-formed MessagePack object within the limits."""


class FrameLimitError(FrameShapeError):
    """The frame may be well formed, but nests deeper or holds more objects than allowed."""


def _fixed_sizes() -> tuple[int, ...]:
    """Total byte size of each scalar whose size its first byte alone fixes (0: not such)."""
    size = [0] * 256
    for b in range(0x00, 0x80):  # positive fixint
        size[b] = 1
    for b in range(0xE0, 0x100):  # negative fixint
        size[b] = 1
    for b in range(0xA0, 0xC0):  # fixstr: the length is in the first byte
        size[b] = 1 + (b & 0x1F)
    fixed = {
        0xC0: 1, 0xC2: 1, 0xC3: 1,  # nil, false, true
        0xCA: 5, 0xCB: 9,  # float32, float64
        0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9,  # uint8..uint64
        0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9,  # int8..int64
        0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18,  # fixext 1..16
    }  # fmt: skip
    for b, n in fixed.items():
        size[b] = n
    return tuple(size)


_FIXED = _fixed_sizes()
# Variable-length scalars: first byte -> (bytes of the length field, bytes before the payload).
_SIZED = {
    0xC4: (1, 2), 0xC5: (2, 3), 0xC6: (4, 5),  # bin 8/16/32
    0xD9: (1, 2), 0xDA: (2, 3), 0xDB: (4, 5),  # str 8/16/32
    0xC7: (1, 3), 0xC8: (2, 4), 0xC9: (4, 6),  # ext 8/16/32 (length, then a type byte)
}  # fmt: skip
# Containers with a length field: first byte -> (bytes of the count field, children per count).
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}

# Long arrays of numbers (token ids, logprobs) are skipped `_RUN` at a time by one regex match,
# ~4x faster than a Python step per element. A failed match is not retried until the walk has
# gone past every byte it could have read (`_RUN` of the largest scalar), so an array built to
# make it fail costs at most twice the plain walk.
_RUN = 256
_NUMBER = (
    rb"(?:[\x00-\x7f\xc0\xc2\xc3\xe0-\xff]"  # fixints, nil, booleans
    rb"|[\xcc\xd0].|[\xcd\xd1]..|[\xca\xce\xd2].{4}|[\xcb\xcf\xd3].{8})"  # ints, floats
)
_NUMBERS = re.compile(_NUMBER + b"{%d}" % _RUN, re.DOTALL)
_RUN_MAX_BYTES = _RUN * 9


def check_frame(data: bytes, max_depth: int, max_items: int | None = None) -> int:
    """Return the number of objects in `data`; raise FrameShapeError naming the first problem.

    `max_depth` counts containers: a bare scalar is depth 0, `[1]` depth 1. `max_items` (None:
    no limit beyond the frame's size) counts every object, containers included.
    """
    end = len(data)
    pos = 0
    items = 0
    limit = max_items if max_items is not None else end
    stack: list[int] = []  # the children still to read of each enclosing container
    remaining = 1  # the frame is exactly one object
    retry_at = 0  # the next offset where a run of numbers is worth trying
    numbers = _NUMBERS.match
    while True:
        if not remaining:
            if not stack:
                break
            remaining = stack.pop()
            continue
        if remaining >= _RUN and pos >= retry_at:
            run = numbers(data, pos)
            if run is not None:
                pos = run.end()
                remaining -= _RUN
                items += _RUN
                if items > limit:
                    raise FrameLimitError(f"more than {limit} objects in one frame")
                continue
            retry_at = pos + _RUN_MAX_BYTES
        if pos >= end:
            raise FrameShapeError(f"truncated at byte {end}: {remaining} more object(s) expected")
        b = data[pos]
        remaining -= 1
        items += 1
        if items > limit:
            raise FrameLimitError(f"more than {limit} objects in one frame")
        size = _FIXED[b]
        if size:
            pos += size
            continue
        start = pos
        if 0x80 <= b <= 0x9F:  # fixmap, fixarray
            count = (b & 0x0F) * (2 if b < 0x90 else 1)
            pos += 1
        elif b in _CONTAINERS:
            width, per = _CONTAINERS[b]
            count = int.from_bytes(data[pos + 1 : pos + 1 + width], "big") * per
            pos += 1 + width
        elif b in _SIZED:
            width, header = _SIZED[b]
            length = int.from_bytes(data[pos + 1 : pos + 1 + width], "big")
            pos += header + length
            continue
        else:  # 0xC1 is never used
            raise FrameShapeError(f"byte 0x{b:02x} at offset {pos} starts no MessagePack object")
        if count > end - pos:  # every element takes at least one byte
            raise FrameShapeError(
                f"a container at offset {start} claims {count} elements; the frame has "
                f"{max(end - pos, 0)} bytes left"
            )
        if len(stack) >= max_depth:  # this container is one level deeper than its parent
            raise FrameLimitError(f"nested deeper than {max_depth} levels")
        if count:
            stack.append(remaining)
            remaining = count
    if pos != end:
        what = "truncated" if pos > end else f"{end - pos} trailing bytes"
        raise FrameShapeError(f"{what} after one object ({end} bytes)")
    return items


def leading_fields(data: bytes, max_fields: int = 4, max_len: int = 256) -> dict[str, str | int]:
    """The leading entries of a frame's top-level map whose keys are strings and whose values
    are strings (at most `max_len` bytes) or integers, up to the first entry that is not.

    Enough to name a refused frame's type and request id (msgspec writes a struct's fields in
    order: `type`, `version`, `request_id`) without decoding anything else; reads at most
    `max_fields` entries and never raises.
    """
    fields: dict[str, str | int] = {}
    if not data or not (0x81 <= data[0] <= 0x8F or data[0] in (0xDE, 0xDF)):
        return fields
    width = 0 if data[0] <= 0x8F else 2 if data[0] == 0xDE else 4
    count = int.from_bytes(data[1 : 1 + width], "big") if width else data[0] & 0x0F
    pos = 1 + width
    for _ in range(min(count, max_fields)):
        key, pos = _short_scalar(data, pos, max_len)
        value, pos = _short_scalar(data, pos, max_len)
        if not isinstance(key, str) or value is None:
            break
        fields[key] = value
    return fields


def _short_scalar(data: bytes, pos: int, max_len: int) -> tuple[str | int | None, int]:
    """The string or integer at `pos` and the offset after it; (None, pos) for anything else."""
    if pos >= len(data):
        return None, pos
    b = data[pos]
    if b <= 0x7F:
        return b, pos + 1
    if b >= 0xE0:
        return b - 0x100, pos + 1
    if 0xCC <= b <= 0xD3:  # uint8..uint64, int8..int64
        width = 1 << (b - 0xCC) % 4
        raw = data[pos + 1 : pos + 1 + width]
        if len(raw) < width:
            return None, pos
        return int.from_bytes(raw, "big", signed=b >= 0xD0), pos + 1 + width
    if 0xA0 <= b <= 0xBF:
        start, length = pos + 1, b & 0x1F
    elif b == 0xD9 and pos + 1 < len(data):
        start, length = pos + 2, data[pos + 1]
    else:
        return None, pos
    raw = data[start : start + length]
    if length > max_len or len(raw) < length:
        return None, pos
    try:
        return raw.decode(), start + length
    except UnicodeDecodeError:
        return None, pos
