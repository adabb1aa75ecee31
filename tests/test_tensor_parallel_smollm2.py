"""SmolLM2 (9 query heads over 3 KV heads, 1536 MLP features) over tensor-parallel ranks, float32, gloo.

Its shapes split 1 or 3 ways only (2 cuts the heads, 9 the MLP), so N = 3 is the size under test:
- dense (recipes/smollm2-bf16.yaml in float32): a dozen windows of real text give one rank's greedy
  tokens batched and one at a time, through chunked prefill (32 tokens a step), preemption (a pool
  of 12 blocks) and ngram speculation; logits within 1e-4;
- the int4 format of the SmolLM2 recipes (groups of 64 with zero points; o_proj's 576 inputs give a
  rank 3 whole groups) with the int8 lm_head, bound to the packed CPU kernels at every M
  (`measure: false`): each rank prepares its own slices, the lm_head's exact top logits are
  recomputed per vocabulary shard before the gather; the same tokens, and logits within 2e-4 (logits
  reach 39: 1.3e-4 measured, the packed kernel's float32 sums split three ways).

bfloat16 is not compared token for token: each rank rounds its partial sums to bf16 before the
all-reduce, which moves SmolLM2's logits by up to 1.6, as much as binding the torch kernels instead
of the packed ones does (docs/PARALLEL.md)."""

from __future__ import annotations

import pydoc_data.topics

import pytest
from transformers import AutoTokenizer

from optc.core.artifact import read
from optc.core.ops.sharding import ShardError, allowed_sizes, plan_shards
from optc.core.settings import SpeculativeConfig
from optc.runtime import Engine, SamplingParams
from optc.testing import assert_close, assert_no_leaks, build_artifact

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=8)
OVERRIDES = {"max_num_batched_tokens": 32, "num_blocks": 12}
INT4 = ("passes=[fuse_qkv, fuse_gate_up, {quantize_rtn: {bits: 4, group_size: 64, zero_point: true}}, "
        "{quantize_lm_head: {bits: 8}}, fuse_add_rmsnorm, fuse_rope_kv, {kv_layout: {block_size: 16}}, "
        "{select_kernels: {measure: false}}]")


@pytest.fixture(scope="module")
def prompts(smollm2_f32_artifact) -> list[list[int]]:
    """12 windows of real text, 5 to 38 tokens long; the text repeats words, so ngram drafts come up."""
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_f32_artifact / "tokenizer"))
    ids = tokenizer(pydoc_data.topics.topics["assert"])["input_ids"]
    return [ids[9 * i: 9 * i + 5 + 3 * i] for i in range(12)]


def test_smollm2_splits_one_or_three_ways(smollm2_f32_artifact):
    graph = read(smollm2_f32_artifact).graph
    assert allowed_sizes(graph) == [1, 3]
    with pytest.raises(ShardError, match=r"gate_up_proj.weight \(dense \[3072, 576\]\) 9 ways: 1536 features"):
        plan_shards(graph, 0, 9)


@pytest.fixture(scope="class")  # one tensor-parallel group per process: closed before the int4 one starts
def dense(smollm2_f32_artifact):
    spec = SpeculativeConfig.parse("ngram")
    one = Engine.load(smollm2_f32_artifact, speculative=spec, **OVERRIDES)
    three = Engine.load(smollm2_f32_artifact, tensor_parallel_size=3, speculative=spec, **OVERRIDES)
    yield one, three
    three.close()


class TestDense:
    def test_smollm2_logits_at_three_ranks_match_one(self, dense, prompts):
        one, three = dense
        prompt = prompts[10]
        for args in (([prompt], [0], [[1, 2, 3]], [len(prompt)]), ([[9]], [len(prompt)], [[1, 2, 3]], [1])):
            assert_close(three.runner.forward(*args), one.runner.forward(*args), atol=1e-4,
                         what="SmolLM2 N=3 logits")

    def test_smollm2_greedy_tokens_at_three_ranks_match_one(self, dense, prompts):
        one, three = dense
        want = [c.token_ids for c in one.generate(prompts, PARAMS)]
        assert [c.token_ids for c in three.generate(prompts, PARAMS)] == want
        stats = three.stats()
        assert stats.num_preemptions > 0 and stats.num_draft_tokens > 0
        for i in (0, 11):
            assert three.generate([prompts[i]], PARAMS)[0].token_ids == want[i]
        assert_no_leaks(three)
        ranks = three.runner.rank_stats()
        assert len({(s.num_forwards, s.num_kv_blocks) for s in ranks}) == 1 and len(ranks) == 3


@pytest.fixture(scope="module")
def int4(tmp_path_factory, recipes, smollm2_hf_dir):
    artifact = build_artifact(tmp_path_factory.mktemp("smollm2-int4") / "a", recipes / "smollm2-rtn.yaml",
                              "dtype=float32", INT4)
    one = Engine.load(artifact, num_blocks=32)
    three = Engine.load(artifact, tensor_parallel_size=3, num_blocks=32)
    yield one, three
    three.close()


def test_smollm2_int4_with_int8_lm_head_on_packed_kernels_at_three_ranks(int4, prompts):
    one, three = int4
    kernels = {(n.op, n.kernel) for n in three.runner.model.graph.nodes if n.op in ("linear", "lm_head")}
    assert kernels == {("linear", "cpu.int4pack"), ("lm_head", "cpu.int8pack_logits")}
    prompt = prompts[10]
    for args in (([prompt], [0], [[1, 2, 3]], [len(prompt)]), ([[9]], [len(prompt)], [[1, 2, 3]], [1])):
        assert_close(three.runner.forward(*args), one.runner.forward(*args), atol=2e-4,
                     what="SmolLM2 int4 N=3 logits")
    few = prompts[::3]
    want = [c.token_ids for c in one.generate(few, PARAMS)]
    assert [c.token_ids for c in three.generate(few, PARAMS)] == want
    assert_no_leaks(three)
