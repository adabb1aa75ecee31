"""Logprobs: `compute_logprobs` against log_softmax, and the engine's prompt and output logprobs
against the toy model's own distribution (test_engine.py), through chunked prefill, batching,
preemption, and a prefix that is in the cache; max_tokens 0 scores the prompt and generates nothing."""

import pytest
import torch

from optc.runtime import Engine, EngineConfig, SamplingParams
from optc.runtime.sampler import compute_logprobs
from optc.testing import assert_no_leaks
from tests.test_engine import PROMPTS, ToyModel, ToyTokenizer, reference, toy_logits


def test_compute_logprobs_is_log_softmax_and_top():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.0, 5.0, -1.0]])
    out = compute_logprobs(logits, torch.tensor([0, 2]), 2)
    expected = logits.log_softmax(-1)
    assert [e.token_id for e in out] == [0, 2]
    assert out[0].logprob == pytest.approx(float(expected[0, 0]))
    assert [t for t, _ in out[0].top] == [1, 2] and [t for t, _ in out[1].top] == [2, 0]
    assert out[0].top[0][1] == pytest.approx(float(expected[0, 1]))
    assert compute_logprobs(logits, torch.tensor([3, 3]), 0)[1].top == ()


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0


def _expected(tokens: list[int], position: int) -> float:
    return float(toy_logits(tokens[:position]).log_softmax(-1)[tokens[position]])


@pytest.mark.parametrize(
    "config", [{}, {"max_num_batched_tokens": 7}, {"num_blocks": 24, "max_num_batched_tokens": 16}],
    ids=["plain", "chunked7", "preempt"],
)
def test_prompt_and_output_logprobs_match_the_model(config):
    engine = Engine(ToyModel(), ToyTokenizer(), EngineConfig(block_size=4, **config))
    engine.generate([PROMPTS[6]], SamplingParams(max_tokens=2))  # PROMPTS[6]'s blocks now in the prefix cache
    params = [SamplingParams(max_tokens=5, logprobs=2, prompt_logprobs=1), SamplingParams(max_tokens=5)]
    prompts = [PROMPTS[i] for i in (6, 9, 12, 15)]
    requests = [engine.add_request(p, params[i % 2]) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    for i, request in enumerate(requests):
        assert request.output_token_ids == reference(prompts[i], 5)
        if i % 2:
            assert request.prompt_logprobs == [] and request.logprobs == []
            continue
        tokens = request.token_ids
        assert request.prompt_logprobs[0] is None and len(request.prompt_logprobs) == len(prompts[i])
        for p in range(1, len(prompts[i])):
            entry = request.prompt_logprobs[p]
            assert entry.token_id == tokens[p] and entry.logprob == pytest.approx(_expected(tokens, p), abs=1e-5)
            assert len(entry.top) == 1 and entry.top[0][0] == int(toy_logits(tokens[:p]).argmax())
        assert [e.token_id for e in request.logprobs] == request.output_token_ids
        for j, entry in enumerate(request.logprobs):
            p = len(prompts[i]) + j
            assert entry.logprob == pytest.approx(_expected(tokens, p), abs=1e-5) and len(entry.top) == 2
    assert_no_leaks(engine)


def test_max_tokens_zero_scores_the_prompt_only():
    engine = Engine(ToyModel(), ToyTokenizer(), EngineConfig(block_size=4, max_num_batched_tokens=8))
    request = engine.add_request(PROMPTS[5], SamplingParams(max_tokens=0, prompt_logprobs=0))
    other = engine.add_request(PROMPTS[3], SamplingParams(max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    assert request.output_token_ids == [] and str(request.finish_reason) == "length"
    assert [e.logprob for e in request.prompt_logprobs[1:]] == pytest.approx(
        [_expected(PROMPTS[5], p) for p in range(1, len(PROMPTS[5]))], abs=1e-5)
    assert other.output_token_ids == reference(PROMPTS[3], 3)
    assert engine.stats().num_generated_tokens == 3
    assert_no_leaks(engine)
