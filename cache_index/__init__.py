"""specserve.cache_index: the global prefix-cache index on Redis.

Write-through from the control plane's block pools (`IndexWriter`), one-round-trip lookups for the
router (`IndexReader`), epoch fencing of dead or restarted workers (`registry`), a background
janitor (`cleanup`) and operator views (`inspection`). The key schema is in `schema` and
docs/cache_index.md.
"""

from specserve.cache_index.cleanup import CleanupResult, cleanup_dead_worker, cleanup_fenced
from specserve.cache_index.client import connect
from specserve.cache_index.errors import (
    CacheIndexError,
    IndexFenced,
    IndexOutOfSync,
    IndexUnavailable,
)
from specserve.cache_index.inspection import (
    DiscoveredNamespaces,
    IndexStats,
    PromptLookup,
    WorkerList,
    discover_namespaces,
    lookup_prompt_blocks,
    stats,
    worker_list,
)
from specserve.cache_index.reader import IndexReader, usable_hit_blocks
from specserve.cache_index.registry import (
    WorkerRecord,
    expire_stale_workers,
    heartbeat,
    list_workers,
    live_owner,
    mark_dead,
    register_worker,
)
from specserve.cache_index.schema import Namespace, UnknownHasher
from specserve.cache_index.writer import IndexWriter, WriterStats

__all__ = [
    "CacheIndexError",
    "CleanupResult",
    "DiscoveredNamespaces",
    "IndexFenced",
    "IndexOutOfSync",
    "IndexReader",
    "IndexStats",
    "IndexUnavailable",
    "IndexWriter",
    "Namespace",
    "PromptLookup",
    "UnknownHasher",
    "WorkerList",
    "WorkerRecord",
    "WriterStats",
    "cleanup_dead_worker",
    "cleanup_fenced",
    "connect",
    "discover_namespaces",
    "expire_stale_workers",
    "heartbeat",
    "list_workers",
    "live_owner",
    "lookup_prompt_blocks",
    "mark_dead",
    "register_worker",
    "stats",
    "usable_hit_blocks",
    "worker_list",
]
