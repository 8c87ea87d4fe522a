"""What the hidden-state drafters (`eagle3`, `dflash`) share.

KV cache. A drafter's layers get their own `PagedKVCache` (layer ids 0..n-1) with the same
`num_blocks` and `block_size` as the target's, indexed by the same block ids: the runner
passes the target's full-attention block tables, so no separate allocation is needed and a
request's draft K/V lives in the same logical blocks as its target K/V.

Attention metadata. Each drafter layer has its own attention kind (causal or not, sliding
window or not; DFlash mixes them), which our backends bake into the metadata at build time.
`DraftAttentionMetadata` therefore carries one `AttentionMetadata` per drafter layer, built by
`build_draft_metadata` from the caller's steps (one block table each; their `causal` flag is
ignored, each layer decides).

Checkpoint tensors. `TensorSource` looks names up after normalising prefixes and reports
missing, misshapen and unexpected tensors by their checkpoint names. Decoder layers map with
the target loader's `map_decoder_layer`, and built drafters are filled by its `assign_weights`.

Module base. `HiddenStateDrafter` holds the config, `TargetParts` and backend, and gives
both drafters `dtype`, `num_layers` and `make_kv_cache`; `placement` defaults a drafter's
dtype and device to the target's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from specserve.shared.config import AttentionType
from specserve.worker.attention.base import AttentionBackend, AttentionMetadata, SequenceStep
from specserve.worker.attention.torch_backend import TorchAttentionBackend
from specserve.worker.cpu import fused_decode
from specserve.worker.cpu.linear import Linear
from specserve.worker.cpu.narrow_panels import blockable, round_to_q8_blocks
from specserve.worker.kv_cache import PagedKVCache, bytes_per_block
from specserve.worker.loader import read_safetensors, resolve_dtype
from specserve.worker.model_config import KVLayerGroup, ModelConfig
from specserve.worker.models import DecoderModel, RMSNorm


@dataclass(frozen=True)
class LayerAttention:
    """How one drafter layer attends: causal or bidirectional, optional sliding window."""

    causal: bool
    sliding_window: int | None = None


CAUSAL = LayerAttention(causal=True)


class DraftAttentionMetadata:
    """Per-layer metadata for one drafter forward (layers with equal kinds share an entry).

    Each entry has a single KV group (index 0), matching `DecoderLayer.group == 0` for every
    drafter layer. Where every layer attends causally over the whole context and the rows run
    as decode rows on a CPU, `decode_rows` holds the table the CPU kernel reads, made from
    the steps alone, and the per-layer metadata is built only if a layer path asks for it.
    """

    def __init__(
        self,
        num_tokens: int,
        build: Callable[[], tuple[AttentionMetadata, ...]],
        decode_rows: fused_decode.DecodeRows | None = None,
    ) -> None:
        self.num_tokens = num_tokens
        self.decode_rows = decode_rows
        self._build = build
        self._per_layer = None if decode_rows is not None else build()

    @property
    def per_layer(self) -> tuple[AttentionMetadata, ...]:
        if self._per_layer is None:
            self._per_layer = self._build()
        return self._per_layer


def draft_kv_groups(num_layers: int) -> tuple[KVLayerGroup, ...]:
    """One full-attention group over all drafter layers: they share the target's full table."""
    return (KVLayerGroup(AttentionType.FULL, None, tuple(range(num_layers))),)


def make_draft_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> PagedKVCache:
    """The drafter's own K/V storage, same geometry (`num_blocks`, `block_size`) as the target."""
    return PagedKVCache(
        draft_kv_groups(config.num_layers),
        num_blocks,
        block_size,
        config.num_kv_heads,
        config.head_dim,
        dtype,
        device,
    )


def draft_kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Extra bytes per block index the drafter costs; add to the target's when budgeting."""
    return bytes_per_block(
        config.num_layers, block_size, config.num_kv_heads, config.head_dim, dtype
    )


