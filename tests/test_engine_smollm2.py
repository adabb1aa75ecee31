"""The serving engine on the real model: SmolLM2 (float32) batched equals single, with chunked prefill
and with preemption, prefix caching, and no leaked blocks."""

from __future__ import annotations

import pydoc_data.topics

import pytest
from transformers import AutoTokenizer

from optc.runtime import Engine, SamplingParams
from optc.testing import assert_no_leaks

GREEDY = SamplingParams(max_tokens=12)


@pytest.fixture(scope="module")
def prompts(smollm2_f32_artifact) -> list[list[int]]:
    """16 windows of real text, 3 to 78 tokens long."""
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_f32_artifact / "tokenizer"))
    ids = tokenizer(pydoc_data.topics.topics["assert"])["input_ids"]
    return [ids[7 * i : 7 * i + 3 + 5 * i] for i in range(16)]


@pytest.fixture(scope="module")
def singles(smollm2_f32_artifact, prompts):
    engine = Engine.load(smollm2_f32_artifact, enable_prefix_caching=False)
    out = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert_no_leaks(engine)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [{}, {"max_num_batched_tokens": 16}, {"num_blocks": 12, "max_num_batched_tokens": 16, "max_num_seqs": 8}],
    ids=["plain", "chunked16", "preempt-chunked16"],
)
def test_smollm2_batched_equals_single(smollm2_f32_artifact, prompts, singles, config):
    engine = Engine.load(smollm2_f32_artifact, **config)
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == singles
    if "num_blocks" in config:
        assert engine.stats().num_preemptions > 0
    assert_no_leaks(engine)


@pytest.mark.slow
def test_smollm2_prefix_hit_computes_only_the_rest(smollm2_f32_artifact, prompts):
    engine = Engine.load(smollm2_f32_artifact)
    shared = (prompts[-1] * 2)[:64]  # 4 full blocks of 16
    engine.generate([shared + prompts[0]], GREEDY)
    before = engine.stats()
    out = engine.generate([shared + prompts[1]], GREEDY)[0]
    assert engine.stats().num_computed_prompt_tokens - before.num_computed_prompt_tokens == len(prompts[1])
    cold = Engine.load(smollm2_f32_artifact, enable_prefix_caching=False)
    assert out.token_ids == cold.generate([shared + prompts[1]], GREEDY)[0].token_ids
    assert_no_leaks(engine)
