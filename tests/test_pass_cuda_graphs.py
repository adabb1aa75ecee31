"""cuda_graphs pass: recorded buckets and stats on a hand-built graph, option validation, the cpu
no-op, idempotence, unchanged logits on random:tiny, and the section in a built artifact."""

import json

import pytest
import torch

from optc.core.execute import Executor, bind_params, run_dense
from optc.core.formats import Format
from optc.core.ir import Graph, ModelConfig, Node, TensorInfo
from optc.frontend.passmanager import PassContext, make_pass
from optc.frontend.recipe import RecipeError, resolve_passes
from optc.frontend.sources import load_source

HEADS = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16}


def _graph(kernel: str | None = None) -> Graph:
    config = ModelConfig("LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=16, vocab_size=256, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False)
    attn = {"layer": 0, **HEADS, "scale": 0.25, **({"kernel": kernel} if kernel else {})}
    nodes = [
        Node("embed", "embedding", ["input_ids"], ["h0"], {}, {"weight": "embed.weight"}),
        Node("l0.attention", "attention", ["h0", "h0", "h0"], ["attn"], attn),
        Node("lm_head", "lm_head", ["attn"], ["logits"], {}, {"weight": "head.weight"}),
    ]
    tensors = {"embed.weight": TensorInfo((256, 64), Format()), "head.weight": TensorInfo((256, 64), Format())}
    return Graph(config, nodes, tensors)


def test_cuda_graphs_records_sorted_unique_buckets_for_cuda():
    graph = _graph("triton.paged_attention")
    before = json.dumps(graph.to_json(), sort_keys=True)
    result = make_pass("cuda_graphs", {"batch_sizes": [8, 1, 4, 4, 2]}).run(graph, None, PassContext(target="cuda"))
    assert not result.changed and result.graph is graph
    assert result.manifest == {"cuda_graphs": {"batch_sizes": [1, 2, 4, 8]}}
    assert result.stats == {"target": "cuda", "batch_sizes": [1, 2, 4, 8], "num_buckets": 4,
                            "num_eager_only_nodes": 0}
    assert json.dumps(graph.to_json(), sort_keys=True) == before  # nothing rewritten
    default = make_pass("cuda_graphs").run(graph, None, PassContext(target="cuda"))
    assert default.manifest == {"cuda_graphs": {"batch_sizes": [1, 2, 4, 8, 16, 32, 64]}}


def test_cuda_graphs_counts_kv_nodes_left_on_syncing_references():
    said = []
    ctx = PassContext(target="cuda", progress=said.append)
    result = make_pass("cuda_graphs", {"batch_sizes": [1]}).run(_graph(), None, ctx)
    assert result.stats["num_eager_only_nodes"] == 1
    assert result.manifest == {"cuda_graphs": {"batch_sizes": [1]}}
    assert len(said) == 1 and "l0.attention" in said[0] and "select_kernels" in said[0]


def test_cuda_graphs_is_a_no_op_on_cpu():
    result = make_pass("cuda_graphs", {"batch_sizes": [1, 2]}).run(_graph(), None, PassContext(target="cpu"))
    assert not result.changed and result.manifest == {}
    assert result.stats == {"target": "cpu", "batch_sizes": [], "note": "no-op: CUDA graphs need target cuda"}


@pytest.mark.parametrize("sizes,message", [
    ([], "batch_sizes is empty"),
    ([4, 0], r"passes\[0\].cuda_graphs.batch_sizes\[1\]: int 0 is below the minimum 1"),
    ([2, "x"], r"batch_sizes\[1\]: expected an integer, got str 'x'"),
])
def test_cuda_graphs_rejects_bad_batch_sizes_in_a_recipe(sizes, message):
    with pytest.raises(RecipeError, match=message):
        resolve_passes([{"cuda_graphs": {"batch_sizes": sizes}}], {})
    spec = resolve_passes([{"cuda_graphs": {"batch_sizes": [64, 1, 64]}}], {})[0]
    assert spec.options == {"batch_sizes": (1, 64)}


def test_cuda_graphs_is_idempotent():
    p = make_pass("cuda_graphs", {"batch_sizes": [2, 1]})
    ctx = PassContext(target="cuda")
    once = p.run(_graph("triton.paged_attention"), None, ctx)
    twice = p.run(once.graph, None, ctx)
    assert not twice.changed and twice.graph.to_json() == once.graph.to_json()
    assert twice.manifest == once.manifest and twice.stats == once.stats


def test_cuda_graphs_keeps_logits_exact_on_random_tiny():
    src = load_source("random:tiny")
    planned = make_pass("cuda_graphs").run(src.graph, src.store, PassContext(target="cuda"))
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(3))
    before = run_dense(Executor(src.graph, bind_params(src.graph, src.store)), ids)
    after = run_dense(Executor(planned.graph, bind_params(planned.graph, planned.store)), ids)
    assert torch.equal(before, after)


def test_cuda_graphs_section_reaches_the_manifest(tmp_path):
    from optc.testing import build_artifact

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: random:tiny\ndtype: float32\ntarget: cuda\n"
                      "passes: [fuse_qkv, select_kernels, {cuda_graphs: {batch_sizes: [4, 1, 2]}}]\n")
    manifest = json.loads((build_artifact(tmp_path / "cuda", recipe) / "manifest.json").read_text())
    assert manifest["cuda_graphs"] == {"batch_sizes": [1, 2, 4]}
    recipe.write_text(recipe.read_text().replace("target: cuda", "target: cpu"))
    manifest = json.loads((build_artifact(tmp_path / "cpu", recipe) / "manifest.json").read_text())
    assert manifest["cuda_graphs"] is None
