"""The target's hidden states at the layers drafters read, recorded while it regenerates.

While the engine answers a wave of prompts, `FeatureRecorder` collects every computed row of
the layers a drafter reads (concatenated, as drafters consume them) and the final normed hidden
state (the target's distribution at that position is `lm_head(final)`). The last token of a
sample is never run through the target, so a sample of n tokens has n-1 recorded rows; its
feature rows are stored n long with a zero last row, so token i and row i line up.

A wave's samples go to one shard, a safetensors file read back lazily row range by row range:
`tokens` int32 `[N]`, `aux` `[N, len(layers) * hidden]` and `final` `[N, hidden]` in float16
(bfloat16 for a shard whose values leave float16's range).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_FLOAT16_MAX = 65000.0


class FeatureRecorder:
    """`HiddenStateRecorder` for the model runner: rows by request id and position."""

    def __init__(self, layers: Sequence[int]) -> None:
        self.layers = tuple(layers)
        self._rows: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}

    def record(self, request_id: str, start: int, aux: torch.Tensor, final: torch.Tensor) -> None:
        """Keep rows `start ..` of a request: float32 tensors the caller no longer writes
        (views of one step's copy), on any device."""
        self._rows.setdefault(request_id, []).append((start, aux, final))

    def take(self, request_id: str, num_rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows 0..num_rows-1 of a request on the host (later writes of a position win, e.g.
        after a preemption); None when any is missing. Rows from a GPU come in the 16-bit
        type the shard will store them in."""
        chunks = self._rows.pop(request_id, [])
        if not chunks:
            return None
        if _tiles(chunks) and chunks[-1][0] + chunks[-1][1].shape[0] >= num_rows:
            # the usual case, one chunk per step in order: one copy off the device
            aux = torch.cat([a for _, a, _ in chunks])[:num_rows]
            final = torch.cat([f for _, _, f in chunks])[:num_rows]
            return _to_host(aux), _to_host(final)
        chunks = [(start, a.cpu(), f.cpu()) for start, a, f in chunks]
        aux = torch.zeros(num_rows, chunks[0][1].shape[1])
        final = torch.zeros(num_rows, chunks[0][2].shape[1])
        seen = torch.zeros(num_rows, dtype=torch.bool)
        for start, a, f in chunks:
            end = min(start + a.shape[0], num_rows)
            if end <= start:
                continue
            aux[start:end], final[start:end] = a[: end - start], f[: end - start]
            seen[start:end] = True
        return (aux, final) if bool(seen.all()) else None

    def clear(self) -> None:
        self._rows.clear()


def _to_host(rows: torch.Tensor) -> torch.Tensor:
    """Rows off a GPU in the 16-bit type their shard will store (half the copy, and none of
    the host's conversion work); a CPU's rows as they are."""
    if rows.device.type == "cpu":
        return rows
    return rows.to(_storage_dtype(float(rows.abs().max()))).cpu()


def _storage_dtype(peak: float) -> torch.dtype:
    return torch.float16 if peak < _FLOAT16_MAX else torch.bfloat16


def _tiles(chunks: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> bool:
    """Whether the chunks cover rows 0.. back to back, each starting where the last ended."""
    end = 0
    for start, a, _ in chunks:
        if start != end:
            return False
        end += a.shape[0]
    return True


@dataclass(frozen=True)
class SampleRows:
    """Where a sample's rows are: its shard file and first row there."""

    shard: str
    row: int


def write_shard(
    path: Path, samples: Sequence[tuple[Sequence[int], torch.Tensor, torch.Tensor]]
) -> list[int]:
    """One shard of `(token_ids, aux rows, final rows)` samples (feature rows one fewer than
    tokens); returns each sample's first row. Written to a temp name, then renamed."""
    tokens, aux, final, firsts = [], [], [], []
    row = 0
    for ids, a, f in samples:
        if a.shape[0] != len(ids) - 1 or f.shape[0] != len(ids) - 1:
            raise ValueError(f"{len(ids)} tokens need {len(ids) - 1} feature rows")
        firsts.append(row)
        row += len(ids)
        tokens.append(torch.tensor(ids, dtype=torch.int32))
        aux.append(torch.cat([a, a.new_zeros(1, a.shape[1])]))
        final.append(torch.cat([f, f.new_zeros(1, f.shape[1])]))
    aux_all, final_all = torch.cat(aux), torch.cat(final)
    if aux_all.dtype == final_all.dtype == torch.float16:  # rows a GPU already checked
        dtype = torch.float16
    else:
        dtype = _storage_dtype(max(float(aux_all.abs().max()), float(final_all.abs().max())))
    tensors = {
        "tokens": torch.cat(tokens),
        "aux": aux_all.to(dtype),
        "final": final_all.to(dtype),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)
    return firsts


class ShardReader:
    """Row ranges of shards, read lazily (a shard is opened once and kept open)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._open: dict[str, object] = {}

    def rows(
        self, where: SampleRows, num_rows: int, dtype: torch.dtype | None = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(tokens int64 [n], aux [n, A], final [n, H])` of one sample, the features in
        `dtype` (None: as stored, for a caller that converts them on its device)."""
        handle = self._open.get(where.shard)
        if handle is None:
            handle = safe_open(str(self.root / where.shard), framework="pt")
            self._open[where.shard] = handle
        span = slice(where.row, where.row + num_rows)
        tokens = handle.get_slice("tokens")[span].to(torch.int64)  # type: ignore[attr-defined]
        aux = handle.get_slice("aux")[span]  # type: ignore[attr-defined]
        final = handle.get_slice("final")[span]  # type: ignore[attr-defined]
        if dtype is not None:
            aux, final = aux.to(dtype), final.to(dtype)
        return tokens, aux, final
