"""KVCacheManager: which blocks hold which request's tokens, over a BlockPool.

It maps request ids to block lists and tokens to slots, and runs the prefix cache: full blocks are
registered under a chained hash of their tokens once their K/V are computed (`cache_blocks`), and a
new request takes references on the longest run of cached blocks matching its tokens
(`get_computed_blocks`), so its prefill skips them. It never touches tensors and never raises for
lack of blocks: `allocate_slots` returns None and the caller (the scheduler) preempts.

KV-cache groups (optc/core/kv_cache.py). A model's layers form groups with one block table each,
given here by their windows (`windows[g]`: None for full attention). Every group of a request has a
block list of the same length (one entry per `block_size` tokens), all taken from one pool; a
request's blocks travel (scheduler output, tensor-parallel step, batch builder) as one list, group
after group: `block_ids[g * n : (g + 1) * n]` with n = len(block_ids) // num_groups. With one group
(every model without sliding layers) that is the group's list itself and nothing else changes.
A sliding group of window w holds only what a query can still see: when a step starts at
`num_computed_tokens` c, no query from c on reads a key before c - w + 1, so the blocks wholly before
that position go back to the pool and the list holds the null block (id 0) there. A speculative
rollback never goes back before the step's start, so it never needs a released block. Prefix-cache
entries are per group (a block holds its group's layers); a hit must hold, in every group, the
blocks the next query can see: the whole prefix for full attention, the last window before the hit
point for a sliding group (`get_computed_blocks` shortens the hit until every group has them).

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

from collections.abc import Sequence

from optc.runtime.block_pool import NULL_BLOCK_ID, BlockPool, hash_block_tokens
from optc.runtime.request import Request

NO_LIMIT = 1 << 62  # the token capacity of a pool whose every group's holding is bounded


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Sequence[int | None] = (None,), max_num_batched_tokens: int | None = None) -> None:
        """`windows`: one per KV-cache group, None for full attention; `max_num_batched_tokens`: the
        most tokens a step adds to a request (what bounds a sliding group's blocks; None: unbounded)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must be one per group, each None or >= 1, got {list(windows)}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        self._sliding = [(g, w) for g, w in enumerate(self.windows) if w is not None]
        # a block's prefix-cache key: its chained hash, salted by its group (none for group 0)
        self._salts = [g.to_bytes(2, "little") if g else b"" for g in range(self.num_groups)]
        self._block_ids: dict[str, list[list[int]]] = {}  # per group, all of one length
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already cached
        self._copies: list[tuple[int, int]] = []
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_token_capacity = self._token_capacity(max_num_batched_tokens)

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
    def prefix_cache_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / max(1, self.num_prefix_query_tokens)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's blocks, group after group (with one group: its list)."""
        lists = self._block_ids.get(request_id)
        if lists is None:
            return []
        return lists[0] if self.num_groups == 1 else [b for blocks in lists for b in blocks]

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's blocks per group (the null block where a sliding group let go of one)."""
        return [list(blocks) for blocks in self._block_ids.get(request_id, [[]] * self.num_groups)]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks matching the request's leading full blocks (group after group, as
        `block_ids`), and the tokens they hold.

        The hit stops before the request's last token, which must be computed to get logits. Takes
        no references; pass the blocks to `allocate_slots`.
        """
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need the logits of every prompt position
        num_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, num_blocks)
        while True:  # shorten the hit until every group holds what it needs there
            hits = [self._find_hit(g, request.block_hashes, num_blocks) for g in range(self.num_groups)]
            shortest = min(len(h) for h in hits)
            if shortest == num_blocks:
                break
            num_blocks = shortest
        return (hits[0] if self.num_groups == 1 else [b for h in hits for b in h]), num_blocks * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_block_ids: list[int] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` tokens after the computed ones; the request's blocks (as
        `block_ids`) or None.

        `computed_block_ids` (prefix hit, on admission only) count as computed tokens ahead of
        `request.num_computed_tokens`. On None nothing has changed, except that sliding groups have
        let go of blocks no query can see any more.
        """
        request_id, size, pool = request.request_id, self.block_size, self.pool
        lists = self._block_ids.get(request_id)
        computed = computed_block_ids or ()
        if computed and lists:
            raise RuntimeError(f"request {request_id} has blocks; prefix hits are for admission")
        num_hit = len(computed) // self.num_groups
        num_computed = request.num_computed_tokens + num_hit * size
        num_needed = -(-(num_computed + num_new_tokens) // size)
        first_written = num_computed // size
        if lists is None:
            lists = [[] for _ in self.windows]
        elif self._sliding:
            self._release_out_of_window(request_id, lists, num_computed)
        num_held = len(lists[0])
        copy_indices = [(blocks, i) for blocks in lists for i in range(first_written, num_held)
                        if pool.ref_count(blocks[i]) > 1 or pool.block_hash(blocks[i]) is not None]
        num_new_blocks = max(0, num_needed - num_held - num_hit)
        num_wanted = self.num_groups * num_new_blocks + len(copy_indices)
        if computed:  # cached blocks in the free queue are revived: they come out of the free count
            num_wanted += sum(1 for b in computed if b != NULL_BLOCK_ID and pool.ref_count(b) == 0)
        if num_wanted > pool.num_free_blocks:
            return None
        if computed_block_ids is not None:
            self.num_prefix_query_tokens += request.num_tokens
            self.num_prefix_hit_tokens += num_hit * size
        if computed:
            pool.touch(b for b in computed if b != NULL_BLOCK_ID)
            for g, blocks in enumerate(lists):
                blocks.extend(computed[g * num_hit: (g + 1) * num_hit])
        lists = self._block_ids.setdefault(request_id, lists)
        self._num_cached_blocks[request_id] = min(self._num_cached_blocks.get(request_id, 0) + num_hit, first_written)
        for blocks, i in copy_indices:
            self._copy_on_write(blocks, i)
        if num_new_blocks:
            for blocks in lists:
                blocks.extend(pool.allocate(num_new_blocks))
        return lists[0] if self.num_groups == 1 else [b for blocks in lists for b in blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks whose K/V are now computed."""
        if not self.enable_prefix_caching:
            return
        num_full = num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:  # most decode steps: no block became full
            return
        self._extend_hashes(request, num_full)
        hashes = request.block_hashes
        for blocks, salt in zip(self._block_ids[request.request_id], self._salts, strict=True):
            for i in range(start, num_full):
                # False when another request computed the same prefix first: this copy stays private.
                if blocks[i] != NULL_BLOCK_ID:  # a sliding group's block outside the window
                    self.pool.cache_block(blocks[i], hashes[i] + salt if salt else hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past its first `num_tokens` tokens (a speculative rollback)."""
        lists = self._block_ids.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if not lists or keep >= len(lists[0]):
            return
        for blocks in lists:
            self.pool.free([b for b in reversed(blocks[keep:]) if b != NULL_BLOCK_ID])
            del blocks[keep:]
        cached = self._num_cached_blocks.get(request.request_id, 0)
        self._num_cached_blocks[request.request_id] = min(cached, keep)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so shared prefixes are evicted last (with several
        groups, position by position from the tail: the groups' cached prefixes shrink together)."""
        lists = self._block_ids.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if lists is None:
            return
        if self.num_groups == 1:
            self.pool.free(reversed(lists[0]))
            return
        self.pool.free(b for column in reversed(list(zip(*lists, strict=True))) for b in column if b != NULL_BLOCK_ID)

    def take_copies(self) -> list[tuple[int, int]]:
        """(source, destination) block copies the engine must apply before the next step."""
        copies, self._copies = self._copies, []
        return copies

    def _find_hit(self, group: int, hashes: list[bytes], num_blocks: int) -> list[int]:
        """The group's cached blocks for the longest hit of at most `num_blocks` blocks that it can
        serve: a full group's leading run; for a sliding group the last blocks before the hit point
        that its next query sees (null blocks before them), or a run from block 0 shorter than that."""
        salt, window, lookup = self._salts[group], self.windows[group], self.pool.lookup
        if window is None:
            block_ids = []
            for block_hash in hashes[:num_blocks]:
                block_id = lookup(block_hash + salt if salt else block_hash)
                if block_id is None:
                    break
                block_ids.append(block_id)
            return block_ids
        # the next query, at the hit point p, sees keys p - window + 1 .. p: the hit's last `needed` blocks
        needed = -(-(window - 1) // self.block_size)
        if needed == 0:
            return [NULL_BLOCK_ID] * num_blocks
        run: list[int] = []  # cached blocks from i + len(run) - 1 down to i
        for i in range(num_blocks - 1, -1, -1):
            block_id = lookup(hashes[i] + salt if salt else hashes[i])
            if block_id is None:
                run.clear()
                continue
            run.append(block_id)
            if len(run) == needed:
                return [NULL_BLOCK_ID] * i + run[::-1]
        return run[::-1]  # a run from block 0, shorter than the window: every key of the hit is there

    def _release_out_of_window(self, request_id: str, lists: list[list[int]], num_computed: int) -> None:
        """Each sliding group lets go of the blocks wholly before the first key a query at
        `num_computed` (or later) sees, putting the null block in their place."""
        first_written = num_computed // self.block_size
        for g, window in self._sliding:
            blocks = lists[g]
            if first_written < len(blocks) and blocks[first_written] == NULL_BLOCK_ID:  # nulls lead the list
                raise RuntimeError(f"request {request_id} would write a block its sliding window let go of "
                                   "(its computed count went back before the step that released it)")
            first_seen = min((num_computed - window + 1) // self.block_size, len(blocks))
            released = []
            for i in range(first_seen - 1, -1, -1):
                if blocks[i] == NULL_BLOCK_ID:  # released by an earlier step, as is everything before it
                    break
                released.append(blocks[i])
                blocks[i] = NULL_BLOCK_ID
            self.pool.free(released)

    def _token_capacity(self, max_num_batched_tokens: int | None) -> int:
        """Tokens one request can hold if it had every block: a full group holds one block per
        `block_size` tokens, a sliding group at most its window and one step's tokens."""
        def blocks(n: int) -> int:
            return max_request_blocks(self.windows, n, self.block_size, max_num_batched_tokens)

        usable = self.pool.num_blocks - 1
        if blocks(usable + 1) <= usable:  # every group sliding: a request's holding is bounded
            return NO_LIMIT
        low, high = 0, usable  # blocks(n) >= n here: the answer is at most `usable`
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if blocks(mid) <= usable else (low, mid - 1)
        return low * self.block_size

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
            # a request under a LoRA adapter chains from the adapter's key: two adapters never share a prefix block
            parent = hashes[-1] if hashes else request.lora_key
            hashes.append(hash_block_tokens(parent, request.token_ids[i * size : (i + 1) * size]))


def max_request_blocks(windows: Sequence[int | None], num_blocks: int, block_size: int,
                       max_num_batched_tokens: int | None) -> int:
    """The most blocks a request with `num_blocks` blocks' worth of tokens holds over KV-cache groups
    of these windows: a full group all of them; a sliding group of window w at most
    ceil((w - 1 + n) / block_size) + 1 while a step adds n <= max_num_batched_tokens tokens (None:
    unbounded steps) -- the keys its first query sees, the step's tokens, one block of misalignment."""
    if max_num_batched_tokens is None:
        return len(windows) * num_blocks
    return sum(num_blocks if w is None else min(num_blocks, -(-(w - 1 + max_num_batched_tokens) // block_size) + 1)
               for w in windows)