def build_draft_metadata(
    backend: AttentionBackend,
    steps: Sequence[SequenceStep],
    layers: Sequence[LayerAttention],
    block_size: int,
    device: torch.device | str,
) -> DraftAttentionMetadata:
    """Metadata for every drafter layer, built once per distinct `LayerAttention`.

    `steps` carry exactly one block table each: the target's full-attention table. Sliding
    layers read that full table and apply the window in the mask, so no table entry needs to
    be dropped for them. Steps that run as decode rows on a CPU, for layers that all attend
    causally, get the CPU kernel's table at once and the rest on first use
    (`DraftAttentionMetadata`).
    """
    steps = list(steps)  # built later, perhaps
    for i, step in enumerate(steps):
        if len(step.block_tables) != 1:
            raise ValueError(
                f"request {i}: drafter steps take one block table (the target's full-attention "
                f"table), got {len(step.block_tables)}"
            )

    def build() -> tuple[AttentionMetadata, ...]:
        built: dict[LayerAttention, AttentionMetadata] = {}
        for kind in dict.fromkeys(layers):
            kind_steps = [replace(s, causal=kind.causal) for s in steps]
            attention = AttentionType.FULL if kind.sliding_window is None else AttentionType.SLIDING
            group = KVLayerGroup(attention, kind.sliding_window, tuple(range(len(layers))))
            built[kind] = backend.build_metadata(kind_steps, (group,), block_size, device)
        return tuple(built[kind] for kind in layers)

    decode_rows = None
    if isinstance(backend, TorchAttentionBackend) and all(kind == CAUSAL for kind in layers):
        decode_rows = fused_decode.DecodeRows.of(steps, block_size, device)
    return DraftAttentionMetadata(sum(s.query_len for s in steps), build, decode_rows)


@dataclass(frozen=True)
class TargetParts:
    """What a drafter borrows from its target, kept outside the drafter's module tree.

    Holding the target's modules in a plain dataclass (not as submodules) keeps the drafter's
    `state_dict` to its own weights and stops `drafter.to(...)` from moving the target.
    """

    embed_tokens: torch.nn.Embedding
    compute_logits: Callable[[torch.Tensor], torch.Tensor]
    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def of(cls, target: DecoderModel) -> TargetParts:
        """The target's parts; its LM head takes a drafter's hidden states in the target's
        dtype (a drafter may run in another). Beside a float32 head with a screen (a bfloat16 or
        int8 copy, `cpu.greedy_screen`) a drafter reads the screen's logits instead, at the row
        counts where it pays: half or a quarter of the bytes (a draft needs no exact logits:
        the target verifies it). DFlash's drafts at batch 1 on a
        2-core AMD Zen 3, float32 drafter: 1.06x the tokens/s, outputs equal."""
        cfg = target.config

        def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
            screen = target.greedy_screen()
            if screen is not None and screen.pays(hidden.shape[0], exact=False):
                return screen.logits(hidden)
            return target.compute_logits(hidden.to(target.dtype))

        return cls(
            target.embed_tokens,
            compute_logits,
            cfg.num_layers,
            cfg.hidden_size,
            cfg.vocab_size,
        )


class _DrafterConfig(Protocol):
    @property
    def layer(self) -> ModelConfig: ...


_C = TypeVar("_C", bound=_DrafterConfig)


class HiddenStateDrafter(nn.Module, Generic[_C]):
    """Base of the drafter modules: their config (whose `layer` describes the decoder layers),
    the borrowed `TargetParts`, the attention backend and the drafter's own KV cache.

    Subclasses register their modules after `__init__`, including a final `norm` (whose weight
    gives the drafter's dtype and device).
    """

    norm: RMSNorm

    def __init__(self, config: _C, target: TargetParts, backend: AttentionBackend):
        super().__init__()
        self.config = config
        self.target = target
        self.backend = backend

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def num_layers(self) -> int:
        return self.config.layer.num_layers

    @torch.no_grad()
    def read_as_8bit_blocks(self) -> None:
        """Round the float32 weights of the drafter's own linears, its draft head aside, to
        8-bit blocks (per 32 weights a float16 scale and integers -127..127, as a Q8_0 writer
        would), which the panel kernel reads at 8.5 bits a weight instead of the 16 of a 16-bit
        checkpoint's panels: less to stream per draft where the drafter runs in float32. The
        drafts move a little (the bundled EAGLE-3 drafter's acceptance on 64 held-out prompts
        at K=5: 2.306 either way); what is generated does not, since the target verifies every
        draft. (The head is read through its screen's int8 copy already.)"""
        head = getattr(self, "lm_head", None)
        for module in self.modules():
            if isinstance(module, Linear) and module is not head and blockable(module.weight):
                module.weight.copy_(round_to_q8_blocks(module.weight))
                module.repack()

    def make_kv_cache(
        self, num_blocks: int, block_size: int, device: torch.device | str | None = None
    ) -> PagedKVCache:
        """The drafter's K/V: same `num_blocks`/`block_size` and block ids as the target's."""
        device = self.norm.weight.device if device is None else device
        return make_draft_kv_cache(self.config.layer, num_blocks, block_size, self.dtype, device)


