"""SmolLM2 (9 query heads over 3 KV heads: 1, 3 and 9 ranks split it; 3 is tested) in float32 at
N = 3 (gloo, one process group for the module): one rank's greedy tokens on real text, batched and
one at a time, and its logits within 1e-4."""

from __future__ import annotations

import pydoc_data.topics

import pytest
from transformers import AutoTokenizer

from optc.runtime import Engine, SamplingParams
from optc.testing import assert_close, assert_no_leaks

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def prompts(smollm2_f32_artifact) -> list[list[int]]:
    """4 windows of real text, 5 to 35 tokens long."""
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_f32_artifact / "tokenizer"))
    ids = tokenizer(pydoc_data.topics.topics["assert"])["input_ids"]
    return [ids[9 * i: 9 * i + 5 + 10 * i] for i in range(4)]


@pytest.fixture(scope="module")
def engines(smollm2_f32_artifact):
    one = Engine.load(smollm2_f32_artifact, num_blocks=32)
    three = Engine.load(smollm2_f32_artifact, tensor_parallel_size=3, num_blocks=32)
    yield one, three
    three.close()


def test_smollm2_logits_at_three_ranks_match_one(engines, prompts):
    one, three = engines
    prompt = prompts[3]
    for args in (([prompt], [0], [[1, 2, 3]], [len(prompt)]), ([[9]], [len(prompt)], [[1, 2, 3]], [1])):
        assert_close(three.runner.forward(*args), one.runner.forward(*args), atol=1e-4, what="SmolLM2 N=3 logits")


def test_smollm2_greedy_tokens_at_three_ranks_match_one(engines, prompts):
    one, three = engines
    want = [c.token_ids for c in one.generate(prompts, PARAMS)]
    assert [c.token_ids for c in three.generate(prompts, PARAMS)] == want
    for i in (0, 3):
        assert three.generate([prompts[i]], PARAMS)[0].token_ids == want[i]
    assert_no_leaks(three)
    stats = three.runner.rank_stats()
    assert len({(s.num_forwards, s.num_kv_blocks) for s in stats}) == 1 and len(stats) == 3
