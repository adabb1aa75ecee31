"""KVCacheManager: slots, exhaustion, freeing, prefix hits and copy-on-write, with exact block ids."""

from optc.runtime.kv_cache_manager import KVCacheManager
from optc.runtime.request import Request
from optc.runtime.sampler import SamplingParams


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(), max_num_tokens=1 << 20)


def compute(kv: KVCacheManager, request: Request, num_new: int, hit_ids=None) -> list[int]:
    """What the scheduler and engine do for one step: allocate, then mark computed and cache."""
    block_ids = kv.allocate_slots(request, num_new, hit_ids)
    assert block_ids is not None
    if hit_ids is not None:
        request.num_computed_tokens = len(hit_ids) * kv.block_size
    request.num_computed_tokens += num_new
    kv.cache_blocks(request, request.num_computed_tokens)
    return list(block_ids)


def test_allocate_slots_grows_block_by_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(10)))
    assert compute(kv, request, 10) == [1, 2, 3]
    request.append_token(10)
    request.append_token(11)
    assert compute(kv, request, 2) == [1, 2, 3]  # tokens 10, 11 fill block 3
    request.append_token(12)
    assert compute(kv, request, 1) == [1, 2, 3, 4]
    assert kv.num_used_blocks == 4 and kv.num_free_blocks == 3


def test_allocate_slots_returns_none_when_out_of_blocks_and_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a, b = make_request("a", list(range(8))), make_request("b", list(range(100, 108)))
    assert compute(kv, a, 8) == [1, 2]
    assert kv.allocate_slots(b, 8) is None
    assert kv.block_ids("b") == [] and kv.num_free_blocks == 1
    assert kv.allocate_slots(b, 4) == [3]


def test_free_returns_blocks_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(12)))
    compute(kv, a, 12)
    kv.free(a)
    # Uncached blocks go to the head one by one (tail first), which leaves them in id order.
    assert kv.pool.free_block_ids() == [1, 2, 3, 4, 5]
    assert [kv.pool.ref_count(i) for i in range(6)] == [0] * 6
    assert kv.block_ids("a") == []


def test_free_of_cached_blocks_keeps_the_prefix_longest():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", list(range(13)))
    compute(kv, a, 13)  # blocks 1, 2, 3 full and cached; 4 holds 1 token
    kv.free(a)
    assert kv.pool.free_block_ids() == [4, 5, 3, 2, 1]  # evicted in this order


def test_prefix_hit_skips_cached_blocks_and_counts_references():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(18)))
    assert compute(kv, a, 18) == [1, 2, 3, 4, 5]  # 4 full blocks cached
    b = make_request("b", list(range(16)) + [90, 91, 92])
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert (hit_ids, num_hit) == ([1, 2, 3, 4], 16)
    assert compute(kv, b, 3, hit_ids) == [1, 2, 3, 4, 6]
    assert b.num_computed_tokens == 19
    assert [kv.pool.ref_count(i) for i in range(7)] == [0, 2, 2, 2, 2, 1, 1]
    assert (kv.num_prefix_query_tokens, kv.num_prefix_hit_tokens) == (19, 16)
    kv.free(a)
    assert [kv.pool.ref_count(i) for i in range(7)] == [0, 1, 1, 1, 1, 0, 1]
    kv.free(b)
    assert kv.num_free_blocks == 9


def test_prefix_hit_after_the_owner_finished_revives_free_blocks():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)  # [1, 2, 3]
    kv.free(a)
    b = make_request("b", list(range(8)) + [50, 51])
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert (hit_ids, num_hit) == ([1, 2], 8)
    assert compute(kv, b, 2, hit_ids) == [1, 2, 3]  # block 3 (uncached) reused for the new tail
    assert kv.pool.free_block_ids() == [4, 5]


def test_prefix_hit_stops_before_the_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(8)))
    compute(kv, a, 8)
    b = make_request("b", list(range(8)))  # same prompt, block-aligned
    assert kv.get_computed_blocks(b) == ([1], 4)  # block 2 holds the last token: recomputed
    c = make_request("c", list(range(9)))
    assert kv.get_computed_blocks(c) == ([1, 2], 8)


def test_prefix_hit_needs_room_for_revived_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(8)))
    compute(kv, a, 8)
    kv.free(a)  # [1, 2] cached and free, 3 free
    other = make_request("x", [99, 98, 97, 96])
    assert compute(kv, other, 4, []) == [3]  # admitted with an empty prefix hit
    b = make_request("b", list(range(8)) + [7] * 4)
    hit_ids, _ = kv.get_computed_blocks(b)
    assert hit_ids == [1, 2]
    # Reviving 1 and 2 uses both free blocks; the 4 new tokens need one more.
    assert kv.allocate_slots(b, 4, hit_ids) is None
    assert [kv.pool.ref_count(i) for i in range(4)] == [0, 0, 0, 1]
    assert kv.num_prefix_query_tokens == 4  # only the successful admission of "x" counted


def test_copy_on_write_when_a_shared_block_would_be_written():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)  # [1, 2, 3], blocks 1 and 2 cached
    b = make_request("b", list(range(9)))
    hit_ids, _ = kv.get_computed_blocks(b)
    compute(kv, b, 1, hit_ids)  # [1, 2, 4]
    # Roll b back into the shared block 2 (as a speculative rejection would) and write there.
    b.num_computed_tokens = 6
    assert kv.allocate_slots(b, 3) == [1, 5, 4]
    assert kv.take_copies() == [(2, 5)]
    assert kv.take_copies() == []
    assert [kv.pool.ref_count(i) for i in range(6)] == [0, 2, 1, 1, 1, 1]


def test_no_prefix_hits_when_disabled():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert kv.pool.num_cached_blocks == 0
