"""EAGLE draft heads on random:tiny: the train_draft_head pass (deterministic given its seed, idempotent,
stored in the artifact), `--speculative eagle` greedy identical to plain decoding under batching,
chunked prefill, preemption, prefix caching and tensor parallelism, the sampled distribution preserved
(a chi-square test), and the refusals (a headless artifact, bad options)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from optc.core.artifact import read
from optc.core.errors import InputError
from optc.core.execute import Executor, bind_params
from optc.core.settings import SpeculativeConfig
from optc.frontend.passmanager import PassContext, make_pass
from optc.frontend.sources import load_source
from optc.passes._draft_data import data_executor, generate, target_outputs
from optc.passes._draft_training import _window_loss, chain_drafts, validate
from optc.runtime import Engine, SamplingParams
from optc.runtime.eagle import load_eagle_head
from optc.runtime.text import prompt_token_ids
from optc.testing import assert_no_leaks, assert_second_tokens_distributed, build_artifact

HEAD = "{train_draft_head: {steps: 80, samples: 6, validation_windows: 2, vocab_size: 200}}"
WITH_HEAD = f"passes=[fuse_qkv, fuse_gate_up, {HEAD}]"
CALIBRATION = ("calibration.samples=6", "calibration.seq_len=64")
TEXT = "The quick brown fox jumps over the lazy dog. "
PROMPTS = [TEXT * (1 + i % 3) + TEXT[: 5 + i] for i in range(6)] + [
    "".join(chr(33 + (i * 31 + j * 17) % 90) for j in range(6 + 3 * i)) for i in range(6)]
GREEDY = SamplingParams(max_tokens=24)
EAGLE = SpeculativeConfig("eagle", 4, disable_above_num_requests=32)
SMALL = {"max_num_batched_tokens": 32, "num_blocks": 24}  # chunked prefill and preemption


@pytest.fixture(scope="module")
def headed(tmp_path_factory, recipes) -> Path:
    """random:tiny with a briefly trained EAGLE head (its greedy tokens: the plain tiny model's)."""
    return build_artifact(tmp_path_factory.mktemp("eagle") / "a", recipes / "tiny.yaml", WITH_HEAD, *CALIBRATION)


@pytest.fixture(scope="module")
def plain(headed) -> list[list[int]]:
    return [c.token_ids for c in Engine.load(headed).generate(PROMPTS, GREEDY)]


def test_greedy_identical_with_an_int8_kv_cache(tmp_path, recipes):
    """The head reads features, not the KV cache: an int8 KV target drafts and verifies the same way."""
    path = build_artifact(tmp_path / "a", recipes / "tiny.yaml",
                          f"passes=[fuse_qkv, fuse_gate_up, {{kv_layout: {{dtype: int8}}}}, {HEAD}]", *CALIBRATION)
    expected = [c.token_ids for c in Engine.load(path).generate(PROMPTS, GREEDY)]
    engine = Engine.load(path, speculative=EAGLE, **SMALL)
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == expected
    assert engine.stats().num_accepted_tokens > 0
    assert_no_leaks(engine)


def _train(seed: int) -> tuple[dict, dict]:
    """The pass run directly on random:tiny over fixed random tokens: its weights and stats."""
    source = load_source("random:tiny")
    tokens = torch.randint(3, 256, (5, 48), generator=torch.Generator().manual_seed(1))
    ctx = PassContext(calibration_tokens=lambda: tokens)
    result = make_pass("train_draft_head", {"steps": 30, "samples": 5, "vocab_size": 64, "seed": seed}).run(
        source.graph, source.store, ctx)
    weights = {n: result.store.get(n) for n in result.graph.tensors if n.startswith("eagle.")}
    again = make_pass("train_draft_head").run(result.graph, result.store, ctx)
    assert not again.changed  # a graph with a head keeps it
    return weights, result.stats


def test_training_is_deterministic_given_the_seed():
    first, stats = _train(0)
    second, _ = _train(0)
    other, _ = _train(1)
    assert first.keys() == second.keys() and len(first) == 8
    assert all(torch.equal(first[n], second[n]) for n in first)
    assert not all(torch.equal(first[n], other[n]) for n in first)
    curve = stats["loss_curve"]
    assert curve[-1][0] == 30 and curve[-1][1] < curve[0][1]  # it learns
    assert len(stats["validation_acceptance_per_position"]) == 4


def test_the_loss_scores_only_the_positions_decoding_drafts_from(headed):
    """A prompt's next features and tokens (the chat template's, never drafted from) do not move the loss, at
    any unrolled level; an answer's do."""
    artifact = read(headed)
    executor = Executor(artifact.graph, bind_params(artifact.graph, artifact.store))
    tokens = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(2))
    features, greedy = target_outputs(executor, [tokens])
    proposer = Engine.load(headed, speculative=EAGLE).speculator.proposer
    head, o = proposer.head, make_pass("train_draft_head", {"unroll": 3, "enable_bf16": False}).options
    labels = greedy[0] % 200
    scored = torch.arange(24) >= 10  # positions 0..9: a prompt

    def loss(f: torch.Tensor, y: torch.Tensor) -> float:
        return float(_window_loss(head, tokens, features[0], f, y, scored, o))

    prompt_moved, answer_moved = features[0].clone(), features[0].clone()
    prompt_moved[:10] += 1.0
    answer_moved[12] += 1.0
    assert loss(prompt_moved, labels.where(scored, 0)) == loss(features[0], labels)
    assert loss(answer_moved, labels) != loss(features[0], labels)
    assert float(_window_loss(head, tokens[:8], features[0][:8], features[0][:8], labels[:8], scored[:8], o)) == 0


