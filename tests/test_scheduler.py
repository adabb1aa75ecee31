"""Scheduler: token budget, chunked prefill, decodes first, max_num_seqs, FCFS, preemption, abort.

`step` plays the engine: schedule, mark computed, append a token to requests that caught up, and
finish them at max_tokens. It returns what was scheduled as (request id, new tokens) pairs.
"""

import pytest

from optc.runtime.kv_cache_manager import KVCacheManager
from optc.runtime.request import FinishReason, Request, RequestStatus
from optc.runtime.sampler import SamplingParams
from optc.runtime.scheduler import Scheduler, SchedulerConfig


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, prefix=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(max_num_seqs, budget), kv)


def add(scheduler: Scheduler, request_id: str, num_tokens: int, max_tokens: int = 4, first: int = 0) -> Request:
    request = Request(
        request_id, list(range(first, first + num_tokens)), SamplingParams(max_tokens=max_tokens), 1 << 20
    )
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler) -> list[tuple[str, int]]:
    out = scheduler.schedule()
    scheduler.update(out)
    for request in out.requests:
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(1000 + request.num_output_tokens)
            if request.num_output_tokens >= request.params.max_tokens:
                scheduler.finish(request.request_id, FinishReason.LENGTH)
    return list(zip((r.request_id for r in out.requests), out.num_new_tokens, strict=True))


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    kv = scheduler.kv_manager
    assert kv.num_free_blocks == kv.num_blocks - 1
    assert all(kv.pool.ref_count(i) == 0 for i in range(kv.num_blocks))


def test_token_budget_is_shared_and_prefills_are_chunked():
    s = make_scheduler(budget=16, prefix=False)
    for request_id in "abc":
        add(s, request_id, 10)
    assert step(s) == [("a", 10), ("b", 6)]
    assert step(s) == [("a", 1), ("b", 4), ("c", 10)]
    assert step(s) == [("a", 1), ("b", 1), ("c", 1)]


def test_long_prompt_is_prefilled_in_chunks_then_decodes():
    s = make_scheduler(budget=16)
    a = add(s, "a", 40, max_tokens=2)
    assert step(s) == [("a", 16)]
    assert a.num_output_tokens == 0 and a.num_computed_tokens == 16
    assert step(s) == [("a", 16)]
    assert step(s) == [("a", 8)]
    assert a.num_output_tokens == 1
    assert step(s) == [("a", 1)]
    assert a.is_finished and a.finish_reason is FinishReason.LENGTH
    assert step(s) == []
    assert_all_blocks_free(s)


def test_running_decodes_are_scheduled_before_new_prefills():
    s = make_scheduler(budget=16)
    add(s, "a", 5, max_tokens=10)
    add(s, "b", 6, max_tokens=10, first=100)
    assert step(s) == [("a", 5), ("b", 6)]
    add(s, "c", 30, first=200)
    add(s, "d", 30, first=300)
    # a and b decode first; c gets the rest of the budget; d waits.
    assert step(s) == [("a", 1), ("b", 1), ("c", 14)]
    assert step(s) == [("a", 1), ("b", 1), ("c", 14)]
    assert step(s) == [("a", 1), ("b", 1), ("c", 2), ("d", 12)]


def test_max_num_seqs_bounds_the_running_requests():
    s = make_scheduler(max_num_seqs=2)
    for request_id in "abc":
        add(s, request_id, 3, max_tokens=2)
    assert step(s) == [("a", 3), ("b", 3)]
    assert (s.num_running, s.num_waiting) == (2, 1)
    assert step(s) == [("a", 1), ("b", 1)]  # both finish
    assert step(s) == [("c", 3)]


