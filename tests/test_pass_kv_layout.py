"""kv_layout: recorded attrs, manifest and stats on a hand-built graph; validation; idempotence; exact
logits on random:tiny."""

import pytest
import torch

from optc.core.execute import Executor, bind_params, run_dense
from optc.core.formats import Format
from optc.core.ir import Graph, ModelConfig, Node, TensorInfo
from optc.core.kv_cache import KVCacheSpec
from optc.frontend.passmanager import PassContext, make_pass
from optc.frontend.sources import load_source

HEADS = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16}


def _graph(head_dim: int = 16) -> Graph:
    config = ModelConfig("LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=head_dim, vocab_size=256, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False)
    heads = {**HEADS, "head_dim": head_dim}
    nodes = [
        Node("embed", "embedding", ["input_ids"], ["h0"], {}, {"weight": "embed.weight"}),
        Node("l0.attention", "attention", ["h0", "h0", "h0"], ["attn"], {"layer": 0, **heads, "scale": 0.25}),
        Node("lm_head", "lm_head", ["attn"], ["logits"], {}, {"weight": "head.weight"}),
    ]
    tensors = {"embed.weight": TensorInfo((256, 64), Format()), "head.weight": TensorInfo((256, 64), Format())}
    return Graph(config, nodes, tensors)


def test_kv_layout_records_block_size_and_dtype():
    graph = _graph()
    result = make_pass("kv_layout", {"block_size": 32, "dtype": "bfloat16"}).run(graph, None, PassContext())
    assert result.changed
    assert result.graph.node("l0.attention").attrs == {"layer": 0, **HEADS, "scale": 0.25,
                                                       "kv_block_size": 32, "kv_dtype": "bfloat16"}
    assert result.manifest == {"kv_layout": KVCacheSpec(32, "bfloat16")}
    assert result.stats == {"block_size": 32, "dtype": "bfloat16", "bytes_per_token": 1 * 2 * 2 * 16 * 2}
    assert "kv_block_size" not in graph.node("l0.attention").attrs  # the input graph is untouched
    default = make_pass("kv_layout").run(graph, None, PassContext(dtype="float16"))
    assert default.manifest == {"kv_layout": KVCacheSpec(16, "float16")}


def test_kv_layout_validates_block_size_and_head_rows_for_cuda():
    with pytest.raises(ValueError, match=r"block_size 8 is not allowed; allowed: \[16, 32\]"):
        make_pass("kv_layout", {"block_size": 8}).run(_graph(), None, PassContext())
    with pytest.raises(ValueError, match="head_dim 4 in float16 gives 8-byte rows"):
        make_pass("kv_layout", {"dtype": "float16"}).run(_graph(head_dim=4), None, PassContext(target="cuda"))
    make_pass("kv_layout", {"dtype": "float16"}).run(_graph(head_dim=4), None, PassContext(target="cpu"))


def test_kv_layout_is_idempotent_and_keeps_its_manifest_section():
    p = make_pass("kv_layout", {"block_size": 32})
    once = p.run(_graph(), None, PassContext())
    twice = p.run(once.graph, None, PassContext())
    assert not twice.changed and twice.graph.to_json() == once.graph.to_json()
    assert twice.manifest == once.manifest


def test_kv_layout_logits_are_exact_on_random_tiny():
    src = load_source("random:tiny")
    laid = make_pass("kv_layout", {"block_size": 32}).run(src.graph, src.store, PassContext())
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(2))
    before = run_dense(Executor(src.graph, bind_params(src.graph, src.store)), ids)
    after = run_dense(Executor(laid.graph, bind_params(laid.graph, laid.store)), ids)
    assert torch.equal(before, after)
