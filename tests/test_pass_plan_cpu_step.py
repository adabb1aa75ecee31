"""plan_cpu_step pass: the runs and reasons it records on a hand-built graph (an op, a kernel, a weight format, an
attribute step.cpp does not read, a lone node, a per-M table's row bound), the cuda no-op, idempotence (and a stale
plan replaced), the logits of a planned random Gemma 3 equal to the unplanned one's exactly, and `optc inspect`
showing the plan."""

import json

import pytest
import torch

from optc.core.formats import Format, quantized_format
from optc.core.ir import Graph, ModelConfig, Node, TensorInfo
from optc.frontend.passmanager import PassContext, make_pass
from optc.kernels import cpu_ext
from optc.runtime import Engine
from optc.runtime.batch import ForwardBatch
from optc.testing import build_artifact

BF16 = Format(dtype="bfloat16")
INT4 = quantized_format(4, "bfloat16", 32)
KV = {"layer": 0, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "kv_block_size": 16, "kv_dtype": "bfloat16",
      "kv_scales": "none"}
OP_LIST = "step.cpp runs linear, rms_norm, add_rms_norm, gated_act, rope_kv_store, attention, add, moe, mla_attention"


def _graph() -> Graph:
    config = ModelConfig("LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=16, vocab_size=256, rms_norm_eps=1e-5, rope_theta=1e4,
                         max_position_embeddings=512, tie_word_embeddings=False, dtype="bfloat16")
    cpp = {"kernel": "cpu.cpp_add_rms_norm", "eps": 1e-5}
    nodes = [
        Node("embed", "embedding", ["input_ids"], ["h"], {}, {"weight": "embed"}),
        Node("norm", "rms_norm", ["h"], ["x"], {"kernel": "cpu.cpp_rms_norm", "eps": 1e-5}, {"weight": "w"}),
        Node("qkv", "linear", ["x"], ["q", "k", "v"], {"kernel": "cpu.bf16dot", "in_features": 64,
                                                       "out_features": 128, "split": [64, 32, 32]}, {"weight": "wqkv"}),
        Node("rope", "rope_kv_store", ["q", "k", "v", "positions"], ["qr"], {"kernel": "cpu.cpp_rope_kv_store", **KV}),
        Node("attn", "attention", ["qr"], ["a"], {"kernel": "cpu.cpp_attention", "scale": 0.25, "kv_stored": True,
                                                  **KV}),
        # linear(a) {torch} [int4_g]: the reference dequantizes on every call -> left out
        Node("o", "linear", ["a"], ["o"], {"kernel": "torch", "in_features": 64, "out_features": 64},
             {"weight": "wo"}),
        Node("post", "add_rms_norm", ["h", "o"], ["m", "r"], cpp, {"weight": "w"}),  # alone
        Node("mla", "mla_attention", ["m"], ["e"], {"kernel": "torch", **KV, "kv_dtype": "int8", "kv_scales": "token",
                                                    "kv_lora_rank": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
                                                    "scale": 0.25, "eps": 1e-5}, {"kv_norm": "wn", "kv_b": "wkvb"}),
        Node("odd", "add_rms_norm", ["r", "e"], ["y", "z"], {**cpp, "bias_scale": 2.0}, {"weight": "w"}),
        Node("up", "linear", ["y"], ["g", "u"], {"kernel": "cpu.int4pack", "in_features": 64, "out_features": 256,
                                                 "split": [128, 128],
                                                 "kernel_by_m": [[1, "cpu.int4pack"], [None, "torch"]]},
             {"weight": "wup"}),
        Node("act", "gated_act", ["g", "u"], ["f"], {"kernel": "torch", "act": "gelu_tanh"}),
        Node("lm_head", "lm_head", ["f"], ["logits"], {}, {"weight": "embed"}),
    ]
    tensors = {"embed": TensorInfo((256, 64), BF16), "w": TensorInfo((64,), BF16), "wqkv": TensorInfo((128, 64), BF16),
               "wo": TensorInfo((64, 64), INT4), "wup": TensorInfo((256, 64), INT4), "wn": TensorInfo((16,), BF16),
               "wkvb": TensorInfo((128, 16), BF16)}
    return Graph(config, nodes, tensors)


