"""EAGLE draft trees in the engine (`--speculative eagle-tree:D:TOPK:NODES`) on random:tiny in float32: the
batch's tree rows (positions at their depth, consecutive slots, ancestor bits), greedy output identical to plain
decoding under batching, chunked prefill, preemption and prefix caching, with optc's C++ tree attention, with
every node on its op reference (the masked SDPA path) and with the Triton kernels, an oracle tree whose accepted
path is never its first children (the path's K/V must move), the sampled distribution preserved (a chi-square
test), the adaptive depth's tree cost and the option."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from optc.core.errors import InputError
from optc.core.settings import TREE_DEPTH_COST, TREE_NODE_COST, SpeculativeConfig
from optc.runtime import Engine, SamplingParams
from optc.runtime.batch import ForwardBatch
from optc.runtime.speculative import Speculator, _Acceptance
from optc.testing import assert_no_leaks, assert_second_tokens_distributed, build_artifact

HEAD = "{train_draft_head: {steps: 80, samples: 6, validation_windows: 2, vocab_size: 200}}"
CALIBRATION = ("calibration.samples=6", "calibration.seq_len=64")
TEXT = "The quick brown fox jumps over the lazy dog. "
PROMPTS = [TEXT * (1 + i % 3) + TEXT[: 5 + i] for i in range(6)] + [
    "".join(chr(33 + (i * 31 + j * 17) % 90) for j in range(6 + 3 * i)) for i in range(6)
]
GREEDY = SamplingParams(max_tokens=24)
TREE = replace(SpeculativeConfig.parse("eagle-tree:4:2:10"), disable_above_num_requests=32)
SMALL = {"max_num_batched_tokens": 32, "num_blocks": 24}  # chunked prefill and preemption


@pytest.fixture(scope="module")
def headed(tmp_path_factory, recipes) -> Path:
    return build_artifact(
        tmp_path_factory.mktemp("eagle") / "a",
        recipes / "tiny.yaml",
        f"passes=[fuse_qkv, fuse_gate_up, {HEAD}]",
        *CALIBRATION,
    )


@pytest.fixture(scope="module")
def plain(headed) -> list[list[int]]:
    return [c.token_ids for c in Engine.load(headed).generate(PROMPTS, GREEDY)]


def test_a_tree_batch_rotates_at_depth_and_masks_to_ancestors():
    # request 0 decodes one token; request 1 verifies a tree: root, nodes 0 and 1 below it, node 2 below node 0
    batch = ForwardBatch.build([[7], [1, 2, 3, 4]], [5, 9], [[1], [2, 3]], 8, [1, 4], tree_parents=[None, [-1, -1, 0]])
    assert batch.positions.tolist() == [5, 9, 10, 10, 11]
    assert batch.slot_mapping.tolist() == [13, 25, 26, 27, 28]  # consecutive: block 3 holds positions 8..15
    assert batch.tree_mask.tolist() == [0b1, 0b1, 0b11, 0b101, 0b1011]
    assert batch.seq_lens.tolist() == [6, 13]
    assert ForwardBatch.build([[7]], [5], [[1]], 8).tree_mask is None


@pytest.mark.parametrize(
    "config",
    [{}, SMALL, {"enable_prefix_caching": True}, {"use_references": True}],
    ids=["batch", "chunked-preempt", "prefix-caching", "references"],
)
def test_greedy_identical_with_eagle_tree(headed, plain, config):
    expected = (
        plain
        if not config.get("use_references")
        else [c.token_ids for c in Engine.load(headed, use_references=True).generate(PROMPTS, GREEDY)]
    )
    engine = Engine.load(headed, speculative=TREE, **config)
    assert engine.speculator.use_tree
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == expected
    assert [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS[::3]] == expected[::3]  # batch 1, cached
    stats = engine.stats()
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert len(stats.num_accepted_tokens_per_position) == 4  # per depth
    if "num_blocks" in config:
        assert stats.num_preemptions > 0
    if config.get("enable_prefix_caching"):
        assert stats.num_prefix_cache_hit_tokens > 0
    assert_no_leaks(engine)
    assert engine.speculator.proposer._states == {}


def test_a_top_1_tree_is_the_chain_and_a_wider_tree_holds_it(headed):
    """Greedy drafts of one request, step after step: the top-1 tree of depth 4 is the chain of 4, and in a top-2
    tree the first children from the root follow the chain for as long as its nodes were expanded, and the
    head's entry of the best depth-1 node, expanded beside its sibling, is the chain's entry (each entry attends
    to the real entries and its ancestors only: seeing its sibling would change it)."""
    engine = Engine.load(headed, speculative=replace(TREE, adaptive=False))
    request = engine.add_request(PROMPTS[1], GREEDY)
    proposer, checked, followed = engine.speculator.proposer, 0, 0
    calls, forward = [], proposer.head.forward
    proposer.head.forward = lambda *args: calls.append(forward(*args)) or calls[-1]  # (features, (K, V))
    while not request.is_finished:
        engine.step()
        if request.is_finished or request.num_computed_tokens != request.num_tokens - 1:
            continue
        chain = proposer.propose([request], [4])[0][0]
        calls.clear()
        proposer.propose([request], [2])  # one head forward: the entry of the first draft
        proposer.propose_tree([request], [2], 2, [30])  # one head forward: both depth-1 nodes' entries
        (alone, _), (beside, _) = calls
        assert beside.shape[0] == 2 and torch.allclose(beside[:1], alone, rtol=1e-4, atol=1e-5)
        assert proposer.propose_tree([request], [4], 1, [4]) == [(chain, [-1, 0, 1, 2])]
        tokens, parents = proposer.propose_tree([request], [4], 2, [30])[0]
        assert len(tokens) == 2 + 2 * 2 * 3  # two nodes at depth 1, then the two best of each depth expanded
        node, path = -1, []
        while node in parents and len(path) < len(chain):
            node = parents.index(node)  # its first child: the most probable
            path.append(tokens[node])
        assert path and path == chain[: len(path)]  # ends where a chain node was not among its depth's best two
        checked, followed = checked + 1, followed + (len(path) == len(chain))
    assert checked > 5 and followed > 0


def test_a_target_without_the_mask_drafts_chains_of_the_depth(headed, plain):
    """Where the runner refuses trees (Model.takes_tree_mask false, tensor parallelism, CUDA graphs) a tree config
    drafts chains of its depth: no tree reaches a batch."""
    engine = Engine.load(headed, speculative=TREE)
    engine.speculator.allow_trees(False)
    engine.speculator.proposer.propose_tree = None  # a call would raise
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == plain
    assert engine.stats().num_accepted_tokens > 0


def test_greedy_identical_with_eagle_tree_on_the_triton_kernels(tmp_path, recipes):
    """A `target: cuda` build binds triton.paged_attention, which takes the tree mask (its prefill kernel's
    TREE variant; under TRITON_INTERPRET=1 here): its steps verify trees, and the greedy tokens are its own
    plain decoding's, batched and under chunked prefill (the interpreter is slow: six prompts)."""
    path = build_artifact(tmp_path / "a", recipes / "tiny.yaml", "target=cuda",
                          f"passes=[fuse_qkv, fuse_gate_up, {HEAD}, select_kernels]", *CALIBRATION)
    engine = Engine.load(path, device="cpu", speculative=TREE, **SMALL)
    assert "triton.paged_attention" in {n.attrs["kernel"] for n in engine.model.graph.nodes}
    assert engine.speculator.use_tree
    prompts = PROMPTS[6:]  # the drafts of these are accepted, those of the repeated sentence not yet
    plain = [c.token_ids for c in Engine.load(path, device="cpu").generate(prompts, GREEDY)]
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == plain
    assert engine.stats().num_accepted_tokens > 0
    assert_no_leaks(engine)


