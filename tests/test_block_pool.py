"""BlockPool: exact block ids, ref counts, free-queue order and prefix hashes."""

import pytest

from optc.runtime.block_pool import NULL_BLOCK_ID, BlockPool, hash_block_tokens


def test_allocate_hands_out_ids_in_order_and_never_the_null_block():
    pool = BlockPool(5)
    assert pool.free_block_ids() == [1, 2, 3, 4]
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(1) == [4]
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 4
    assert NULL_BLOCK_ID not in pool.free_block_ids()
    assert pool.ref_count(NULL_BLOCK_ID) == 0


def test_allocate_returns_none_and_changes_nothing_when_too_few_blocks():
    pool = BlockPool(4)
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(2) is None
    assert pool.free_block_ids() == [3]
    assert pool.allocate(1) == [3]
    assert pool.allocate(1) is None
    assert pool.allocate(0) == []


def test_ref_counts_through_touch_and_free():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert (pool.ref_count(a), pool.ref_count(b)) == (1, 1)
    pool.touch([a])
    assert pool.ref_count(a) == 2
    pool.free([a])
    assert pool.ref_count(a) == 1 and a not in pool.free_block_ids()
    pool.free([a, b])
    assert (pool.ref_count(a), pool.ref_count(b)) == (0, 0)
    assert pool.free_block_ids() == [b, a, 3]  # uncached blocks go to the head, last freed first


def test_double_free_and_null_free_raise():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError, match="ref count 0"):
        pool.free([a])
    with pytest.raises(RuntimeError, match="block 0"):
        pool.free([NULL_BLOCK_ID])


def test_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(6)
    ids = pool.allocate(5)  # [1, 2, 3, 4, 5]
    hashes = {}
    for block_id in (1, 2, 3):
        hashes[block_id] = hash_block_tokens(None, [block_id])
        assert pool.cache_block(block_id, hashes[block_id])
    pool.free([3, 1, 4, 2, 5])
    # 4 and 5 hold nothing: head; cached ones at the tail in the order they were freed.
    assert pool.free_block_ids() == [5, 4, 3, 1, 2]
    assert ids == [1, 2, 3, 4, 5]
    assert pool.allocate(3) == [5, 4, 3]
    assert pool.lookup(hashes[3]) is None and pool.block_hash(3) is None  # evicted on reuse
    assert pool.lookup(hashes[1]) == 1 and pool.lookup(hashes[2]) == 2
    assert pool.num_cached_blocks == 2


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    h = hash_block_tokens(None, [7, 8])
    pool.cache_block(a, h)
    pool.free([a, b])
    assert pool.free_block_ids() == [b, 3, a]
    assert pool.lookup(h) == a
    pool.touch([a])
    assert pool.ref_count(a) == 1 and pool.free_block_ids() == [b, 3]
    assert pool.block_hash(a) == h  # still cached while in use


def test_cache_block_keeps_the_first_block_for_a_hash():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    h = hash_block_tokens(None, [1, 2])
    assert pool.cache_block(a, h)
    assert not pool.cache_block(b, h)
    assert pool.lookup(h) == a and pool.block_hash(b) is None


def test_prefix_caching_disabled_caches_nothing():
    pool = BlockPool(3, enable_prefix_caching=False)
    (a,) = pool.allocate(1)
    assert not pool.cache_block(a, hash_block_tokens(None, [1]))
    assert pool.num_cached_blocks == 0


def test_block_hash_is_chained():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, [1, 2, 3, 4])
    assert first != hash_block_tokens(None, [1, 2, 3, 5])
    second = hash_block_tokens(first, [5, 6, 7, 8])
    assert second != hash_block_tokens(hash_block_tokens(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert second != hash_block_tokens(None, [5, 6, 7, 8])


def test_pool_needs_more_than_the_null_block():
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(1)