def placement(
    target: DecoderModel, dtype: torch.dtype | str | None, device: torch.device | str | None
) -> tuple[torch.dtype, torch.device]:
    """A drafter's dtype and device: the given ones, else the target's."""
    dtype = target.dtype if dtype is None else resolve_dtype(dtype)
    device = target.embed_tokens.weight.device if device is None else torch.device(device)
    return dtype, device


def read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"no config.json in drafter checkpoint {path}")
    return json.loads(config_path.read_text())


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Safetensors (single or sharded), else a `pytorch_model.bin` (older EAGLE-3 releases)."""
    bin_file = path / "pytorch_model.bin"
    if not any(path.glob("*.safetensors*")) and bin_file.is_file():
        return torch.load(bin_file, map_location="cpu", weights_only=True)
    return read_safetensors(path)


# Tensors recomputed from the config or only used in training; safe to drop when loading.
_IGNORED = re.compile(
    r"(^|\.)rotary_emb\.(inv_freq|original_inv_freq)$|^t2d$|^verifier_(norm|lm_head)\.weight$"
)


class TensorSource:
    """Checkpoint tensors under normalised names, with errors that name the checkpoint.

    `renames` maps a checkpoint prefix to ours (e.g. `midlayer.` -> `layers.0.`); a leading
    `model.` is always stripped. Lookups record what was used so `check_all_used` can reject
    tensors the drafter does not understand instead of silently ignoring them.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        what: str,
        renames: Mapping[str, str] | None = None,
    ):
        self.what = what
        self.tensors: dict[str, torch.Tensor] = {}
        self.original: dict[str, str] = {}
        for name, tensor in tensors.items():
            ours = name.removeprefix("model.")
            for old, new in (renames or {}).items():
                if ours.startswith(old):
                    ours = new + ours[len(old) :]
            if ours in self.tensors:
                raise ValueError(
                    f"{what}: checkpoint has both {self.original[ours]!r} and {name!r}"
                )
            self.tensors[ours] = tensor
            self.original[ours] = name
        self.used: set[str] = set()
        renamed = ", ".join(f"{old!r} -> {new!r}" for old, new in (renames or {}).items())
        self.hint = f" (names read with 'model.' stripped{', ' + renamed if renamed else ''})"

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str, *shape: int) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"{self.what} checkpoint is missing tensor {name!r}{self.hint}")
        tensor = self.tensors[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{self.what} tensor {self.original[name]!r} has shape {tuple(tensor.shape)}, "
                f"config expects {shape}"
            )
        self.used.add(name)
        return tensor

    def check_all_used(self) -> None:
        unknown = sorted(
            self.original[n] for n in set(self.tensors) - self.used if not _IGNORED.search(n)
        )
        if unknown:
            shown = ", ".join(unknown[:8]) + (", ..." if len(unknown) > 8 else "")
            raise ValueError(
                f"{self.what} checkpoint has {len(unknown)} unexpected tensors: {shown}"
            )


def layer_config(fields: Mapping[str, Any], architecture: str | None, what: str) -> ModelConfig:
    """A `ModelConfig` for a drafter's decoder layers, from Llama/Qwen3-style fields.

    `architecture` None lets `model_type` (default "llama") pick the layer flavour. Per-layer
    attention kinds are the drafter's business (DFlash resolves causality and windows itself),
    so `layer_types` and sliding-window switches are dropped here. A missing `vocab_size` does
    not matter: drafter layers never use it.
    """
    hf = {k: v for k, v in fields.items() if k not in _LAYER_KIND_FIELDS}
    if architecture is None:
        hf.pop("architectures", None)
        hf.setdefault("model_type", "llama")
    else:
        hf["architectures"] = [architecture]
    hf.setdefault("vocab_size", 0)
    try:
        return ModelConfig.from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        detail = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"{what} config: {detail}") from e


_LAYER_KIND_FIELDS = ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers")


def int_tuple(values: Iterable[Any], field: str) -> tuple[int, ...]:
    """A non-empty tuple of ints from a config list, or a ValueError naming the field."""
    try:
        out = tuple(int(v) for v in values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field} must be a list of integers, got {values!r}") from e
    if not out:
        raise ValueError(f"{field} is empty")
    return out
