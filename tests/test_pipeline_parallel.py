"""Pipeline parallelism on the CPU (gloo, spawned ranks): a random Llama of 4 layers and 3 heads
(tiny_pp_artifact) cut into 2 stages gives one rank's greedy tokens at P = 2 and at P = 2 x T = 3 (6 ranks),
batched, through chunked prefill and preemption, with logits within 1e-4 and every rank running every
step; the stage cut is balanced by weight bytes; micro-batches split a step's requests by tokens.

Each parallel engine spawns its ranks once: the tests of a size share it (a process belongs to one
group at a time, so the sizes run one after the other)."""

from __future__ import annotations

import multiprocessing

import pytest

from optc.core.artifact import read
from optc.core.ops.stages import StageError, plan_stages, stage_graph
from optc.runtime import Engine, SamplingParams
from optc.runtime.pipeline import micro_batches
from optc.testing import assert_close, assert_no_leaks

# chunked prefill (32 tokens a step), a pool too small for every request at once (preemption), and every step of
# two requests or more cut into micro-batches
OVERRIDES = {"max_num_batched_tokens": 32, "num_blocks": 12, "pipeline_micro_batch_tokens": 1}
PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(4 + 9 * i)] for i in range(6)]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_pp_artifact):
    engine = Engine.load(tiny_pp_artifact, **OVERRIDES)
    logits = engine.runner.forward([PROMPTS[3][:20]], [0], [[1, 2]], [20]).clone()
    return [c.token_ids for c in engine.generate(PROMPTS, PARAMS)], logits


@pytest.fixture(scope="module", params=[(2, 1), (2, 3)], ids=["pp2", "pp2xtp3"])
def parallel(request, tiny_pp_artifact):
    pp, tp = request.param
    engine = Engine.load(tiny_pp_artifact, pipeline_parallel_size=pp, tensor_parallel_size=tp, **OVERRIDES)
    yield engine
    engine.close()
    assert not multiprocessing.active_children()


def test_stages_are_balanced_by_weight_bytes(tiny_pp_artifact):
    graph = read(tiny_pp_artifact, verify=False).graph
    stages = plan_stages(graph, 2)
    assert [s.layers for s in stages] == [(0, 2), (2, 4)]
    assert stages[0].sends == stages[1].receives == ("h.2",) and stages[1].sends == ("logits",)
    three = plan_stages(graph, 3)  # the embedding and the lm_head weigh a layer or more: their stages hold one
    assert [s.layers for s in three] == [(0, 1), (1, 3), (3, 4)]
    assert max(s.weight_bytes for s in three) < sum(s.weight_bytes for s in three) / 2
    first = stage_graph(graph, stages, 0)
    assert first.nodes[0].op == "embedding" and first.outputs == ("h.2",)
    assert all(n.attrs.get("layer", 0) < 2 for n in first.nodes)
    with pytest.raises(StageError, match="cannot cut 4 layers into 5 pipeline stages"):
        plan_stages(graph, 5)


def test_micro_batches_split_requests_by_tokens():
    assert micro_batches([1] * 16, 2) == [(0, 8), (8, 16)]
    assert micro_batches([30, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    assert micro_batches([5], 2) == [(0, 1)]  # one request: one micro-batch
    assert micro_batches([1, 1, 1], 4) == [(0, 1), (1, 2), (2, 3)]
    assert micro_batches([1] * 16, 2, min_tokens=64) == [(0, 16)]  # a small decode step stays whole
    assert micro_batches([100, 28], 2, min_tokens=64) == [(0, 1), (1, 2)]


def test_greedy_tokens_and_logits_match_one_rank(parallel, reference):
    tokens, logits = reference
    assert_close(parallel.runner.forward([PROMPTS[3][:20]], [0], [[1, 2]], [20]), logits, atol=1e-4,
                 what="pipeline-parallel logits")
    assert [c.token_ids for c in parallel.generate(PROMPTS, PARAMS)] == tokens
    assert parallel.stats().num_preemptions > 0  # the small pool preempted, and recomputation agreed
    assert_no_leaks(parallel)
    stats = parallel.runner.rank_stats()
    assert len({(s.num_forwards, s.num_kv_blocks) for s in stats}) == 1 and len(stats) == parallel.runner.group.size
    assert parallel.model.kv_layers == (0, 1)  # rank 0's stage holds its layers' caches only
    assert sum(c is not None for c in parallel.runner.kv_caches) == 2
