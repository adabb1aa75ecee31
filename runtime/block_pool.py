"""BlockPool: the KV-cache blocks as ids, with ref counts, a free queue and prefix hashes.

The pool knows block ids and nothing else: no tensors, no requests, no tokens (the caller hashes
tokens with `hash_block_tokens`). Block 0 is the reserved null block that pads block tables; it is
never handed out and never freed.

A block is in exactly one of two states:
- in use: `ref_count > 0` (several requests may share a full, cached block);
- free: `ref_count == 0` and in the free queue. A free block may still hold a cached prefix (its
  hash stays registered) until it is handed out again; `allocate` evicts it then.

Free-queue order is the eviction order: `allocate` takes from the head. `free` puts blocks without a
hash at the head (they hold nothing worth keeping) and cached blocks at the tail, so cached blocks
are evicted least-recently-freed first. Callers free a request's blocks tail-first so that its
prefix blocks, the ones other requests share, are evicted last. `touch` revives a cached free block
(prefix hit) by taking it out of the queue.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

NULL_BLOCK_ID = 0


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: it names the block's tokens and every token before them."""
    data = array("q", token_ids).tobytes()
    return hashlib.blake2b((parent_hash or b"") + data, digest_size=16).digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        # An ordered dict is a queue with O(1) removal of any member (needed by `touch`).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        return self._hashes[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be handed out) first."""
        return list(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Hand out `num_blocks` blocks with ref count 1, or None (and change nothing) if too few."""
        if num_blocks > len(self._free):
            return None
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit); revive free cached blocks."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue in this order."""
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID or self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} freed with ref count {self._ref_counts[block_id]}")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
                if self._hashes[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding this prefix hash, or None."""
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Register a full, computed block under its hash; False if the hash is already cached."""
        if not self.enable_prefix_caching or block_hash in self._cached:
            return False
        if self._hashes[block_id] is not None:
            raise RuntimeError(f"block {block_id} is already cached")
        self._hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self._hashes[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hashes[block_id] = None
