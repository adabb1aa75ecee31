"""Tensor parallelism end to end on the CPU (gloo, spawned ranks): random:tiny (4 query heads over 2
KV heads) at N = 2 (KV heads split) and N = 4 (KV heads replicated) gives N = 1's greedy tokens,
batched and one at a time, through chunked prefill, preemption and ngram speculation, with logits
within 1e-4.

Each engine spawns its ranks once (a few seconds): the engines are shared by the tests of a size."""

from __future__ import annotations

import pytest

from optc.core.settings import SpeculativeConfig
from optc.runtime import Engine, SamplingParams
from optc.testing import assert_close, assert_no_leaks

# chunked prefill (32 tokens a step) and a pool too small for every request at once (preemption)
OVERRIDES = {"max_num_batched_tokens": 32, "num_blocks": 14}
PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(3 + 5 * i)] for i in range(10)] + [
    [5, 6, 7, 8] * 6, [40, 41, 42, 43, 44] * 5]  # repeats: ngram drafts get proposed
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_artifact):
    engine = Engine.load(tiny_artifact, **OVERRIDES)
    return engine, [c.token_ids for c in engine.generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module", params=[(2, None), (4, "ngram")], ids=["tp2", "tp4-ngram"])
def parallel(request, tiny_artifact):
    size, speculative = request.param
    spec = SpeculativeConfig.parse(speculative) if speculative else None
    engine = Engine.load(tiny_artifact, tensor_parallel_size=size, speculative=spec, **OVERRIDES)
    yield engine
    engine.close()
    assert not any(w.is_alive() for w in engine.runner.group.workers)


def test_logits_match_one_rank(parallel, reference):
    """A prefill of 20 tokens (every row) then a decode step, on fresh blocks: logits within 1e-4."""
    one = reference[0]
    prompt = PROMPTS[4][:20]
    for engine_args in (([prompt], [0], [[1, 2]], [20]), ([[9]], [20], [[1, 2]], [1])):
        want = one.runner.forward(*engine_args)
        got = parallel.runner.forward(*engine_args)
        assert_close(got, want, atol=1e-4, what="tensor-parallel logits")


def test_greedy_tokens_match_one_rank_batched(parallel, reference):
    got = [c.token_ids for c in parallel.generate(PROMPTS, PARAMS)]
    assert got == reference[1]
    assert parallel.stats().num_preemptions > 0  # the small pool preempted, and recomputation agreed
    assert_no_leaks(parallel)


def test_greedy_tokens_match_one_rank_one_at_a_time(parallel, reference):
    for i in (0, 5, 10, 11):
        assert parallel.generate([PROMPTS[i]], PARAMS)[0].token_ids == reference[1][i]
    if parallel.speculator is not None:
        assert parallel.stats().num_draft_tokens > 0
    assert_no_leaks(parallel)


def test_abort_mid_stream_frees_every_block(parallel):
    stream = parallel.stream(PROMPTS[5], PARAMS)
    next(stream)
    stream.close()
    assert_no_leaks(parallel)
