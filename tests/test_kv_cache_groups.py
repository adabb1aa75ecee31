"""KV-cache groups: how layers are grouped (optc/core/kv_cache.py), and the KVCacheManager with a
sliding-window group beside a full-attention one: released blocks, prefix hits per group, preemption,
rollback and capacity, with exact block ids (group after group in a request's list)."""

import pytest

from optc.core.ir import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from optc.core.kv_cache import KVCacheGroup, KVCacheSpec, kv_cache_groups, num_kv_slots
from optc.runtime.batch import ForwardBatch
from optc.runtime.block_pool import NULL_BLOCK_ID
from optc.runtime.kv_cache_manager import NO_LIMIT, KVCacheManager
from optc.runtime.scheduler import Scheduler, SchedulerConfig
from tests.test_kv_cache_manager import compute, make_request

F, S = FULL_ATTENTION, SLIDING_ATTENTION


def _config(layer_types: tuple[str, ...], window: int | None = 8) -> ModelConfig:
    return ModelConfig("x", 64, 128, len(layer_types), 4, 2, 16, 256, 1e-6, 1e4, 128, True,
                       layer_types=layer_types, sliding_window=window if S in layer_types else None)


def test_groups_cut_each_kind_into_groups_of_the_smallest_kinds_size():
    assert kv_cache_groups(_config((F, F, F))) == (KVCacheGroup(None, (0, 1, 2)),)
    assert kv_cache_groups(_config((S, S, F))) == (
        KVCacheGroup(None, (2,)), KVCacheGroup(8, (0,)), KVCacheGroup(8, (1,)))
    # Gemma 3's pattern: five local layers per global one -> groups of the 3 global layers' size
    gemma3 = _config(tuple(F if i % 6 == 5 else S for i in range(18)))
    assert kv_cache_groups(gemma3) == (KVCacheGroup(None, (5, 11, 17)), KVCacheGroup(8, (0, 1, 2)),
                                       KVCacheGroup(8, (3, 4, 6)), KVCacheGroup(8, (7, 8, 9)),
                                       KVCacheGroup(8, (10, 12, 13)), KVCacheGroup(8, (14, 15, 16)))
    # 5 local layers over 2 global ones: groups of 2, the last local group has one layer (its slot 1 idles)
    assert kv_cache_groups(_config((S, S, F, S, S, F, S)))[-1] == KVCacheGroup(8, (6,))
    assert kv_cache_groups(_config((S, S))) == (KVCacheGroup(8, (0, 1)),)  # Mistral: one sliding group


def test_a_block_is_the_memory_of_one_layer_per_slot_and_groups_share_it():
    spec = KVCacheSpec(4, "float32")
    llama, hybrid = _config((F, F, F)), _config((S, S, F, S, S, F, S))
    layer_block = 2 * 4 * 2 * 16 * 4  # K and V, 4 tokens, 2 KV heads, head_dim 16, fp32
    assert spec.bytes_per_block(llama) == 3 * layer_block  # as before groups: every layer
    assert num_kv_slots(hybrid) == 2 and spec.bytes_per_block(hybrid) == 2 * layer_block
    assert spec.bytes_per_token(hybrid) == 7 * layer_block / 4  # a token held by every layer
    caches = spec.allocate(hybrid, 5, "cpu")
    assert len(caches) == 7 and len({id(c) for c in caches}) == 2
    # groups: full (2, 5), sliding (0, 1), (3, 4), (6,): slot 0 = layers 2, 0, 3, 6; slot 1 = 5, 1, 4
    assert all(caches[i] is caches[2] for i in (0, 3, 6)) and all(caches[i] is caches[5] for i in (1, 4))
    assert sum(c.data.nbytes for c in {id(c): c for c in caches}.values()) == 5 * spec.bytes_per_block(hybrid)
    assert len({id(c) for c in spec.allocate(llama, 5, "cpu")}) == 3