class _ByteChat:
    """A chat template over random:tiny's byte ids: a fixed header, the message's bytes, a fixed footer."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        return [1, 7, 7] + [3 + b % 250 for b in messages[0]["content"].encode()] + [2, 9]


def test_self_data_answers_the_first_prompts_and_validates_on_the_last(tmp_path):
    """data: self answers the prompts file's first `max_prompts` prompts (on the CPU kernels), trains on all but
    the last `validation_windows` answers and validates from those answers' positions only."""
    source = load_source("random:tiny")
    prompts = [f"prompt {i} " * (1 + i) for i in range(7)]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    ctx = PassContext(tokenizer=lambda: _ByteChat())
    options = {"data": "self", "prompts": str(tmp_path / "p.txt"), "max_prompts": 5, "answer_tokens": 12,
               "generate_batch": 2, "validation_windows": 2, "steps": 5, "vocab_size": 64}
    stats = make_pass("train_draft_head", options).run(source.graph, source.store, ctx).stats
    chats = [_ByteChat().apply_chat_template([{"content": p}], True, True, False) for p in prompts[:5]]
    answers = generate(data_executor(source.graph, source.store, ctx), source.graph, chats, 12)
    lengths = [len(a.token_ids) - 1 for a in answers]  # the last token has no feature
    assert (stats["train_tokens"], stats["validation_tokens"]) == (sum(lengths[:3]), sum(lengths[3:]))


