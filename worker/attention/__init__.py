"""Attention backends over the paged KV cache."""

from specserve.worker.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    GroupAttentionMetadata,
    SequenceStep,
)
from specserve.worker.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "GroupAttentionMetadata",
    "SequenceStep",
    "TorchAttentionBackend",
]
