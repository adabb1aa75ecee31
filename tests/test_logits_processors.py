"""Penalties, logit_bias, min_tokens and stop_token_ids: the pure shaping function on hand-made logits, then the
engine's greedy tokens against a reference loop that applies the same rules to random:tiny's own logits."""

import pytest
import torch

from optc.core.errors import InputError
from optc.runtime.engine import Engine
from optc.runtime.logits_processors import RowTokens, row_histories, shape
from optc.runtime.request import Request
from optc.runtime.sampler import SamplingParams

NEG_INF = float("-inf")


def request(params: SamplingParams, prompt: list[int], output: list[int], drafts: list[int] = ()) -> Request:
    r = Request("r", prompt, params, max_num_tokens=64)
    for t in output:
        r.append_token(t)
    r.draft_token_ids = list(drafts)
    return r


def test_repetition_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    r = request(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    assert shape(logits, [RowTokens(r)], ()).tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_presence_and_frequency_count_only_the_output():
    logits = torch.zeros(1, 4)
    r = request(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[3, 3], output=[1, 1, 2])
    assert shape(logits, [RowTokens(r)], ()).tolist() == [[0.0, -1.0, -0.75, 0.0]]


def test_drafts_before_a_row_count_as_output():
    logits = torch.zeros(3, 4)
    r = request(SamplingParams(frequency_penalty=1.0), prompt=[0], output=[1], drafts=[2, 2])
    rows = [RowTokens(r, d) for d in row_histories(r, None)]
    assert shape(logits, rows, ()).tolist() == [[0, -1, 0, 0], [0, -1, -1, 0], [0, -1, -2, 0]]


def test_a_trees_rows_follow_their_paths():
    r = request(SamplingParams(), prompt=[0], output=[], drafts=[5, 6, 7])
    assert row_histories(r, [-1, -1, 0]) == [[], [5], [6], [5, 7]]


def test_logit_bias_and_min_tokens():
    logits = torch.zeros(1, 5)
    params = SamplingParams(logit_bias=((1, 3.0), (2, -100.0)), min_tokens=2, stop_token_ids=(4,))
    r = request(params, prompt=[0], output=[1])
    assert shape(logits, [RowTokens(r)], eos_token_ids=(0,)).tolist() == [[NEG_INF, 3.0, -100.0, 0.0, NEG_INF]]
    r = request(params, prompt=[0], output=[1, 1])  # two output tokens: EOS and stop ids are allowed again
    assert shape(logits, [RowTokens(r)], eos_token_ids=(0,)).tolist() == [[0.0, 3.0, -100.0, 0.0, 0.0]]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
])
def test_out_of_range_params_name_their_field(kwargs, field):
    with pytest.raises(InputError) as error:
        SamplingParams(**kwargs)
    assert error.value.field == field


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    return Engine.load(tiny_artifact)


def reference_greedy(engine: Engine, prompt: list[int], params: SamplingParams, max_tokens: int) -> list[int]:
    """Greedy decoding, one whole-sequence forward a token, with the rules applied by hand to its logits."""
    from optc.testing import prefill_logits

    tokens: list[int] = []
    for _ in range(max_tokens):
        logits = prefill_logits(engine.model, prompt + tokens).clone()
        for t in set(prompt + tokens):
            value = logits[t]
            logits[t] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        for t in set(tokens):
            logits[t] -= params.presence_penalty + params.frequency_penalty * tokens.count(t)
        for t, bias in params.logit_bias:
            logits[t] += bias
        if len(tokens) < params.min_tokens:
            logits[list(params.stop_token_ids)] = NEG_INF
        tokens.append(int(logits.argmax()))
        if tokens[-1] in params.stop_token_ids:
            break
    return tokens


@pytest.mark.parametrize("kwargs", [
    {"presence_penalty": -2.0}, {"frequency_penalty": -1.0}, {"repetition_penalty": 0.2},
    {"logit_bias": ((40, 4.0), (41, -50.0))},
])
def test_engine_greedy_tokens_equal_the_reference(engine, kwargs):
    prompt = [5, 9, 5, 7, 5, 9]
    params = SamplingParams(max_tokens=12, **kwargs)
    plain = engine.generate([prompt], SamplingParams(max_tokens=12))[0].token_ids
    shaped = engine.generate([prompt, [3, 4]], [params, SamplingParams(max_tokens=12)])[0].token_ids  # batched
    assert shaped == reference_greedy(engine, prompt, params, 12)
    assert shaped != plain  # the rule changed something


def test_stop_token_ids_end_the_request_and_min_tokens_delays_them(engine):
    prompt = [5, 9, 5, 7]
    plain = engine.generate([prompt], SamplingParams(max_tokens=12))[0].token_ids
    stop = plain[3]
    first = plain.index(stop)
    out = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=(stop,)))[0]
    assert out.token_ids == plain[: first + 1] and out.finish_reason == "stop"
    params = SamplingParams(max_tokens=12, stop_token_ids=(stop,), min_tokens=first + 2)
    out = engine.generate([prompt], params)[0]
    assert out.token_ids == reference_greedy(engine, prompt, params, 12)
    assert stop not in out.token_ids[: first + 2]


def test_token_ids_outside_the_vocabulary_are_input_errors(engine):
    for params, field in ((SamplingParams(logit_bias=((999, 1.0),)), "logit_bias"),
                          (SamplingParams(stop_token_ids=(256,)), "stop_token_ids")):
        with pytest.raises(InputError) as error:
            engine.generate([[1, 2]], params)
        assert error.value.field == field


def test_siblings_of_one_prompt_reuse_its_computed_blocks(engine):
    """n completions: the first computes the prompt; the others find its full blocks in the prefix cache."""
    prompt = list(range(10, 10 + 40))  # 2 full blocks of 16 and 8 tokens
    before = engine.stats().num_computed_prompt_tokens
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=s) for s in (1, 2, 3)]
    requests = engine.add_requests(prompt, params, ["n0", "n1", "n2"])
    while engine.has_unfinished():
        engine.step()
    assert all(r.finish_reason is not None for r in requests)
    assert engine.stats().num_computed_prompt_tokens - before == 40 + 2 * 8
    assert len({tuple(r.output_token_ids) for r in requests}) > 1  # each its own seed