def test_self_generated_answers_are_the_engines_greedy_tokens(tiny_artifact):
    """The pass's batched, KV-cached greedy generation (data: self) against the engine's, prompts of
    different lengths in one batch and over two batches; its features and greedy tokens against one dense
    forward over each whole sequence; the kernel-bound data executor against the references."""
    artifact = read(tiny_artifact)
    executor = Executor(artifact.graph, bind_params(artifact.graph, artifact.store))
    prompts = [[5, 17, 99], [3, 42, 7, 8, 200, 11, 12], [60] * 20]
    answers = generate(executor, artifact.graph, prompts, 10)
    expected = Engine.load(tiny_artifact).generate(prompts, SamplingParams(max_tokens=10))
    assert [a.token_ids.tolist() for a in answers] == [p + c.token_ids for p, c in zip(prompts, expected, strict=True)]
    features, greedy = target_outputs(executor, [a.token_ids for a in answers])
    for a, f, g in zip(answers, features, greedy, strict=True):
        p = a.prompt_len
        assert a.features.shape == (len(a.token_ids) - 1, f.shape[1])
        torch.testing.assert_close(a.features, f[:-1], rtol=1e-4, atol=1e-4)
        assert a.greedy[: p - 1].tolist() == [-1] * (p - 1) and torch.equal(a.greedy[p - 1 :], g[p - 1 : -1])
    assert [a.token_ids.tolist() for a in generate(executor, artifact.graph, prompts, 10, batch_size=2)] == [
        a.token_ids.tolist() for a in answers]
    bound = data_executor(artifact.graph, artifact.store, PassContext(target="cpu"))
    assert {n.kernel for n in bound.graph.nodes} > {"torch"}  # C++ kernels where they take a node
    assert [a.token_ids.tolist() for a in generate(bound, artifact.graph, prompts, 10)] == [
        a.token_ids.tolist() for a in answers]
    references = data_executor(artifact.graph, artifact.store, PassContext(target="cuda"))  # built off the GPU
    assert [a.token_ids.tolist() for a in generate(references, artifact.graph, prompts, 10)] == [
        a.token_ids.tolist() for a in answers]


def test_validation_drafts_what_decoding_drafts(headed):
    """The pass's validation proxy, from every position of an answer, against the runtime proposer on the
    same float32 target: the proposer's k drafts at every step equal the chain the proxy drafts from the
    same position (validation measures decoding, and decoding's head state follows the accepted tokens)."""
    engine = Engine.load(headed, speculative=SpeculativeConfig("eagle", 3, adaptive=False,
                                                               disable_above_num_requests=4))
    proposer = engine.speculator.proposer
    seen = []
    propose_one = proposer._propose_one

    def record(request, k):
        draft, q = propose_one(request, k)
        seen.append((request.num_computed_tokens, draft))
        return draft, q

    proposer._propose_one = record
    prompt = PROMPTS[1]
    token_ids = prompt_token_ids(engine.tokenizer, prompt)
    out = engine.generate([prompt], GREEDY)[0]
    sequence = torch.tensor(list(token_ids) + out.token_ids)
    artifact = read(headed)
    executor = Executor(artifact.graph, bind_params(artifact.graph, artifact.store))
    features, greedy = target_outputs(executor, [sequence])
    head = proposer.head
    assert len(seen) > 3 and seen[0][0] == len(token_ids)
    accepted = [0, 0, 0]
    for n, draft in seen:
        assert chain_drafts(head, sequence, features[0], n - 1, len(draft)) == draft, n
        for j, token in enumerate(draft):  # draft j stands for token n + 1 + j
            if token != sequence[n + 1 + j]:
                break
            accepted[j] += 1
    assert list(engine.stats().num_accepted_tokens_per_position) == accepted
    # the proxy from every answer position counts the chains chain_drafts gives
    start, k = len(token_ids) - 1, 3
    positions = range(start, len(sequence) - 1 - k)
    chains = {p: chain_drafts(head, sequence, features[0], p, k) for p in positions}
    expected = [sum(all(chains[p][i] == greedy[0][p + 1 + i] for i in range(j + 1)) for p in positions) / len(positions)
                for j in range(k)]
    assert validate(head, [sequence], features, greedy, [start], k, stride=1) == expected