def test_a_sliding_group_releases_blocks_wholly_before_its_window():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=False, windows=(None, 8))
    a = make_request("a", list(range(10)))
    assert compute(kv, a, 10) == [1, 2, 3, 4, 5, 6]  # full group [1, 2, 3], sliding group [4, 5, 6]
    a.append_token(10)
    assert compute(kv, a, 1) == [1, 2, 3, 4, 5, 6]  # the query at 10 sees keys 3 .. 10: block 0 still
    a.append_token(11)
    assert compute(kv, a, 1) == [1, 2, 3, NULL_BLOCK_ID, 5, 6]  # the query at 11 sees keys 4 .. 11
    assert kv.pool.free_block_ids()[0] == 4 and kv.pool.ref_count(4) == 0
    a.append_token(12)
    assert compute(kv, a, 1) == [1, 2, 3, 4, 0, 5, 6, 7]  # block 4 recycled into the full group
    assert kv.group_block_ids("a") == [[1, 2, 3, 4], [0, 5, 6, 7]]
    kv.free(a)
    assert kv.num_free_blocks == 31 and kv.block_ids("a") == []


def test_a_sliding_groups_blocks_stay_bounded_over_several_windows():
    window, size = 8, 4
    kv = KVCacheManager(num_blocks=64, block_size=size, windows=(None, window))
    a = make_request("a", list(range(5)))
    compute(kv, a, 5)
    for t in range(5, 60):  # decode 55 tokens: ~7 windows
        a.append_token(t)
        compute(kv, a, 1)
        full, sliding = kv.group_block_ids("a")
        assert len(full) == len(sliding) == -(-(t + 1) // size)
        assert sum(b != NULL_BLOCK_ID for b in sliding) <= -(-window // size) + 1  # 3
        assert all(b != NULL_BLOCK_ID for b in full)
    assert kv.num_used_blocks == 15 + 2  # from 59 on, keys 52 on: blocks 13 and 14
    kv.free(a)
    assert kv.num_free_blocks == 63 and all(kv.pool.ref_count(i) == 0 for i in range(64))


def test_a_prefix_hit_needs_only_the_window_before_it_in_a_sliding_group():
    kv = KVCacheManager(num_blocks=16, block_size=4, windows=(None, 8))
    a = make_request("a", list(range(21)))
    assert compute(kv, a, 21) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # 5 full blocks cached per group
    a.append_token(21)
    compute(kv, a, 1)  # from 21 on, a's sliding queries see keys 14 on: blocks 7, 8, 9 released
    assert kv.group_block_ids("a")[1] == [0, 0, 0, 10, 11, 12]
    x = make_request("x", list(range(100, 112)))
    compute(kv, x, 12)  # takes 13, 14, 15 and the released 9, 8, 7: their cache entries are evicted
    assert kv.group_block_ids("x") == [[13, 14, 15], [9, 8, 7]]
    b = make_request("b", list(range(20)) + [90, 91, 92])
    hit_ids, num_hit = kv.get_computed_blocks(b)
    # the query at 20 sees keys 13 .. 20: of the sliding group only blocks 3 and 4 (10, 11)
    assert (hit_ids, num_hit) == ([1, 2, 3, 4, 5, 0, 0, 0, 10, 11], 20)
    # a hit at 16 or 12 tokens would need sliding blocks x evicted: the full group's hit is shortened to none
    assert kv.get_computed_blocks(make_request("c", list(range(16)) + [90])) == ([], 0)
    assert kv.get_computed_blocks(make_request("d", list(range(12)) + [90])) == ([], 0)
    kv.free(x)  # queue: 15 7 14 8 13 9, position by position from the tail
    assert kv.allocate_slots(b, 3, hit_ids) == [1, 2, 3, 4, 5, 15, 0, 0, 0, 10, 11, 7]
    assert [kv.pool.ref_count(i) for i in (1, 5, 10, 11, 12)] == [2, 2, 2, 2, 1]


def test_freeing_goes_position_by_position_from_the_tail_across_groups():
    kv = KVCacheManager(num_blocks=16, block_size=4, windows=(None, 8))
    a = make_request("a", list(range(21)))
    compute(kv, a, 21)  # full [1 .. 6], sliding [7 .. 12]; blocks 6 and 12 hold one token: not cached
    kv.free(a)
    assert kv.pool.free_block_ids() == [12, 6, 13, 14, 15, 5, 11, 4, 10, 3, 9, 2, 8, 1, 7]
    x = make_request("x", list(range(100, 112)))
    compute(kv, x, 12)  # [12, 6, 13], [14, 15, 5]: evicts the full group's block 4 (5)
    b = make_request("b", list(range(20)) + [90])
    assert kv.get_computed_blocks(b) == ([1, 2, 3, 4, 0, 0, 9, 10], 16)  # the sliding group: blocks 2, 3


def test_preemption_frees_every_group_and_recomputation_reallocates():
    kv = KVCacheManager(num_blocks=9, block_size=4, windows=(None, 8), max_num_batched_tokens=64)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    a, b = make_request("a", list(range(8))), make_request("b", list(range(50, 58)))
    for r in (a, b):
        s.add_request(r)
    out = s.schedule()
    assert out.block_ids == [[1, 2, 3, 4], [5, 6, 7, 8]]
    s.update(out)
    for r in (a, b):
        r.append_token(1)
    out = s.schedule()  # a needs a third block per group: b is preempted, a takes b's blocks
    assert out.preempted_ids == ["b"] and out.block_ids == [[1, 2, 6, 3, 4, 8]]
    assert kv.block_ids("b") == [] and b.num_computed_tokens == 0
    s.update(out)
    s.finish("a", None)
    assert kv.num_free_blocks == 8 and all(kv.pool.ref_count(i) == 0 for i in range(9))


def test_rollback_keeps_what_the_step_start_needs_and_writing_a_released_block_raises():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=False, windows=(None, 8))
    a = make_request("a", list(range(13)))
    compute(kv, a, 13)
    # 1 + 3 drafts from 13 (17 tokens): the sliding group releases 5 first, the full group reuses it
    assert kv.allocate_slots(a, 4) == [1, 2, 3, 4, 5, 0, 6, 7, 8, 9]
    kv.truncate(a, 15)  # two drafts rejected: back to 15 tokens, 4 blocks
    assert kv.group_block_ids("a") == [[1, 2, 3, 4], [0, 6, 7, 8]]
    a.num_computed_tokens = 14
    assert kv.allocate_slots(a, 1) == [1, 2, 3, 4, 0, 6, 7, 8]  # from 14: keys 7 on, block 1 on
    a.num_computed_tokens = 3  # back before the released block: a bug in the caller
    with pytest.raises(RuntimeError, match="would write a block its sliding window let go of"):
        kv.allocate_slots(a, 1)


def test_capacity_counts_a_sliding_group_up_to_its_window_and_one_steps_tokens():
    assert KVCacheManager(21, 4).num_token_capacity == 80
    # full: 1 block per 4 tokens; sliding: at most ceil((8 - 1 + 4) / 4) + 1 = 4 blocks
    assert KVCacheManager(21, 4, windows=(None, 8), max_num_batched_tokens=4).num_token_capacity == 64
    assert KVCacheManager(21, 4, windows=(None, 8)).num_token_capacity == 40  # unbounded steps: like full
    assert KVCacheManager(21, 4, windows=(8, 8), max_num_batched_tokens=4).num_token_capacity == NO_LIMIT


def test_a_batch_has_a_block_table_and_slot_mapping_per_group():
    # request 0: 3 new tokens from 13, full [1, 2, 3, 4], sliding [0, 0, 5, 6]; request 1: 2 from 0, [7], [8]
    batch = ForwardBatch.build([[1, 2, 3], [4, 5]], [13, 0], [[1, 2, 3, 4, 0, 0, 5, 6], [7, 8]], 4, num_groups=2)
    (full, full_slots), (sliding, sliding_slots) = batch.group_tables
    assert full.tolist() == [[1, 2, 3, 4], [7, 0, 0, 0]] and sliding.tolist() == [[0, 0, 5, 6], [8, 0, 0, 0]]
    assert full_slots.tolist() == [4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 7 * 4, 7 * 4 + 1]
    assert sliding_slots.tolist() == [6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3, 8 * 4, 8 * 4 + 1]
    assert batch.block_tables is full and batch.slot_mapping is full_slots  # group 0's, as the fields say
    assert ForwardBatch.build([[1]], [0], [[3]], 4).group_tables == ()  # one group: the fields only