def test_waiting_requests_are_admitted_first_come_first_served():
    s = make_scheduler(num_blocks=5, block_size=4)  # 4 usable blocks
    a = add(s, "a", 8, max_tokens=3)  # 2 blocks, then 3 once it decodes
    add(s, "b", 12, max_tokens=1, first=100)  # 3 blocks: does not fit next to a
    add(s, "c", 4, max_tokens=1, first=200)  # 1 block would fit, but c must not overtake b
    assert step(s) == [("a", 8)]
    assert step(s) == [("a", 1)]
    assert step(s) == [("a", 1)]
    assert a.is_finished
    assert step(s) == [("b", 12), ("c", 4)]
    assert_all_blocks_free(s)


def test_preemption_by_recompute_then_resume():
    s = make_scheduler(num_blocks=5, block_size=4, prefix=False)  # 4 usable blocks
    a = add(s, "a", 8, max_tokens=2)
    b = add(s, "b", 8, max_tokens=3, first=100)
    assert step(s) == [("a", 8), ("b", 8)]  # 2 blocks each, one token sampled each
    assert s.kv_manager.num_free_blocks == 0
    # a's 9th token needs a third block: b, the latest admitted, is preempted to make room.
    out = s.schedule()
    assert [(r.request_id, n) for r, n in zip(out.requests, out.num_new_tokens, strict=True)] == [("a", 1)]
    assert out.preempted_ids == ["b"] and out.block_ids == [[1, 2, 3]]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(s.waiting) == [b] and s.num_preemptions == 1
    assert s.kv_manager.block_ids("b") == [] and s.kv_manager.num_free_blocks == 1
    s.update(out)
    a.append_token(1001)
    s.finish("a", FinishReason.LENGTH)
    # b resumes: its prompt and its first output token are recomputed, then it goes on.
    assert b.token_ids == list(range(100, 108)) + [1000]
    assert step(s) == [("b", 9)]
    assert step(s) == [("b", 1)]
    assert b.is_finished and b.output_token_ids == [1000, 1001, 1002]
    assert s.num_computed_prompt_tokens == 8 + 8 + 8
    assert_all_blocks_free(s)


def test_preempted_request_resumes_from_its_cached_prefix():
    s = make_scheduler(num_blocks=6, block_size=4)  # 5 usable blocks
    a = add(s, "a", 8, max_tokens=2)
    b = add(s, "b", 8, max_tokens=3, first=100)
    assert step(s) == [("a", 8), ("b", 8)]  # a: [1, 2], b: [3, 4], all four full and cached
    assert step(s) == [("a", 1)]  # a takes block 5; b needs a block too and is preempted
    assert a.is_finished and b.status is RequestStatus.WAITING
    assert s.kv_manager.pool.free_block_ids() == [5, 4, 3, 2, 1]
    assert step(s) == [("b", 1)]  # its 8 prompt tokens hit the cache; only its output token runs
    assert b.num_cached_tokens == 8 and s.kv_manager.block_ids("b") == [3, 4, 5]
    assert step(s) == [("b", 1)]
    assert b.is_finished and b.output_token_ids == [1000, 1001, 1002]
    assert s.num_computed_prompt_tokens == 16 and s.num_computed_tokens == 16 + 1 + 1 + 1
    assert s.kv_manager.prefix_cache_hit_rate == pytest.approx(8 / (8 + 8 + 9))
    assert_all_blocks_free(s)


def test_abort_frees_running_and_waiting_requests():
    s = make_scheduler(max_num_seqs=1)
    add(s, "a", 6)
    add(s, "b", 6)
    assert step(s) == [("a", 6)]
    assert s.abort("b").finish_reason is FinishReason.ABORT
    assert s.abort("a").status is RequestStatus.FINISHED
    assert s.abort("a") is None and s.abort("nope") is None
    assert not s.has_unfinished() and step(s) == []
    assert_all_blocks_free(s)


def test_duplicate_request_id_and_bad_config_are_rejected():
    s = make_scheduler()
    add(s, "a", 3)
    with pytest.raises(ValueError, match="already in use"):
        add(s, "a", 3)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=0)
