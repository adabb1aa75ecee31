"""fuse_add_rmsnorm: structure on a hand-built graph, idempotence, and exact logits on random:tiny."""

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


def _graph() -> Graph:
    norm = lambda name, x, out: Node(name, "rms_norm", [x], [out], {"eps": 1e-5}, {"weight": f"{name}.weight"})
    nodes = [
        Node("embed", "embedding", ["input_ids"], ["h0"], {}, {"weight": "embed.weight"}),
        norm("norm0", "h0", "a"),  # reads the embedding, not an add: stays
        Node("add1", "add", ["h0", "a"], ["s1"]),
        norm("norm1", "s1", "n1"),
        Node("add2", "add", ["s1", "n1"], ["s2"]),
        norm("norm2", "s2", "final"),
        Node("lm_head", "lm_head", ["final"], ["logits"], {}, {"weight": "head.weight"}),
    ]
    tensors = {f"norm{i}.weight": TensorInfo((64,), Format()) for i in range(3)}
    tensors |= {"embed.weight": TensorInfo((256, 64), Format()), "head.weight": TensorInfo((256, 64), Format())}
    return Graph(CONFIG, nodes, tensors)


def test_fuse_add_rmsnorm_structure():
    graph = _graph()
    result = make_pass("fuse_add_rmsnorm").run(graph, None, PassContext())
    g = result.graph
    assert result.changed and result.stats == {"fused": 2}
    assert [(n.name, n.op) for n in g.nodes] == [
        ("embed", "embedding"), ("norm0", "rms_norm"), ("norm1", "add_rms_norm"), ("norm2", "add_rms_norm"),
        ("lm_head", "lm_head")]
    assert (g.node("norm1").inputs, g.node("norm1").outputs) == (["h0", "a"], ["n1", "s1"])
    assert (g.node("norm2").inputs, g.node("norm2").outputs) == (["s1", "n1"], ["final", "s2"])
    assert g.node("norm2").params == {"weight": "norm2.weight"} and g.node("norm2").attrs == {"eps": 1e-5}
    verify(g)
    assert [n.op for n in graph.nodes].count("add") == 2  # the input graph is untouched


def test_fuse_add_rmsnorm_is_idempotent():
    p = make_pass("fuse_add_rmsnorm")
    once = p.run(_graph(), None, PassContext())
    twice = p.run(once.graph, None, PassContext())
    assert not twice.changed and twice.graph.to_json() == once.graph.to_json()


def test_fuse_add_rmsnorm_logits_are_exact_on_random_tiny():
    src = load_source("random:tiny")
    fused = make_pass("fuse_add_rmsnorm").run(src.graph, src.store, PassContext())
    assert fused.stats == {"fused": 2 * src.graph.config.num_layers}
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    before = run_dense(Executor(src.graph, bind_params(src.graph, src.store)), ids)
    after = run_dense(Executor(fused.graph, bind_params(fused.graph, fused.store)), ids)
    assert torch.equal(before, after)


def test_fused_norm_stays_in_the_block_of_its_linears():
    from optc.frontend.quant.blocks import split_blocks

    src = load_source("random:tiny")
    prefix, blocks = split_blocks(src.graph)  # the template: block i is every node of decoder layer i
    assert [n.name for n in prefix] == ["model.embed_tokens"]
    assert [[n.name.split(".")[2] for n in b.nodes] for b in blocks] == [["0"] * 14, ["1"] * 14]
    fused = make_pass("fuse_add_rmsnorm").run(src.graph, src.store, PassContext()).graph
    prefix, blocks = split_blocks(fused)
    # layer 0's mlp residual fused with layer 1's input norm: block 1 (where q/k/v read it), first
    assert blocks[1].nodes[0].name == "model.layers.1.input_layernorm" and blocks[1].nodes[0].op == "add_rms_norm"
    assert [n.attrs.get("layer") for n in fused.nodes if n.op == "add_rms_norm"] == [0, 1, 1, None]
    assert blocks[0].nodes[-1].name == "model.layers.0.mlp.down_proj"
