"""fuse_rope_kv: structure on a hand-built graph, idempotence, and exact logits on random:tiny."""

import torch

from optc.core.execute import Executor, bind_params, run_dense
from optc.core.formats import Format
from optc.core.ir import Graph, ModelConfig, Node, TensorInfo
from optc.core.ops import verify
from optc.frontend.passmanager import PassContext, make_pass
from optc.frontend.sources import load_source

CONFIG = ModelConfig("LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=16, vocab_size=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=512, tie_word_embeddings=False)
HEADS = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16}


def _graph(k_rot_read_twice: bool = False) -> Graph:
    lin = lambda name, out: Node(name, "linear", ["h0"], [name], {"in_features": 64, "out_features": out},
                                 {"weight": f"{name}.weight"})
    nodes = [
        Node("embed", "embedding", ["input_ids"], ["h0"], {}, {"weight": "embed.weight"}),
        lin("q", 64), lin("k", 32), lin("v", 32),
        Node("l0.rope", "rope", ["q", "k", "positions"], ["q_rot", "k_rot"], dict(HEADS)),
        Node("l0.attention", "attention", ["q_rot", "k_rot", "v"], ["attn"],
             {"layer": 0, **HEADS, "scale": 0.25, "kv_block_size": 32, "kv_dtype": "float32"}),
        Node("lm_head", "lm_head", ["attn"], ["logits"], {}, {"weight": "head.weight"}),
    ]
    if k_rot_read_twice:
        nodes.insert(5, Node("probe", "add", ["k_rot", "k_rot"], ["k2"]))
    tensors = {"embed.weight": TensorInfo((256, 64), Format()), "head.weight": TensorInfo((256, 64), Format()),
               "q.weight": TensorInfo((64, 64), Format()), "k.weight": TensorInfo((32, 64), Format()),
               "v.weight": TensorInfo((32, 64), Format())}
    return Graph(CONFIG, nodes, tensors)


def test_fuse_rope_kv_structure():
    graph = _graph()
    result = make_pass("fuse_rope_kv").run(graph, None, PassContext())
    g = result.graph
    assert result.changed and result.stats == {"fused": 1}
    assert [n.op for n in g.nodes] == ["embedding", "linear", "linear", "linear", "rope_kv_store", "attention",
                                       "lm_head"]
    store = g.node("l0.rope_kv_store")
    assert (store.inputs, store.outputs) == (["q", "k", "v", "positions"], ["q_rot"])
    assert store.attrs == {"layer": 0, **HEADS, "kv_block_size": 32, "kv_dtype": "float32"}
    attn = g.node("l0.attention")
    assert attn.inputs == ["q_rot"] and attn.attrs["kv_stored"] is True
    verify(g)
    assert graph.node("l0.attention").inputs == ["q_rot", "k_rot", "v"]  # the input graph is untouched


def test_fuse_rope_kv_leaves_rope_whose_k_is_read_elsewhere():
    result = make_pass("fuse_rope_kv").run(_graph(k_rot_read_twice=True), None, PassContext())
    assert not result.changed and "rope" in [n.op for n in result.graph.nodes]


def test_fuse_rope_kv_is_idempotent():
    p = make_pass("fuse_rope_kv")
    once = p.run(_graph(), None, PassContext())
    twice = p.run(once.graph, None, PassContext())
    assert not twice.changed and twice.graph.to_json() == once.graph.to_json()


def test_fuse_rope_kv_logits_are_exact_on_random_tiny():
    src = load_source("random:tiny")
    qkv = make_pass("fuse_qkv").run(src.graph, src.store, PassContext())  # fused QKV: strided q/k/v views
    for graph, store in ((src.graph, src.store), (qkv.graph, qkv.store)):
        fused = make_pass("fuse_rope_kv").run(graph, store, PassContext())
        assert fused.stats == {"fused": graph.config.num_layers}
        ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(1))
        before = run_dense(Executor(graph, bind_params(graph, store)), ids)
        after = run_dense(Executor(fused.graph, bind_params(fused.graph, fused.store)), ids)
        assert torch.equal(before, after)
