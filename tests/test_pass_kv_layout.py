"""kv_layout: recorded attrs, manifest and stats on a hand-built graph; validation; idempotence; exact
logits on random:tiny for a float layout, bounded ones for int8 / fp8 KV."""

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
                                                       "kv_block_size": 32, "kv_dtype": "bfloat16",
                                                       "kv_scales": "none"}
    assert result.manifest == {"kv_layout": KVCacheSpec(32, "bfloat16")}
    assert result.stats == {"block_size": 32, "dtype": "bfloat16", "scales": "none",
                            "bytes_per_token": 1 * 2 * 2 * 16 * 2}
    assert "kv_block_size" not in graph.node("l0.attention").attrs  # the input graph is untouched
    default = make_pass("kv_layout").run(graph, None, PassContext(dtype="float16"))
    assert default.manifest == {"kv_layout": KVCacheSpec(16, "float16")}


def test_kv_layout_records_int8_scales_and_where_they_live():
    result = make_pass("kv_layout", {"dtype": "int8"}).run(_graph(), None, PassContext(dtype="bfloat16"))
    attrs = result.graph.node("l0.attention").attrs
    assert {k: v for k, v in attrs.items() if k.startswith("kv_")} == {
        "kv_block_size": 16, "kv_dtype": "int8", "kv_scales": "per_token_head", "kv_scales_at": "block"}
    spec = result.manifest["kv_layout"]
    assert spec == KVCacheSpec(16, "int8", "per_token_head") and spec.is_quantized
    assert spec.to_json() == {"block_size": 16, "dtype": "int8", "scales": "per_token_head",
                              "scale_dtype": "float32", "scales_at": "block"}
    assert KVCacheSpec.from_json(spec.to_json()) == spec
    # per token and layer: K and V of 2 KV heads x 16 int8 values, plus an fp32 scale per (K|V, head)
    assert result.stats["bytes_per_token"] == 2 * 2 * 16 + 2 * 2 * 4
    # a float layout over it drops the scales' attrs
    back = make_pass("kv_layout", {"dtype": "bfloat16"}).run(result.graph, None, PassContext())
    assert back.changed and "kv_scales_at" not in back.graph.node("l0.attention").attrs


def test_kv_layout_validates_block_size_and_head_rows_for_cuda():
    with pytest.raises(ValueError, match=r"block_size 8 is not allowed; allowed: \[16, 32\]"):
        make_pass("kv_layout", {"block_size": 8}).run(_graph(), None, PassContext())
    with pytest.raises(ValueError, match="dtype float16 with head_dim 4 gives 8-byte rows"):
        make_pass("kv_layout", {"dtype": "float16"}).run(_graph(head_dim=4), None, PassContext(target="cuda"))
    make_pass("kv_layout", {"dtype": "float16"}).run(_graph(head_dim=4), None, PassContext(target="cpu"))
    # int8 rows of head_dim 8 are 8 bytes; the float dtypes' rows are 16 or 32: those are allowed
    with pytest.raises(ValueError, match=r"kv_layout: dtype int8 with head_dim 8 gives 8-byte rows; target cuda "
                                         r"needs a multiple of 16 bytes; allowed dtypes for this model: float32, "
                                         r"float16, bfloat16"):
        make_pass("kv_layout", {"dtype": "int8"}).run(_graph(head_dim=8), None, PassContext(target="cuda"))
    with pytest.raises(ValueError, match="dtype 'int4' is not allowed; allowed: float32, float16, bfloat16, "
                                         "int8, fp8_e4m3"):
        make_pass("kv_layout", {"dtype": "int4"}).run(_graph(), None, PassContext())


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


# bounds as a share of the largest |logit|: int8 keeps ~8 bits per value, e4m3 4 significant bits
@pytest.mark.parametrize("dtype,bound", [("int8", 0.01), ("fp8_e4m3", 0.05)])
def test_kv_layout_quantized_kv_logits_within_bound_on_random_tiny(dtype, bound):
    # run_dense stores into transient caches of the layout the graph records: int8 / fp8 K/V
    src = load_source("random:tiny")
    laid = make_pass("kv_layout", {"dtype": dtype}).run(src.graph, src.store, PassContext())
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    before = run_dense(Executor(src.graph, bind_params(src.graph, src.store)), ids)
    after = run_dense(Executor(laid.graph, bind_params(laid.graph, laid.store)), ids)
    diff = (after - before).abs().max().item() / before.abs().max().item()
    assert 0 < diff < bound, diff  # quantized (not equal), within the format's bound


def test_kv_layout_lists_the_kv_cache_groups_of_a_model_with_sliding_layers():
    graph = load_source("random:gemma3-tiny").graph  # sliding, sliding, full; window 12; 1 KV head x 32
    stats = make_pass("kv_layout", {"block_size": 16}).run(graph, None, PassContext(dtype="float32")).stats
    assert stats["groups"] == [{"window": None, "layers": [2]}, {"window": 12, "layers": [0]},
                               {"window": 12, "layers": [1]}]
    assert stats["bytes_per_block"] == 2 * 16 * 1 * 32 * 4  # one layer per block: the groups share the pool
    assert stats["bytes_per_token"] == 3 * 2 * 1 * 32 * 4  # a token held by every layer
