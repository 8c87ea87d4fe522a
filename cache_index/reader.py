"""Router-side lookups: how many leading blocks of a prompt each live worker holds.

One Lua call per lookup (one round trip), and one pipeline of them for a burst. Because hashes
chain over the whole prefix, a worker's match is the number of leading blocks it holds
contiguously. Entries count only under the worker's live epoch.

A worker's holdings of one chain are prefix-closed in a full-attention group: its block pool
never evicts a block while a deeper block of the same chain stays cached, because a request frees
its blocks tail first, freed blocks join the free queue's tail and eviction takes its head, and a
prefix hit revives a chain's leading blocks only. So the script finds each worker's length by
bisection over the chain (about log2(n) key reads for n blocks, shared by the workers whose search
agrees) instead of reading every block, and a miss costs one read. For holdings with a gap (a
sliding-window group, which frees blocks that leave its window, or a worker that broke the rule),
the count is where bisection lands: the end of some held stretch that starts at block 0 or after
a gap, possibly longer than the contiguous prefix; only the router's estimate is then off.

The engine's own lookup stays the authority (it caps the hit at the prompt length minus one
token and applies sliding-window rules); this is the router's estimate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hiredis import pack_command
from redis import Redis
from redis.exceptions import NoScriptError, ResponseError

from specserve.cache_index.client import check_client
from specserve.cache_index.errors import unavailable_as_index_error
from specserve.cache_index.schema import DIGEST_BYTES, Namespace, digest_key
from specserve.cache_index.scripts import Scripts
from specserve.shared.hashing import BlockHash


class IndexReader:
    def __init__(self, client: Redis, namespace: Namespace) -> None:
        self.client = check_client(client)
        self.ns = namespace
        self._script = Scripts(client).longest_prefix

    def longest_prefix(self, block_hashes: Sequence[BlockHash], group: int = 0) -> dict[str, int]:
        """Per live worker with at least one hit: leading blocks of `block_hashes` it holds."""
        return self.longest_prefix_by_group({group: block_hashes})[group]

    def longest_prefix_multi(
        self,
        hashes_by_group: Mapping[int, Sequence[BlockHash]],
        block_sizes: Mapping[int, int] | None = None,
    ) -> dict[str, int]:
        """Hybrid models: per worker, the minimum over all groups (a hit needs every group).

        Without `block_sizes` the result is in blocks and assumes one block size for all groups;
        with it, each group's count is converted to tokens before taking the minimum. Workers
        missing from any group are left out. Sliding-window groups cache only the blocks that can
        serve a hit, so pass full-attention groups here, or expect an underestimate.
        """
        if not hashes_by_group:
            return {}
        per_group = self.longest_prefix_by_group(hashes_by_group)
        out: dict[str, int] | None = None
        for group, matches in per_group.items():
            scale = block_sizes[group] if block_sizes is not None else 1
            scaled = {w: n * scale for w, n in matches.items()}
            out = (
                scaled
                if out is None
                else {w: min(n, scaled[w]) for w, n in out.items() if w in scaled}
            )
        return out or {}

    def longest_prefix_many(
        self, prompts: Sequence[Sequence[BlockHash]], group: int = 0
    ) -> list[dict[str, int]]:
        """`longest_prefix` of each prompt, all in one round trip (a pipeline of the script):
        what a burst of admissions needs, instead of one round trip per request."""
        if not any(prompts):
            return [{} for _ in prompts]
        calls = [self._script_inputs({group: hashes}) for hashes in prompts]
        with unavailable_as_index_error("prefix lookup"):
            try:
                replies = self._evalsha_pipeline(calls)
            except NoScriptError:  # a fresh (or flushed) server: load it once, then again
                self.client.script_load(self._script.script)
                replies = self._evalsha_pipeline(calls)
        return [self._parse([group], reply)[group] for reply in replies]

    def _evalsha_pipeline(self, calls: list[tuple[list[bytes], list[int]]]) -> list:
        """EVALSHA per call, all written at once and read back in order: one round trip. Each
        command is packed by hiredis in one call; redis-py's pipeline would pass every one of
        a lookup's ~33 arguments through a Python generator first (about a tenth of an
        admission). A pipeline given the `Script` object would also ask SCRIPT EXISTS first."""
        sha = self._script.sha
        packed = [pack_command((b"EVALSHA", sha, len(keys), *keys, *args)) for keys, args in calls]
        pool = self.client.connection_pool
        conn = pool.get_connection()
        replies: list = []
        try:
            conn.send_packed_command(packed)
            for _ in calls:
                try:
                    replies.append(conn.read_response())
                except ResponseError as exc:  # the rest is still read: the socket stays in step
                    replies.append(exc)
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise reply
        return replies

    def longest_prefix_by_group(
        self, hashes_by_group: Mapping[int, Sequence[BlockHash]]
    ) -> dict[int, dict[str, int]]:
        """Per group, per live worker: leading blocks held. All groups in one round trip."""
        groups = list(hashes_by_group)
        if not any(hashes_by_group[g] for g in groups):
            return {g: {} for g in groups}
        keys, args = self._script_inputs(hashes_by_group)
        with unavailable_as_index_error("prefix lookup"):
            reply = self._script(keys, args)
        return self._parse(groups, reply)

    def _script_inputs(
        self, hashes_by_group: Mapping[int, Sequence[BlockHash]]
    ) -> tuple[list[bytes], list[int]]:
        keys = [self.ns.live_key]
        args: list[int] = [len(hashes_by_group)]
        for group, hashes in hashes_by_group.items():
            prefix = self.ns.block_prefix(group)  # `Namespace.block_key`, without its per-call work
            if hashes and min(map(len, hashes)) < DIGEST_BYTES:
                digest_key(min(hashes, key=len))  # raises, naming the short hash
            keys.extend([prefix + h[:DIGEST_BYTES] for h in hashes])
            args.append(len(hashes))
        return keys, args

    @staticmethod
    def _parse(groups: Sequence[int], reply: list) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {}
        pos = 0
        for group in groups:
            n = int(reply[pos])
            pairs = reply[pos + 1 : pos + 1 + 2 * n]
            out[group] = {pairs[i].decode(): int(pairs[i + 1]) for i in range(0, 2 * n, 2)}
            pos += 1 + 2 * n
        return out


def usable_hit_blocks(matched_blocks: int, num_prompt_tokens: int, block_size: int) -> int:
    """What the engine could use of a match: never the prompt's last token (its logits are
    needed). A router may score with this."""
    return max(0, min(matched_blocks, (num_prompt_tokens - 1) // block_size))
