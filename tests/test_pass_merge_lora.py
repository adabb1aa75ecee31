"""merge_lora on random:tiny: structure (the merged linears marked, each weight W + B A * alpha / r), idempotence,
a fused qkv / gate_up graph taking the separate projections' adapter alike, a quantized weight refused, and a built
artifact's greedy tokens equal to peft's merge_and_unload() with the adapter's sha256 in the manifest."""

import hashlib

import pytest
import torch

from optc.core.artifact import read
from optc.core.errors import UserError
from optc.frontend.passmanager import PassContext, make_pass
from optc.frontend.sources import load_source
from optc.runtime import Engine, SamplingParams
from optc.testing import build_artifact, hf_greedy, random_peft_adapter, tiny_hf_model

peft = pytest.importorskip("peft")
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return random_peft_adapter(tmp_path_factory.mktemp("merge") / "a", 8, 16, TARGETS, seed=5)


def test_merge_lora_structure_and_idempotence(adapter):
    tiny = load_source("random:tiny")
    result = make_pass("merge_lora", {"path": str(adapter), "scale": 0.5}).run(tiny.graph, tiny.store, PassContext())
    sha = hashlib.sha256((adapter / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert result.changed and result.stats == {"sha256": sha, "rank": 8, "merged": 2 * len(TARGETS)}
    merged = [n.name for n in result.graph.nodes if n.attrs.get("lora_merged") == sha]
    assert merged == [f"model.layers.{i}.{m}" for i in range(2) for m in
                      ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")]
    from safetensors.torch import load_file

    factors = load_file(adapter / "adapter_model.safetensors")
    name = "model.layers.1.mlp.down_proj"
    a, b = (factors[f"base_model.model.{name}.lora_{x}.weight"] for x in "AB")
    expected = tiny.store.get(f"{name}.weight") + 0.5 * (16 / 8) * (b @ a)
    torch.testing.assert_close(result.store.get(f"{name}.weight"), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(result.store.get("model.layers.1.mlp.gate_proj.weight"),
                               tiny.store.get("model.layers.1.mlp.gate_proj.weight"), rtol=0, atol=0)
    again = make_pass("merge_lora", {"path": str(adapter), "scale": 0.5}).run(result.graph, result.store,
                                                                              PassContext())
    assert not again.changed and again.stats["merged"] == 0


def test_merge_into_fused_projections_equals_merge_before_fusion(adapter):
    tiny, ctx = load_source("random:tiny"), PassContext()
    opts = {"path": str(adapter)}
    first = make_pass("merge_lora", opts).run(tiny.graph, tiny.store, ctx)
    for name in ("fuse_qkv", "fuse_gate_up"):
        first = make_pass(name).run(first.graph, first.store, ctx)
    fused = tiny
    for name in ("fuse_qkv", "fuse_gate_up"):
        fused = make_pass(name).run(fused.graph, fused.store, ctx)
    after = make_pass("merge_lora", opts).run(fused.graph, fused.store, ctx)
    for tensor in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"):
        torch.testing.assert_close(after.store.get(tensor), first.store.get(tensor), rtol=1e-6, atol=1e-6)


def test_merge_after_quantization_is_refused(adapter):
    tiny, ctx = load_source("random:tiny"), PassContext()
    q = make_pass("quantize_rtn", {"bits": 8}).run(tiny.graph, tiny.store, ctx)
    with pytest.raises(UserError, match="model.layers.0.self_attn.q_proj's weight is int8_wo: merge adapters before"):
        make_pass("merge_lora", {"path": str(adapter)}).run(q.graph, q.store, ctx)


def test_merged_build_equals_merge_and_unload(adapter, tmp_path):
    recipe = tmp_path / "merged.yaml"
    recipe.write_text(f"model: random:tiny\ndtype: float32\ntarget: cpu\n"
                      f"passes: [{{merge_lora: {{path: '{adapter}'}}}}, fuse_qkv, fuse_gate_up]\n")
    artifact = build_artifact(tmp_path / "a", recipe)
    (record,) = [p for p in read(artifact).manifest.passes if p["name"] == "merge_lora"]
    assert record["stats"]["sha256"] == hashlib.sha256((adapter / "adapter_model.safetensors").read_bytes()).hexdigest()
    reference = peft.PeftModel.from_pretrained(tiny_hf_model(), adapter).merge_and_unload().eval()
    prompts = [[5, 9, 13, 200, 3], [7] * 21]
    got = Engine.load(artifact).generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [c.token_ids for c in got] == [hf_greedy(reference, p, 12) for p in prompts]
    assert [c.token_ids for c in got] != [hf_greedy(tiny_hf_model(), p, 12) for p in prompts]