def test_tensor_parallelism_drafts_chains(headed, plain):
    """A tensor-parallel target takes no tree (its ranks' steps carry no mask): the tree config drafts chains."""
    engine = Engine.load(headed, speculative=TREE, tensor_parallel_size=2)
    try:
        assert not engine.speculator.use_tree
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == plain
        assert engine.stats().num_accepted_tokens > 0
    finally:
        engine.close()


class _Oracle:
    """Trees whose right token at each depth is the third node: a wrong sibling first, with a child that is the
    right token under the wrong parent (seen only through a broken mask), then the right node."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], vocab_size: int) -> None:
        self.expected, self.vocab_size = expected, vocab_size

    def propose_tree(self, requests, depths, top_k, budgets):
        trees = []
        for request, depth, budget in zip(requests, depths, budgets, strict=True):
            want = self.expected[tuple(request.prompt_token_ids)][request.num_output_tokens :]
            tokens, parents, right = [], [], -1
            for token in want[:depth]:
                wrong = (token + 1) % self.vocab_size
                tokens += [wrong, token, token]
                parents += [right, len(parents), right]
                right = len(parents) - 1
            trees.append((tokens[:budget], parents[:budget]))
        return trees

    def propose(self, requests, num_tokens):
        return [[] for _ in requests], [None for _ in requests]

    def release(self, request_id):
        pass


@pytest.mark.parametrize("use_references", [False, True])
def test_an_accepted_path_off_the_first_children_moves_its_kv(headed, use_references):
    """Every accepted node sits past its depth's slot, so each verification moves K/V; a wrong move or mask changes
    the tokens that follow."""
    base = Engine.load(headed, use_references=use_references)
    prompts = [base.tokenizer(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(max_tokens=24, logprobs=2)
    requests = [base.add_request(p, params) for p in prompts]
    while base.has_unfinished():
        base.step()
    expected = [r.output_token_ids for r in requests]
    engine = Engine.load(headed, use_references=use_references)
    config = replace(SpeculativeConfig.parse("eagle-tree:4:2:12"), disable_above_num_requests=32, adaptive=False)
    speculator = Speculator(
        config, _Oracle({tuple(p): e for p, e in zip(prompts, expected, strict=True)}, engine.vocab_size)
    )
    speculator.allow_trees(engine.model.takes_tree_mask)
    engine.runner.speculator = speculator
    tree_requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in tree_requests] == expected
    for plain_request, tree_request in zip(requests, tree_requests, strict=True):  # a path's rows, not node order
        for a, b in zip(plain_request.logprobs, tree_request.logprobs, strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert abs(a.logprob - b.logprob) < 1e-4
    stats = engine.stats()
    assert stats.num_accepted_tokens >= 3 * stats.num_drafts  # the oracle's paths: 4 deep but near the end
    assert_no_leaks(engine)


def test_sampling_matches_the_target_distribution(headed):
    """test_speculative_eagle's chi-square test with a tree (one-hot top-k nodes, siblings' residual carried): the
    second generated token of 3000 seeded runs against its exact marginal, at p < 1e-4 (a false alarm in 1 of
    10,000 seed sets for a correct sampler; the seed set is fixed, so the test is deterministic)."""
    prompt = [5, 17, 99, 3, 42, 7]
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=3)
    spec = replace(SpeculativeConfig.parse("eagle-tree:2:3:6"), disable_above_num_requests=4096, adaptive=False)
    engine = Engine.load(headed, speculative=spec)
    runs = engine.generate([prompt] * 3000, [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(3000)])
    assert engine.stats().num_drafts > 0 and engine.stats().num_accepted_tokens > 0
    assert_second_tokens_distributed(headed, prompt, params, [r.token_ids[1] for r in runs])


def test_the_adaptive_depth_charges_a_tree_per_node_and_per_depth():
    """A tree's cost is a verification row per node and a head forward per depth: a 4:2:10 tree of depth d and n
    nodes costs 1 + TREE_NODE_COST * n + TREE_DEPTH_COST * d steps, so at a per-depth acceptance of 0.3 it drafts
    nothing, at 0.6 one depth (two nodes) and at 0.95 all four; a doubled token_cost doubles both parts."""
    def speculator(text, **changes):
        s = Speculator(replace(SpeculativeConfig.parse(text), **changes), proposer=None)
        s.allow_trees(True)
        return s

    def chosen(s, rate):
        s._acceptance["r"] = _Acceptance(accepted=2 * rate, tried=2.0, measured=True)
        return s._choose_k("r")

    tree = speculator("eagle-tree:4:2:10")
    costs = [1.0 + TREE_NODE_COST * n + TREE_DEPTH_COST * d for d, n in enumerate((2, 6, 10, 10), 1)]
    assert tree._gain_denominators == pytest.approx([1.0, *costs])
    assert speculator("eagle-tree:4:2:10", token_cost=2 * tree.config.cost)._gain_denominators == pytest.approx(
        [1.0, *(1 + 2 * (c - 1) for c in costs)])
    assert [chosen(tree, a) for a in (0.3, 0.6, 0.95)] == [0, 1, 4]
    chain = Speculator(SpeculativeConfig.parse("eagle:4"), proposer=None)
    assert chain._gain_denominators == pytest.approx([1.0 + chain.config.cost * k for k in range(5)])


def test_a_costly_method_drafts_one_token_until_measured_then_follows_its_rate():
    """A draft model at 0.7 of a step: the prior acceptance (0.6) alone would never draft, so a fresh request
    probes with one token; a rejected probe stops it (and its rate drifts back to the prior without probing again),
    accepted ones raise k."""
    speculator = Speculator(SpeculativeConfig("draft", 4, draft="unused", token_cost=0.7), proposer=None)
    assert speculator._choose_k("fresh") == 1
    speculator._record("rejected", 1, 0)
    assert [speculator._choose_k("rejected") for _ in range(30)] == [0] * 30
    for _ in range(6):
        speculator._record("accepted", 1, 1)
    assert speculator._choose_k("accepted") > 1


def test_parse_eagle_tree():
    config = SpeculativeConfig.parse("eagle-tree:5:2:30")
    assert (config.method, config.num_speculative_tokens, config.tree_top_k, config.tree_num_nodes) == (
        "eagle",
        5,
        2,
        30,
    )
    assert config.describe() == "eagle-tree:5:2:30" and config.is_tree
    assert not SpeculativeConfig.parse("eagle:3").is_tree
    with pytest.raises(InputError, match="expected eagle-tree:D:TOPK:NODES"):
        SpeculativeConfig.parse("eagle-tree:5:2")
    with pytest.raises(InputError, match="NODES in 1..63"):
        SpeculativeConfig.parse("eagle-tree:5:2:64")
    with pytest.raises(InputError, match="drafts chains only"):
        SpeculativeConfig("ngram", 4, tree_top_k=2, tree_num_nodes=8)


@pytest.mark.parametrize("text", ["eagle:4", "eagle-tree:4:2:10"])
def test_constrained_greedy_identical_with_eagle_chains_and_trees(headed, plain, text):
    """A grammar's masks on every verification row (a tree's row after its path): greedy output is plain
    constrained decoding's. The grammar bans the character plain decoding writes most, so the head's drafts are
    often accepted and sometimes refused by the grammar."""
    from collections import Counter

    from optc.runtime.grammar import GrammarKind, GrammarSpec

    tokenizer = Engine.load(headed).tokenizer
    common = Counter("".join(tokenizer.decode(ids) for ids in plain).replace("\ufffd", "")).most_common(1)[0][0]
    params = SamplingParams(max_tokens=24, grammar=GrammarSpec(GrammarKind.REGEX, f"[^{re.escape(common)}]*"))
    expected = [c.token_ids for c in Engine.load(headed).generate(PROMPTS, params)]
    assert expected != plain
    config = replace(SpeculativeConfig.parse(text), disable_above_num_requests=32, adaptive=False)
    engine = Engine.load(headed, speculative=config)
    assert engine.speculator.use_tree == config.is_tree
    assert [c.token_ids for c in engine.generate(PROMPTS, params)] == expected
    stats = engine.stats()
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