def test_plan_records_runs_and_why_each_other_node_is_left_out():
    result = make_pass("plan_cpu_step").run(_graph(), None, PassContext(target="cpu"))
    assert result.changed
    plan = {n.name: {k: v for k, v in n.attrs.items() if k.startswith("step_")} for n in result.graph.nodes}
    assert plan == {
        "embed": {"step_left_out": f"op embedding ({OP_LIST})"},
        "norm": {"step_run": 0}, "qkv": {"step_run": 0}, "rope": {"step_run": 0}, "attn": {"step_run": 0},
        "o": {"step_left_out": "weight is int4_g/g32, not dense bfloat16 (what its reference reads as it is)"},
        "post": {"step_left_out": "a run of one node (nothing to fuse it with)"},
        "mla": {"step_left_out": "a int8 latent cache with scales token (step.cpp: bfloat16, none)"},
        "odd": {"step_left_out": "attribute bias_scale=2.0 (step.cpp does not read it)"},
        "up": {"step_run": 1, "step_max_rows": 1}, "act": {"step_run": 1},
        "lm_head": {"step_left_out": f"op lm_head ({OP_LIST})"},
    }
    assert result.stats == {"target": "cpu", "num_runs": 2, "num_fused_nodes": 6, "num_left_out": 6, "max_rows": 1,
                            "left_out": {k: 1 for k in sorted(v["step_left_out"] for v in plan.values()
                                                             if "step_left_out" in v)}}


def test_plan_is_a_no_op_on_cuda_and_idempotent():
    graph = _graph()
    cuda = make_pass("plan_cpu_step").run(graph, None, PassContext(target="cuda"))
    assert not cuda.changed and cuda.graph is graph
    p, ctx = make_pass("plan_cpu_step"), PassContext(target="cpu")
    once = p.run(graph, None, ctx)
    twice = p.run(once.graph, None, ctx)
    assert not twice.changed and twice.graph.to_json() == once.graph.to_json() and twice.stats == once.stats
    # a node rebound after planning: a new run replaces the stale plan on it
    once.graph.node("o").attrs["kernel"] = "cpu.int4pack"
    again = p.run(once.graph, None, ctx)
    assert again.changed and [n.attrs.get("step_run") for n in again.graph.nodes[1:7]] == [0] * 6


@pytest.mark.skipif(cpu_ext.load() is None,
                    reason="the C++ CPU kernels cannot be built here (no compiler/AVX2)")
def test_a_planned_model_gives_the_unplanned_logits_exactly_and_inspect_shows_the_plan(tmp_path):
    from optc.commands.inspect import render, summarize

    models = {}
    for planned in (False, True):
        recipe = tmp_path / f"{planned}.yaml"
        recipe.write_text("model: random:gemma3-tiny\ndtype: bfloat16\ntarget: cpu\npasses: [fuse_qkv, fuse_gate_up, "
                          "fuse_add_rmsnorm, fuse_rope_kv, kv_layout, {select_kernels: {measure: false}}"
                          f"{', plan_cpu_step' if planned else ''}]\n")
        models[planned] = build_artifact(tmp_path / str(planned), recipe)
    logits = {}
    for planned, art in models.items():
        model = Engine.load(art, enable_prefix_caching=False).model
        assert model.fused_runs == planned
        caches, num_groups = model.allocate_kv_caches(8, 16), len(model.kv_groups)
        blocks = [[1 + g for g in range(num_groups)]]  # a block per KV-cache group (sliding windows: their own)
        steps = [([[5, 9, 13, 200]], [0]), ([[7]], [4]), ([[3, 1, 4]], [5])]  # prompt, decode, verification rows
        logits[planned] = [model.forward(ForwardBatch.build(t, c, blocks, 16, [len(t[0])], num_groups), caches)
                           for t, c in steps]
    assert all(torch.equal(a, b) for a, b in zip(logits[False], logits[True], strict=True))
    manifest = json.loads((models[True] / "manifest.json").read_text())
    assert [p["stats"]["num_runs"] for p in manifest["passes"] if p["name"] == "plan_cpu_step"] == [1]
    text = render(summarize(models[True]))
    assert "cpu step   1 fused run(s), 40 of 42 nodes (plan_cpu_step)" in text
    assert "  run 0: model.layers.0.input_layernorm .. model.norm, 40 nodes (" in text
    assert "  left out x1 (lm_head): op lm_head (" in text
    assert "not planned" in render(summarize(models[False]))
