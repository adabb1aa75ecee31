"""Tensor-parallel sharding without processes: each rank's graph (heads, slices, inserted
collectives), quantized weights sliced along their own axes, the errors for models that do not
split, and the step message rank 0 broadcasts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from optc.core.formats import Format, dequantize, quantized_format
from optc.core.ir import TensorInfo
from optc.core.ops import OPS
from optc.core.ops.sharding import PARTITIONS, ShardError, allowed_sizes, plan_shards, rank_weight_bytes, shard
from optc.frontend.sources import load_source
from optc.runtime.step_message import decode_step, encode_step


@pytest.fixture(scope="module")
def tiny():
    return load_source("random:tiny")  # 4 query heads over 2 KV heads, unfused


@pytest.fixture(scope="module")
def tiny_fused(tiny_artifact):
    from optc.core.artifact import read

    return read(tiny_artifact)


def test_every_op_declares_a_partition():
    assert set(PARTITIONS) == set(OPS)


def test_rank_graph_of_fused_tiny_at_two(tiny_fused):
    plan = plan_shards(tiny_fused.graph, 1, 2)
    g = plan.graph
    assert (g.config.num_heads, g.config.num_kv_heads, g.config.vocab_size) == (2, 1, 256)
    ops = [n.op for n in g.nodes]
    # one all_reduce after the embedding and after each row-parallel linear (o_proj, down_proj) of 2 layers
    assert ops.count("all_reduce") == 5 and ops.count("all_gather") == 1 and ops[-1] == "all_gather"
    qkv = g.node("model.layers.0.self_attn.qkv_proj")
    assert qkv.attrs["split"] == [32, 16, 16] and qkv.attrs["out_features"] == 64
    # rank 1: query heads 2, 3 (rows 32..64), KV head 1 of k (64 + 16..32) and of v (96 + 16..32)
    assert plan.slices["model.layers.0.self_attn.qkv_proj.weight"] == (0, ((32, 64), (80, 96), (112, 128)))
    assert plan.slices["model.layers.0.self_attn.o_proj.weight"] == (1, ((32, 64),))
    assert plan.slices["model.layers.0.mlp.gate_up_proj.weight"] == (0, ((64, 128), (192, 256)))
    assert plan.slices["model.layers.0.mlp.down_proj.weight"] == (1, ((64, 128),))
    assert plan.slices["lm_head.weight"] == (0, ((128, 256),))
    assert g.node("model.embed_tokens").attrs["vocab_start"] == 128
    assert g.node("model.layers.0.self_attn.attention").attrs["num_kv_heads"] == 1
    assert "model.layers.0.input_layernorm.weight" not in plan.slices  # norms are replicated
    assert g.tensors["model.layers.0.self_attn.qkv_proj.weight"].shape == (64, 64)
    full = rank_weight_bytes(tiny_fused.graph)
    assert full // 2 < rank_weight_bytes(g) < full  # the norms are on every rank


def test_kv_heads_replicate_when_ranks_outnumber_them(tiny):
    kv_rows = [plan_shards(tiny.graph, r, 4).slices["model.layers.1.self_attn.k_proj.weight"] for r in range(4)]
    assert kv_rows == [(0, ((0, 16),)), (0, ((0, 16),)), (0, ((16, 32),)), (0, ((16, 32),))]
    q_rows = [plan_shards(tiny.graph, r, 4).slices["model.layers.1.self_attn.q_proj.weight"] for r in range(4)]
    assert q_rows == [(0, ((16 * r, 16 * r + 16),)) for r in range(4)]
    assert plan_shards(tiny.graph, 3, 4).graph.config.num_kv_heads == 1


def test_a_size_that_does_not_divide_names_what_and_the_sizes_that_work(tiny):
    assert allowed_sizes(tiny.graph) == [1, 2, 4]
    with pytest.raises(ShardError, match=r"4 query heads do not split evenly.*sizes that work for this model: 1, 2, 4"):
        plan_shards(tiny.graph, 0, 3)


def test_int4_groups_are_never_cut(tiny):
    """tiny's o_proj has 64 inputs: 2 ranks take one group of 32 each, 4 ranks would cut a group."""
    graph = tiny.graph.copy()
    fmt = quantized_format(4, group_size=32)
    for name, info in graph.tensors.items():
        if name.endswith("proj.weight"):
            graph.tensors[name] = TensorInfo(info.shape, fmt)
    assert allowed_sizes(graph) == [1, 2]
    with pytest.raises(ShardError) as e:
        plan_shards(graph, 0, 4)
    message = str(e.value)
    assert "model.layers.0.self_attn.o_proj.weight (int4_g [64, 64])" in message
    assert "a slice at 16 of dimension 64 cuts a stored unit of 32 (int4_g part scales)" in message
    assert message.endswith("sizes that work for this model: 1, 2")


@pytest.mark.parametrize("fmt", [Format(), quantized_format(8), quantized_format(4, group_size=32, zero_point=True)],
                         ids=["dense", "int8", "int4"])
