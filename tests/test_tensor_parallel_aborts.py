"""200 mixed requests on random:tiny at N = 2 (gloo): greedy and seeded sampling, logprobs, prompt
logprobs, shared prefixes, chunked prefill, preemption, and aborts before, during and after prefill.
Every request ends as it does on one rank (tokens, finish reason), rank 0's KV manager ends with 0
blocks in use, and every rank ran the same forwards over a pool of the same size."""

from __future__ import annotations

import random

from optc.runtime import Engine, SamplingParams
from optc.testing import assert_no_leaks

OVERRIDES = {"max_num_batched_tokens": 32, "max_num_seqs": 8, "num_blocks": 12}
NUM_REQUESTS = 200


def test_mixed_requests_with_aborts_match_one_rank_and_free_every_block(tiny_artifact):
    want = _drive(Engine.load(tiny_artifact, **OVERRIDES))
    engine = Engine.load(tiny_artifact, tensor_parallel_size=2, **OVERRIDES)
    try:
        got = _drive(engine)
        stats = engine.runner.rank_stats()
        assert_no_leaks(engine)
        num_preemptions = engine.stats().num_preemptions
    finally:
        engine.close()
    assert got == want
    reasons = [reason for reason, _ in got.values()]
    assert reasons.count("abort") >= 40 and reasons.count("length") >= 100
    assert num_preemptions > 0
    assert [s.rank for s in stats] == [0, 1]
    assert stats[0].num_forwards > NUM_REQUESTS // 2 and stats[1].num_forwards == stats[0].num_forwards
    assert stats[0].num_kv_blocks == stats[1].num_kv_blocks == OVERRIDES["num_blocks"]


def _drive(engine: Engine) -> dict[str, tuple[str, list[int]]]:
    """Add the requests a few per step, abort some at a planned step; -> id -> (finish reason, tokens)."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 256) for _ in range(20)] for _ in range(3)]  # prefix cache hits
    requests, abort_at, step = {}, {}, 0
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(1, 256) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.3:
            prompt = rng.choice(prefixes) + prompt
        temperature = rng.choice([0.0, 0.0, 0.9])
        params = SamplingParams(max_tokens=rng.randint(1, 10), temperature=temperature, seed=i, ignore_eos=True,
                                logprobs=rng.choice([None, None, 2]),
                                prompt_logprobs=1 if rng.random() < 0.1 else None)
        requests[str(i)] = engine.add_request(prompt, params, request_id=str(i))
        if rng.random() < 0.3:
            abort_at[str(i)] = step + rng.randint(0, 8)
        if i % 3 == 2:
            step = _step(engine, step, abort_at)
    while engine.has_unfinished():
        step = _step(engine, step, abort_at)
    return {i: (str(r.finish_reason), list(r.output_token_ids)) for i, r in requests.items()}


def _step(engine: Engine, step: int, abort_at: dict[str, int]) -> int:
    for request_id in [i for i, at in abort_at.items() if at == step]:
        engine.abort(request_id)
    if engine.has_unfinished():
        engine.step()
    return step + 1
