"""KVCacheManager: which blocks hold which request's tokens, over a BlockPool.

It maps request ids to block lists and tokens to slots, and runs the prefix cache: full blocks are
registered under a chained hash of their tokens once their K/V are computed (`cache_blocks`), and a
new request takes references on the longest run of cached blocks matching its tokens
(`get_computed_blocks`), so its prefill skips them. It never touches tensors and never raises for
lack of blocks: `allocate_slots` returns None and the caller (the scheduler) preempts.

Copy-on-write. Only full blocks are shared, blocks are cached only after their K/V are computed, and
a hit stops one token short of the request's end (the last token is always recomputed for its
logits), so new tokens always land past the shared blocks: with the current scheduler a write into a
shared block never happens. It can happen only when a caller moves `num_computed_tokens` back into a
cached block (e.g. a speculative-decoding rollback). `allocate_slots` guards that case: a block that
would be written and is shared (or cached) is replaced by a fresh block, and the (source,
destination) pair is queued for the scheduler's output (`take_copies`); the model runner copies it
before the step runs.
"""

from __future__ import annotations

from optc.runtime.block_pool import BlockPool, hash_block_tokens
from optc.runtime.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self._block_ids: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already cached
        self._copies: list[tuple[int, int]] = []
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_token_capacity(self) -> int:
        """Tokens one request could hold if it had every block."""
        return (self.pool.num_blocks - 1) * self.block_size

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / max(1, self.num_prefix_query_tokens)

    def block_ids(self, request_id: str) -> list[int]:
        return self._block_ids.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks matching the request's leading full blocks, and the tokens they hold.

        The hit stops before the request's last token, which must be computed to get logits. Takes
        no references; pass the blocks to `allocate_slots`.
        """
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need the logits of every prompt position
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_num_blocks)
        block_ids = []
        for block_hash in request.block_hashes[:max_num_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_block_ids: list[int] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` tokens after the computed ones; the request's blocks or None.

        `computed_block_ids` (prefix hit, on admission only) count as computed tokens ahead of
        `request.num_computed_tokens`. On None nothing has changed.
        """
        computed = computed_block_ids or []
        block_ids = self._block_ids.get(request.request_id, [])
        if computed and block_ids:
            raise RuntimeError(f"request {request.request_id} has blocks; prefix hits are for admission")
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        first_written = num_computed // self.block_size
        copy_indices = [
            i for i in range(first_written, len(block_ids))
            if self.pool.ref_count(block_ids[i]) > 1 or self.pool.block_hash(block_ids[i]) is not None
        ]
        num_revived = sum(1 for b in computed if self.pool.ref_count(b) == 0)
        num_new_blocks = max(0, num_needed - len(block_ids) - len(computed))
        if num_new_blocks + len(copy_indices) + num_revived > self.pool.num_free_blocks:
            return None
        if computed_block_ids is not None:
            self.num_prefix_query_tokens += request.num_tokens
            self.num_prefix_hit_tokens += len(computed) * self.block_size
        self.pool.touch(computed)
        block_ids = self._block_ids.setdefault(request.request_id, block_ids)
        block_ids.extend(computed)
        self._num_cached_blocks[request.request_id] = min(
            self._num_cached_blocks.get(request.request_id, 0) + len(computed), first_written
        )
        for i in copy_indices:
            self._copy_on_write(block_ids, i)
        block_ids.extend(self.pool.allocate(num_new_blocks))
        return block_ids

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks whose K/V are now computed."""
        if not self.enable_prefix_caching:
            return
        block_ids = self._block_ids[request.request_id]
        num_full = num_computed_tokens // self.block_size
        self._extend_hashes(request, num_full)
        start = self._num_cached_blocks.get(request.request_id, 0)
        for i in range(start, num_full):
            # False when another request computed the same prefix first: this copy stays private.
            self.pool.cache_block(block_ids[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = max(start, num_full)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past its first `num_tokens` tokens (a speculative rollback)."""
        block_ids = self._block_ids.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if not block_ids or keep >= len(block_ids):
            return
        self.pool.free(reversed(block_ids[keep:]))
        del block_ids[keep:]
        cached = self._num_cached_blocks.get(request.request_id, 0)
        self._num_cached_blocks[request.request_id] = min(cached, keep)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so shared prefixes are evicted last."""
        block_ids = self._block_ids.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(block_ids))

    def take_copies(self) -> list[tuple[int, int]]:
        """(source, destination) block copies the engine must apply before the next step."""
        copies, self._copies = self._copies, []
        return copies

    def _copy_on_write(self, block_ids: list[int], index: int) -> None:
        source = block_ids[index]
        (destination,) = self.pool.allocate(1)
        self.pool.free([source])
        block_ids[index] = destination
        self._copies.append((source, destination))

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        hashes, size = request.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.token_ids[i * size : (i + 1) * size]))