def test_the_head_round_trips_through_the_artifact(headed):
    artifact = read(headed)
    section = artifact.manifest.draft_head
    assert section["method"] == "eagle" and len(section["config"]["vocab_ids"]) == 200
    assert section["training"]["train_tokens"] == 4 * 64
    names = [n for n in artifact.graph.tensors if n.startswith("eagle.")]
    assert len(names) == 8 and not set(names) & set(artifact.graph.used_tensors())  # beside the nodes
    engine = Engine.load(headed)
    head = load_eagle_head(artifact, engine.model)
    assert all(torch.equal(head.w[n.removeprefix("eagle.")], artifact.store.get(n)) for n in names)
    passes = json.loads((headed / "manifest.json").read_text())["passes"]
    assert [p["name"] for p in passes][-1] == "train_draft_head"


@pytest.mark.parametrize("config", [{}, SMALL, {"enable_prefix_caching": True}],
                         ids=["batch", "chunked-preempt", "prefix-caching"])
def test_greedy_identical_with_eagle(headed, plain, config):
    engine = Engine.load(headed, speculative=EAGLE, **config)
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == plain
    assert [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS[::3]] == plain[::3]  # batch 1, cached
    stats = engine.stats()
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    if "num_blocks" in config:
        assert stats.num_preemptions > 0
    if config.get("enable_prefix_caching"):
        assert stats.num_prefix_cache_hit_tokens > 0
    assert_no_leaks(engine)
    assert engine.speculator.proposer._states == {}  # every request's head state released


def test_greedy_identical_with_eagle_under_tensor_parallelism(headed, plain):
    """Rank 0 drafts from the whole features (replicated after each all-reduce) with the head's own copies of
    the target's embedding and lm_head rows (its model's are vocabulary slices)."""
    engine = Engine.load(headed, speculative=EAGLE, tensor_parallel_size=2)
    try:
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == plain
        assert engine.stats().num_accepted_tokens > 0
    finally:
        engine.close()


def test_sampling_matches_the_target_distribution(headed):
    """The second generated token (the first that verification emits) of 3000 seeded runs against its exact
    marginal sum_t1 p(t1) p(t2 | t1) under temperature 1, top_k 6: a chi-square test at p < 1e-4, a false
    alarm in 1 of 10,000 seed sets for a correct sampler (this seed set is fixed, so the test is deterministic)."""
    prompt = [5, 17, 99, 3, 42, 7]
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=4)
    spec = SpeculativeConfig("eagle", 3, disable_above_num_requests=4096, adaptive=False)
    engine = Engine.load(headed, speculative=spec)
    runs = engine.generate([prompt] * 3000, [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(3000)])
    assert engine.stats().num_drafts > 0
    assert_second_tokens_distributed(headed, prompt, params, [r.token_ids[1] for r in runs])


def test_metrics_report_the_speculative_counters(headed):
    from optc.runtime.server.metrics import Metrics

    engine = Engine.load(headed, speculative=EAGLE)
    engine.generate(PROMPTS[:2], GREEDY)
    stats = engine.stats()
    metrics = Metrics("m")
    metrics.bind(lambda: stats)
    text = metrics.render().decode()
    assert f'optc:spec_decode_num_drafts_total{{model_name="m"}} {float(stats.num_drafts)}' in text
    assert f'optc:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(stats.num_accepted_tokens)}' in text
    first = stats.num_accepted_tokens_per_position[0]
    assert f'optc:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {float(first)}' in text


def test_headless_artifact_is_refused(tiny_artifact):
    with pytest.raises(InputError, match="has no draft head.*train_draft_head"):
        Engine.load(tiny_artifact, speculative=SpeculativeConfig.parse("eagle"))


def test_parse_eagle():
    assert SpeculativeConfig.parse("eagle") == SpeculativeConfig("eagle", 4)
    assert SpeculativeConfig.parse("eagle:2").describe() == "eagle:2"
    with pytest.raises(InputError, match=r"expected eagle\[:K\]"):
        SpeculativeConfig.parse("eagle:x")
    with pytest.raises(InputError, match="takes no draft artifact"):
        SpeculativeConfig("eagle", draft="x")
    with pytest.raises(InputError, match="optimizer 'lamb'; allowed: adamw, sgd"):
        make_pass("train_draft_head", {"optimizer": "lamb"})
