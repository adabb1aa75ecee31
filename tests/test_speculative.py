"""Speculative decoding in the engine: greedy outputs identical with and without it (n-gram and draft
proposers, batch 1, mixed batches, chunked prefill, preemption), stops and limits inside an accepted
run, aborts, no leaked blocks in either pool, seeded sampling reproducible, the n-gram lookup, and
the errors of bad configs.

The toy target's next token depends on the last token, the position and the whole context read back
from the paged KV cache (it also asserts that every position it reads holds that position's token),
so its text repeats often enough for prompt lookup to be accepted and rejected, and a stale K/V
after a rollback changes the output or fails loudly. The toy draft is the same function without the
context term: it agrees with the target most of the time, not always.
"""


import pytest
import torch

from optc.core.errors import InputError
from optc.runtime import Engine, EngineConfig, SamplingParams
from optc.runtime.draft import DraftProposer
from optc.runtime.speculative import SpeculativeConfig, ngram_lookup
from optc.testing import assert_no_leaks
from tests.test_engine import EOS, VOCAB, ToyModel, ToyTokenizer


def toy_logits(context: list[int], mode: str = "exact") -> torch.Tensor:
    """mode exact: the target; draft: the target without its whole-context term; bigram: the last token only."""
    n = len(context)
    if mode == "bigram":  # a chain of 12 distinct tokens ends in EOS
        h = (context[-1] * 5 + 4) % (VOCAB - 1)
    else:
        h = (context[-1] * 7 + (n // 6) * 13 + (29 if mode == "exact" and sum(context) % 5 == 0 else 0)) % (VOCAB - 1)
    return ((h + 37 * torch.arange(VOCAB)) % VOCAB).float() / 4.0  # a permutation: unique argmax


def reference(prompt: list[int], max_tokens: int, mode: str = "exact") -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_tokens and (not out or out[-1] != EOS):
        out.append(int(toy_logits(tokens, mode).argmax()))
        tokens.append(out[-1])
    return out


# 24 prompts: repetitive ones (prompt lookup finds their continuation) and pseudo-random ones
PROMPTS = [[(i + j % (2 + i % 5)) % 60 + 1 for j in range(3 + 4 * i)] for i in range(12)] + [
    [(i * 13 + j * 7 + j * j) % 60 + 1 for j in range(1 + 5 * i)] for i in range(12)
]
GREEDY = SamplingParams(max_tokens=24)
CONFIGS = {
    "batch": {},
    "chunked8": {"max_num_batched_tokens": 8},
    "preempt": {"num_blocks": 40, "max_num_seqs": 8},  # 80 tokens (20 blocks) fit alone, not 8 of them
    "preempt-chunked8": {"num_blocks": 28, "max_num_batched_tokens": 8, "max_num_seqs": 8},
}


def speculative_engine(method: str, k: int = 4, adaptive: bool = False, mode: str = "exact", **config) -> Engine:
    target = ToyModel(lambda context: toy_logits(context, mode))
    spec = SpeculativeConfig(method, k, draft="toy" if method == "draft" else None, disable_above_num_requests=64,
                             adaptive=adaptive)
    draft = None
    if method == "draft":
        draft_mode = "draft" if mode == "exact" else mode
        draft = ToyModel(lambda context: toy_logits(context, draft_mode))
    return Engine(target, ToyTokenizer(), EngineConfig(**{"block_size": 4, **config}), spec, draft)


def assert_no_leaks_anywhere(engine: Engine) -> None:
    assert_no_leaks(engine)
    proposer = engine.speculator.proposer
    if isinstance(proposer, DraftProposer):
        assert proposer.kv_manager.num_used_blocks == 0 and not proposer._states


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return [reference(p, GREEDY.max_tokens) for p in PROMPTS]


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_greedy_is_identical_with_speculation(method, config, expected):
    engine = speculative_engine(method, **config)
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == expected
    stats = engine.stats()
    assert stats.num_generated_tokens == sum(map(len, expected))
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some accepted, some rolled back
    assert stats.spec_mean_acceptance_length == 1 + stats.num_accepted_tokens / stats.num_drafts
    assert list(stats.num_accepted_tokens_per_position) == sorted(stats.num_accepted_tokens_per_position,
                                                                   reverse=True)
    if "num_blocks" in config:
        assert stats.num_preemptions > 0
    assert_no_leaks_anywhere(engine)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_batch_one_and_adaptive(method, expected):
    engine = speculative_engine(method, k=3, adaptive=True)
    for prompt, tokens in zip(PROMPTS, expected, strict=True):
        assert engine.generate([prompt], GREEDY)[0].token_ids == tokens
    assert engine.stats().num_drafts > 0
    assert_no_leaks_anywhere(engine)


def test_mixed_with_non_speculating_requests(expected):
    """Sampled and max_tokens=1 requests share steps with speculating ones; the greedy ones are unchanged."""
    engine = speculative_engine("draft", max_num_batched_tokens=16)
    params = [GREEDY if i % 3 else SamplingParams(temperature=1.0, seed=i, max_tokens=5) for i in range(len(PROMPTS))]
    params[1] = SamplingParams(max_tokens=1)
    out = engine.generate(PROMPTS, params)
    for i, completion in enumerate(out):
        want = expected[i][: params[i].max_tokens] if params[i].is_greedy else None
        assert want is None or completion.token_ids == want
        assert len(completion.token_ids) <= params[i].max_tokens
    assert_no_leaks_anywhere(engine)


def eos_prompt() -> list[int]:
    """A bigram chain that ends in EOS, with its start repeated at its end: prompt lookup (and the bigram
    draft) propose the rest of the chain, so EOS, stop strings and max_tokens fall inside accepted runs."""
    chain = next(c for c in ([t, *reference([t], 30, "bigram")] for t in range(1, 57)) if len(c) > 8 and c[-1] == EOS)
    return chain[:-1] + chain[:2]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stops_and_limits_inside_an_accepted_run(method):
    engine = speculative_engine(method, k=8, mode="bigram")
    prompt = eos_prompt()
    want = reference(prompt, 30, "bigram")
    assert len(want) >= 6 and want[-1] == EOS
    out = engine.generate([prompt], SamplingParams(max_tokens=30))[0]
    assert out.token_ids == want and out.finish_reason == "stop"
    assert engine.stats().num_steps <= 3  # prefill, then accepted runs up to EOS
    out = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert len(out.token_ids) == 30 and out.token_ids[: len(want)] == want
    for max_tokens in range(1, len(want)):  # an accepted run never goes past max_tokens
        out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0]
        assert out.token_ids == want[:max_tokens] and out.finish_reason == "length"
    full = ToyTokenizer().decode(want)
    stop = full[3:5]
    out = engine.generate([prompt], SamplingParams(max_tokens=30, stop=stop))[0]
    cut = full.find(stop)
    assert out.text == full[:cut] and out.token_ids == want[: cut + len(stop)] and out.finish_reason == "stop"
    stats = engine.stats()
    assert stats.num_accepted_tokens_per_position[4] > 0
    assert_no_leaks_anywhere(engine)


def test_abort_mid_speculation():
    engine = speculative_engine("draft", k=4)
    requests = [engine.add_request(p, SamplingParams(max_tokens=40)) for p in PROMPTS[:6]]
    while engine.stats().num_drafts < 6:
        engine.step()
    draft = engine.speculator.proposer
    assert draft.kv_manager.num_used_blocks > 0
    for request in requests[::2]:
        assert engine.abort(request.request_id)
    engine.step()
    for request in requests[1::2]:
        engine.abort(request.request_id)
    assert_no_leaks_anywhere(engine)
    stream = engine.stream(PROMPTS[3], SamplingParams(max_tokens=40))
    next(stream), next(stream)
    stream.close()
    assert_no_leaks_anywhere(engine)


def test_no_leaks_after_200_mixed_requests():
    engine = speculative_engine("draft", adaptive=True, num_blocks=26, max_num_batched_tokens=24, max_num_seqs=12)
    g = torch.Generator().manual_seed(0)
    prompts, params = [], []
    for i in range(200):
        length = int(torch.randint(1, 40, (1,), generator=g))
        prompts.append(torch.randint(1, 60, (length,), generator=g).tolist() if i % 2 else PROMPTS[i % 24])
        params.append(SamplingParams(max_tokens=1 + i % 17, temperature=0.0 if i % 3 else 0.8, seed=i,
                                     stop=("ab",) if i % 7 == 0 else (), ignore_eos=i % 5 == 0))
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    num_steps = 0
    while engine.has_unfinished():
        engine.step()
        num_steps += 1
        if num_steps % 9 == 0:
            running = engine.scheduler.running
            if running:
                engine.abort(running[-1].request_id)
    assert all(r.is_finished for r in requests)
    assert all(r.num_output_tokens <= r.params.max_tokens for r in requests)
    assert engine.stats().num_preemptions > 0 and engine.stats().num_accepted_tokens > 0
    assert_no_leaks_anywhere(engine)


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 4, 1, 2, 3], 2, 4, 3) == [4, 1, 2]  # suffix 1 2 3 occurred at 0
    assert ngram_lookup([1, 2, 3, 4, 1, 2, 3], 2, 4, 10) == [4, 1, 2, 3]  # up to the end
    assert ngram_lookup([5, 6, 9, 5, 6, 7, 8, 5, 6], 2, 4, 2) == [7, 8]  # the latest occurrence
    assert ngram_lookup([1, 2, 3, 4, 5, 3], 2, 4, 3) == []  # 1-grams are below prompt_lookup_min
    assert ngram_lookup([1, 2, 3, 4, 5, 3], 1, 4, 3) == [4, 5, 3]
    assert ngram_lookup([7, 7, 7], 2, 4, 3) == [7]  # overlapping occurrence
    assert ngram_lookup([1], 2, 4, 3) == []


@pytest.mark.parametrize(
    "text, message",
    [
        ("ngram:0", "num_speculative_tokens must be in 1..16, got 0"),
        ("ngram:17", "num_speculative_tokens must be in 1..16, got 17"),
        ("medusa", "unknown speculative method 'medusa'; allowed: ngram, draft"),
        ("draft:", "expected draft:PATH[:K]"),
        ("ngram:x", "expected ngram[:K]"),
    ],
)
def test_bad_configs(text, message):
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig.parse(text)


def test_parse():
    assert SpeculativeConfig.parse("ngram") == SpeculativeConfig("ngram", 4)
    assert SpeculativeConfig.parse("ngram:7").num_speculative_tokens == 7
    assert SpeculativeConfig.parse("draft:a/b:c").draft == "a/b:c"
    spec = SpeculativeConfig.parse("draft:build/x:3")
    assert (spec.draft, spec.num_speculative_tokens, spec.describe()) == ("build/x", 3, "draft:build/x:3")
