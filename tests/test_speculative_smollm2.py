"""Speculative decoding on the real model: SmolLM2 (float32; bfloat16 on the C++ ops for prompt lookup) gives
the same greedy tokens with and without speculation, for prompt lookup and for its int4 RTN build as the
draft, on 24 chat prompts that mix input-grounded tasks (repeat, extract, summarize a given text, edit code)
and open ones; batched, at batch 1, and with chunked prefill and preemption; no leaked blocks in either
pool."""

from __future__ import annotations

import pydoc_data.topics

import pytest

from optc.runtime import Engine, SamplingParams
from optc.runtime.speculative import SpeculativeConfig
from optc.testing import assert_no_leaks, build_artifact, cpu_extension

GREEDY = SamplingParams(max_tokens=16)
CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)
'''
TASKS = ("Repeat the first sentence of this text word for word:", "Extract the Python keywords named in this text:",
         "Summarize this text in one sentence:")
OPEN = ("Write a haiku about autumn.", "Why do cats purr?", "Name three uses of a paperclip.",
        "What is the tallest mountain on Earth?", "Give me a tip for learning to cook.", "Tell me a joke.",
        "What is a good name for a dog?", "How does a rainbow form?")
PROMPTS = (
    [f"{task}\n\n{pydoc_data.topics.topics[topic][:600]}" for topic in ("assert", "for", "with", "import")
     for task in TASKS]
    + [f"Rename the function to `average` and return the code:\n\n{CODE}",
       f"Add type hints to this function and return the code:\n\n{CODE}",
       f"Add a docstring to this function:\n\n{CODE}", f"Repeat this code exactly:\n\n{CODE}"]
    + list(OPEN)
)


@pytest.fixture(scope="module")
def smollm2_rtn_artifact(tmp_path_factory, smollm2_hf_dir, recipes):
    return build_artifact(tmp_path_factory.mktemp("smollm2-rtn") / "a", recipes / "smollm2-rtn.yaml")


@pytest.fixture(scope="module")
def plain(smollm2_f32_artifact) -> list[list[int]]:
    engine = Engine.load(smollm2_f32_artifact)
    out = [c.token_ids for c in engine.generate(PROMPTS, GREEDY, chat=True)]
    assert_no_leaks(engine)
    return out


def spec(method: str, request) -> SpeculativeConfig:
    """k = 4, speculating at any batch size; the int4 draft is built only for method draft."""
    draft = request.getfixturevalue("smollm2_rtn_artifact") if method == "draft" else None
    return SpeculativeConfig(method, 4, draft=draft, disable_above_num_requests=64)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize(
    "config", [{}, {"num_blocks": 24, "max_num_batched_tokens": 64, "max_num_seqs": 8}], ids=["batch", "preempt"]
)
def test_smollm2_greedy_identical(smollm2_f32_artifact, plain, method, config, request):
    assert len(PROMPTS) >= 20
    engine = Engine.load(smollm2_f32_artifact, speculative=spec(method, request), **config)
    step = 3 if config else 1  # a third of the prompts when the pool holds about two requests
    assert [c.token_ids for c in engine.generate(PROMPTS[::step], GREEDY, chat=True)] == plain[::step]
    stats = engine.stats()
    assert stats.num_accepted_tokens > 0
    if "num_blocks" in config:
        assert stats.num_preemptions > 0
    assert_no_leaks(engine)
    if method == "draft":
        assert engine.speculator.proposer.kv_manager.num_used_blocks == 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_smollm2_batch_one(smollm2_f32_artifact, plain, method, request):
    engine = Engine.load(smollm2_f32_artifact, speculative=spec(method, request))
    for i in (0, 5, 13, 20):  # grounded, grounded, code, open
        assert engine.generate([PROMPTS[i]], GREEDY, chat=True)[0].token_ids == plain[i]
    assert engine.stats().num_accepted_tokens > 0
    assert_no_leaks(engine)


@pytest.mark.slow
def test_smollm2_bf16_greedy_identical(smollm2_bf16_artifact):
    """bfloat16 on the CPU's C++ ops (recipes/smollm2-bf16.yaml): verification rows are decode's bits
    (docs/ARCHITECTURE.md), so n-gram speculation keeps every greedy token, batched and at batch 1."""
    cpu_extension()  # bfloat16 identity is not guaranteed on the references
    artifact = smollm2_bf16_artifact
    plain = [c.token_ids for c in Engine.load(artifact).generate(PROMPTS, GREEDY, chat=True)]
    engine = Engine.load(artifact, speculative=SpeculativeConfig("ngram", 4, disable_above_num_requests=64))
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY, chat=True)] == plain
    assert [engine.generate([PROMPTS[i]], GREEDY, chat=True)[0].token_ids for i in (0, 13, 20)] == [
        plain[i] for i in (0, 13, 20)]
    assert engine.stats().num_accepted_tokens > 0
    assert_no_leaks(engine)