def test_weight_slices_dequantize_to_the_slices_of_the_weight(fmt):
    """Rows and columns of a quantized weight, sliced part by part, are the dense weight's slices."""
    torch.manual_seed(0)
    shape = (48, 128)
    w = torch.randn(shape)
    if fmt.is_quantized:
        q, s, z = _rtn(w, fmt)
        parts = fmt.scheme.pack(q, s, z, fmt)
    else:
        parts = {"weight": w}
    dense = dequantize(parts, fmt, torch.float32)
    for axis, ranges in ((0, ((8, 16), (40, 48))), (1, ((32, 64),))):
        sliced = fmt.scheme.part_slices(fmt, shape, axis, ranges)
        got = {}
        for role, part in parts.items():
            if role in sliced:
                a, rs = sliced[role]
                part = torch.cat([part.narrow(a, x, y - x) for x, y in rs], a)
            got[role] = part
        want = torch.cat([dense.narrow(axis, x, y - x) for x, y in ranges], axis)
        assert torch.equal(dequantize(got, fmt, torch.float32), want)


def test_act_order_int4_cannot_split_its_inputs():
    fmt = quantized_format(4, group_size=32, act_order=True)
    with pytest.raises(ValueError, match="permuted"):
        fmt.scheme.part_slices(fmt, (32, 64), 1, ((0, 32),))
    assert set(fmt.scheme.part_slices(fmt, (32, 64), 0, ((0, 16),))) == {"qweight", "scales"}


def test_shard_store_loads_only_the_ranks_slices(tiny):
    graph, store = shard(tiny.graph, tiny.store, 1, 2)
    w = tiny.store.get("model.layers.0.mlp.down_proj.weight")
    assert torch.equal(store.get("model.layers.0.mlp.down_proj.weight"), w[:, 64:])
    assert store.entry("model.layers.0.mlp.down_proj.weight").shape == (64, 64)
    emb = tiny.store.get("model.embed_tokens.weight")
    assert torch.equal(store.get("model.embed_tokens.weight"), emb[128:])
    # a group of one (torchrun --nproc-per-node 1): the collectives, every tensor whole
    graph, store = shard(tiny.graph, tiny.store, 0, 1)
    assert store is tiny.store and graph.tensors == tiny.graph.tensors
    assert [n.op for n in graph.nodes].count("all_reduce") == 5 and graph.nodes[-1].op == "all_gather"


def test_row_parallel_bias_is_added_on_rank_zero_only(tiny):
    graph = tiny.graph.copy()
    node = graph.node("model.layers.0.self_attn.o_proj")
    node.params["bias"] = "o_bias"
    graph.tensors["o_bias"] = TensorInfo((64,), Format())
    has_bias = ["bias" in plan_shards(graph, r, 2).graph.node(node.name).params for r in range(2)]
    assert has_bias == [True, False]


def test_vocab_shards_may_be_uneven():
    src = load_source("random:tiny")
    graph = dataclasses.replace(src.graph, config=dataclasses.replace(src.graph.config, vocab_size=250))
    graph.tensors = {**graph.tensors, "lm_head.weight": TensorInfo((250, 64), Format())}
    assert [plan_shards(graph, r, 4).slices["lm_head.weight"] for r in range(4)] == [
        (0, ((0, 63),)), (0, ((63, 126),)), (0, ((126, 189),)), (0, ((189, 250),))]


def test_step_message_round_trips():
    args = ([(3, 5), (7, 9)], [[1, 2, 3], [4]], [0, 17], [[2, 3], [4, 6, 8]], [1, 2])
    header, body = encode_step(*args)
    assert header.tolist() == [2, 2, 4, 5] and body.dtype == torch.int64
    assert decode_step(header, body) == args
    assert decode_step(*encode_step([], [[5]], [0], [[1]], None)) == ([], [[5]], [0], [[1]], [1])


def _rtn(w: torch.Tensor, fmt: Format):
    n, k = w.shape
    g = fmt.scheme.group_width(fmt, k)
    s, z = fmt.scheme.group_params(w.view(n, k // g, g), fmt)
    lo, hi = fmt.scheme.qrange(fmt)
    q = torch.clamp(torch.round(w.view(n, k // g, g) / s[..., None]) + z[..., None], lo, hi).view(n, k)
    return q, s, z


def test_inspect_shows_each_ranks_slices_and_bytes(tiny_artifact):
    from optc.commands.inspect import render, summarize

    tp = summarize(tiny_artifact, 4)["tensor_parallel"]
    assert tp["slices"]["model.layers.0.self_attn.o_proj.weight"] == [
        {"axis": 1, "ranges": [[16 * r, 16 * r + 16]]} for r in range(4)]
    assert len(set(tp["rank_weight_bytes"])) == 1 and tp["rank_weight_bytes"][0] > 0
    assert "model.layers.1.mlp.down_proj.weight" in render(summarize(tiny_artifact, 2))
    with pytest.raises(ShardError, match="3 ways"):
        summarize(tiny_artifact, 3)


def test_a_recipe_records_its_tensor_parallel_size(tmp_path, recipes):
    from optc.core.artifact import read
    from optc.runtime.config import EngineConfig
    from optc.testing import build_artifact

    path = build_artifact(tmp_path / "a", recipes / "tiny.yaml", "runtime.tensor_parallel_size=2")
    manifest = read(path).manifest
    assert manifest.runtime.tensor_parallel_size == 2
    assert EngineConfig.from_manifest(manifest).tensor_parallel_size == 2
    assert EngineConfig.from_manifest(manifest, tensor_parallel_size=1).tensor_parallel_size == 1
    with pytest.raises(ShardError, match=r"^runtime.tensor_parallel_size 3: cannot split attention .* 3 ways"):
        build_artifact(tmp_path / "b", recipes / "tiny.yaml", "runtime.tensor_parallel_size=3")
    assert not (tmp_path / "b").exists()
