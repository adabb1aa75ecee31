"""The Mixture-of-Experts families (Mixtral, Qwen3-MoE) against transformers, float32, on their random presets
(`random:mixtral-tiny`: 4 experts, top-2, renormalized; `random:qwen3-moe-tiny`: 8 experts, top-3, not
renormalized, layer 1 dense through `mlp_only_layers`).

Greedy tokens equal transformers' (stepped over its own KV cache) batched and one at a time, with chunked
prefill, preemption, and prefix caching with n-gram speculation, decoding across block boundaries; every
prompt position's logits within 1e-4 relative, plain and fused builds. The moe reference (a loop over the
experts that received tokens) equals the dense formula over every expert. int8 and int4 RTN builds run and
stay within a KL bound of float32, GPTQ and AWQ (per expert, on its routed tokens) below RTN; the router stays
float; a
tensor-parallel engine at every size the shapes allow gives the one-rank engine's tokens and logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from optc.commands.eval import evaluate, load_model
from optc.core.artifact import read
from optc.core.ops.sharding import allowed_sizes
from optc.runtime import Engine, SamplingParams
from optc.runtime.speculative import SpeculativeConfig
from optc.testing import assert_close, build_artifact, hf_cached_greedy, prefill_logits, random_hf_model

PRESETS = ["mixtral-tiny", "qwen3-moe-tiny"]
FUSED = "passes=[fuse_qkv, fuse_gate_up, fuse_add_rmsnorm, fuse_rope_kv, kv_layout]"
NEW_TOKENS = 16
# engine config -> the build it serves (both builds' logits are checked below; one engine each keeps the suite short)
ENGINES = {"plain": ({}, "plain"),
           "preempt-chunked8": ({"num_blocks": 12, "max_num_batched_tokens": 8, "max_num_seqs": 4}, "fused")}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 9, 23, 40)]


@pytest.fixture(scope="module")
def plain_build(tmp_path_factory):
    """`plain_build(preset)` -> random:<preset> in float32 without passes, built once for the module: the tests
    only read it."""
    built: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in built:
            built[preset] = build_artifact(tmp_path_factory.mktemp(preset) / "plain", None, "dtype=float32",
                                           "passes=[]", model=f"random:{preset}")
        return built[preset]

    return get


@pytest.fixture(scope="module", params=PRESETS)
def family(request, tmp_path_factory, plain_build):
    preset = request.param
    out = tmp_path_factory.mktemp(preset)
    plain = plain_build(preset)
    fused = build_artifact(out / "fused", None, "dtype=float32", FUSED, model=f"random:{preset}")
    hf = random_hf_model(preset)
    prompts = _prompts()
    return preset, hf, plain, fused, prompts, [hf_cached_greedy(hf, ids, NEW_TOKENS) for ids in prompts]


@pytest.mark.parametrize("engine_config, build", list(ENGINES.values()), ids=list(ENGINES))
def test_greedy_tokens_match_transformers(family, engine_config, build):
    preset, _, plain, fused, prompts, expected = family
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = Engine.load(plain if build == "plain" else fused, **engine_config)
    batched = [c.token_ids for c in engine.generate(prompts, params)]
    single = [engine.generate([p], params)[0].token_ids for p in prompts]
    assert batched == expected, f"{preset} {build}: batched"
    assert single == expected, f"{preset} {build}: one at a time"


def test_prefix_caching_and_speculation_unchanged(family):
    # the engine serves a MoE model as any other: a shared prefix hits the cache, n-gram drafts are verified
    preset, _, _, fused, prompts, expected = family
    engine = Engine.load(fused, max_num_batched_tokens=16, speculative=SpeculativeConfig("ngram", 3))
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    assert [c.token_ids for c in engine.generate(prompts, params)] == expected, preset
    assert engine.generate([prompts[3]], params)[0].token_ids == expected[3], f"{preset}: the cached prefix"
    stats = engine.stats()
    assert stats.num_drafts > 0, f"{preset}: no n-gram drafts were proposed"


def test_every_prompt_position_logits_match_transformers(family):
    preset, hf, plain, fused, prompts, _ = family
    for artifact in (plain, fused):
        model = Engine.load(artifact).model
        for ids in prompts[1:]:
            with torch.no_grad():
                expected = hf(torch.tensor([ids])).logits[0]
            assert_close(prefill_logits(model, ids, every_position=True), expected, rtol=1e-4,
                         what=f"{preset} {artifact.name}: logits of a {len(ids)}-token prompt")


def test_qwen3_moe_dense_layers_keep_a_dense_mlp():
    from optc.frontend.sources import load_source

    graph = load_source("random:qwen3-moe-tiny").graph
    moe_layers = [n.attrs["layer"] for n in graph.nodes if n.op == "moe"]
    dense_layers = sorted({n.attrs["layer"] for n in graph.nodes if n.op == "gated_act"})
    assert (moe_layers, dense_layers, graph.config.dense_layers) == ([0, 2], [1], (1,))
    assert graph.node("model.layers.1.mlp.down_proj").attrs["in_features"] == 128  # the dense intermediate_size


@pytest.mark.parametrize("renormalize, round_weights", [(True, False), (False, True)])
def test_moe_reference_equals_every_expert_dense(renormalize, round_weights):
    """The reference runs only the experts tokens chose; the dense formula runs every expert on every token
    and weighs the unchosen by 0."""
    from optc.core.formats import DENSE_F32
    from optc.core.ops.moe import moe_ref

    g = torch.Generator().manual_seed(0)
    e, k, h, i, t = 6, 2, 16, 8, 11
    x, router = torch.randn(t, h, generator=g), torch.randn(e, h, generator=g)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g) / 4, torch.randn(e, h, i, generator=g) / 3
    got = moe_ref(x, router, {"weight": gate_up}, DENSE_F32, {"weight": down}, DENSE_F32, k, renormalize,
                  round_weights=round_weights)
    probs = F.softmax(x @ router.T, dim=-1)
    top = probs.topk(k, dim=-1)
    weights = torch.zeros_like(probs).scatter(-1, top.indices, top.values)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    gate, up = torch.einsum("th,enh->etn", x, gate_up).chunk(2, dim=-1)  # (E, T, I) each
    every = torch.einsum("eti,ehi->eth", F.silu(gate) * up, down)  # (E, T, H)
    assert_close(got, torch.einsum("te,eth->th", weights, every), atol=1e-5, what="moe reference vs dense")
    assert (top.indices[:, 0] != top.indices[0, 0]).any(), "every token chose the same expert"


@pytest.mark.parametrize("preset", PRESETS)
def test_bf16_moe_block_is_transformers_eager_experts_bit_for_bit(preset):
    """In bfloat16 the routing weights' dtype shows: Mixtral multiplies by fp32 weights, Qwen3-MoE by weights
    rounded to bf16 (`round_weights`). With the family's choice the reference equals transformers' eager
    experts exactly; with the other it does not. (transformers' default grouped_mm rounds otherwise.)"""
    from optc.core.formats import Format
    from optc.core.ops.moe import moe_ref
    from optc.frontend.sources import load_source

    hf = random_hf_model(preset, torch.bfloat16)
    hf.set_experts_implementation("eager")
    node = load_source(f"random:{preset}").graph.node("model.layers.0.mlp")
    block, fmt = hf.model.layers[0].mlp, Format(dtype="bfloat16")
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        expected = block(x[None])[0]
    a = node.attrs
    out = {rounded: moe_ref(x, block.gate.weight.data, {"weight": block.experts.gate_up_proj.data}, fmt,
                            {"weight": block.experts.down_proj.data}, fmt, a["top_k"], a["renormalize"], a["act"],
                            rounded) for rounded in (False, True)}
    family = a.get("round_weights", False)
    assert torch.equal(out[family], expected), f"{preset}: round_weights={family}"
    assert not torch.equal(out[not family], expected), f"{preset}: round_weights={not family} also matches"


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny"])  # Mixtral's bf16 block: the bit-for-bit test above
def test_bf16_greedy_like_transformers(preset, tmp_path):
    """tests/test_families.py's bf16 rule: tokens equal up to the first difference, and there transformers' own
    bfloat16 logits of both tokens are at most one bfloat16 step apart."""
    from optc.testing import assert_greedy_like_bf16

    hf = random_hf_model(preset, torch.bfloat16)
    artifact = build_artifact(tmp_path / "a", None, "dtype=bfloat16", FUSED, model=f"random:{preset}")
    prompts = _prompts()[2:]
    completions = Engine.load(artifact).generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert_greedy_like_bf16(hf, prompts, completions, 16, f"{preset}, ")


def test_a_quantized_router_is_refused_by_name():
    from dataclasses import replace

    from optc.core.formats import quantized_format
    from optc.core.ir import TensorInfo
    from optc.core.ops import VerifyError, verify
    from optc.frontend.sources import load_source

    graph = load_source("random:mixtral-tiny").graph
    router = "model.layers.0.mlp.gate.weight"
    graph.tensors[router] = replace(graph.tensors[router], format=quantized_format(8))
    assert isinstance(graph.tensors[router], TensorInfo)
    with pytest.raises(VerifyError, match=f"node 'model.layers.0.mlp' \\(moe\\): router {router} is int8_wo: the "
                                          "moe router stays float"):
        verify(graph)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "mixtral", "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported; supported: silu"),
    ({"model_type": "qwen3_moe", "decoder_sparse_step": 0}, "decoder_sparse_step 0"),
    ({"model_type": "qwen3_moe", "num_experts": 0}, "num_experts 0"),
], ids=["mixtral-gelu", "qwen3-moe-step", "qwen3-moe-no-experts"])
def test_unsupported_moe_configs_are_user_errors_naming_what(config, message):
    from optc.core.errors import UnsupportedModelError
    from optc.frontend.models import config_from_hf

    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 256, "num_experts_per_tok": 2}
    with pytest.raises(UnsupportedModelError, match="x/config.json: .*" + message):
        config_from_hf({**base, **config}, "x/config.json")


CALIBRATION = "calibration={source: 'builtin:pydoc', samples: 8, seq_len: 64, seed: 0}"
# method -> (its pass, the expert format, the KL bound vs float32); fp8 RTN rounds experts as int8 RTN does
METHODS = {
    "int8": ("{quantize_rtn: {bits: 8}}", "int8_wo", 0.002),  # measured 0.0003
    "int4-rtn": ("{quantize_rtn: {bits: 4, group_size: 32}}", "int4_g", 0.06),  # measured 0.010
    "int4-gptq": ("{quantize_gptq: {bits: 4, group_size: 32}}", "int4_g", 0.05),  # measured 0.0046-0.0047
    "int4-awq": ("{quantize_awq: {bits: 4, group_size: 32}}", "int4_g", 0.05),  # measured 0.0060-0.0089
    "fp8-gptq": ("{quantize_fp8: {method: gptq}}", "fp8_e4m3", 0.01),  # measured 0.0005-0.0010
}
# each calibrated method on one preset (the suite's time): AWQ on Mixtral's 4 renormalized experts, GPTQ on
# Qwen3-MoE's 8 experts and its dense layer
PRESET_METHODS = {"mixtral-tiny": ("int8", "int4-rtn", "int4-awq"),
                  "qwen3-moe-tiny": ("int8", "int4-rtn", "int4-gptq", "fp8-gptq")}
TP_SIZES = {"mixtral-tiny": [1, 2, 4], "qwen3-moe-tiny": [1, 2, 4]}


@pytest.mark.parametrize("preset", PRESETS)
def test_quantized_builds_quantize_every_expert_and_stay_within_kl_of_float32(preset, plain_build, tmp_path):
    f32 = load_model(str(plain_build(preset)))
    kls = {}
    for method in PRESET_METHODS[preset]:
        passes, kind, bound = METHODS[method]
        artifact = build_artifact(tmp_path / method, None, "dtype=float32", CALIBRATION,
                                  f"passes=[fuse_qkv, fuse_gate_up, {passes}, fuse_add_rmsnorm, fuse_rope_kv, "
                                  "kv_layout]", model=f"random:{preset}")
        graph = read(artifact).graph
        for node in (n for n in graph.nodes if n.op == "moe"):
            kinds = {role: graph.tensors[t].format.kind.value for role, t in node.params.items()}
            assert kinds == {"router": "dense", "gate_up": kind, "down": kind}, f"{preset} {method} {node.name}"
        tokens = Engine.load(artifact).generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(tokens[0].token_ids) == 4
        kl = kls[method] = evaluate(load_model(str(artifact)), f32, max_tokens=256, window=128)["kld"]
        assert 0 < kl < bound, f"{preset} {method}: KL {kl:.5f} not in (0, {bound})"
    for calibrated in {"int4-gptq", "int4-awq"} & set(kls):
        assert kls[calibrated] < kls["int4-rtn"], f"{preset}: {calibrated}'s KL {kls[calibrated]:.5f} >= RTN's"


def test_gptq_rounds_an_expert_with_too_few_calibration_tokens_to_nearest_and_says_so(tmp_path):
    from optc.frontend.quant.experts import MIN_EXPERT_TOKENS

    few = "calibration={source: 'builtin:pydoc', samples: 1, seq_len: 16, seed: 0}"  # 16 tokens x top-3 / 8
    artifact = build_artifact(tmp_path / "a", None, "dtype=float32", few,
                              "passes=[{quantize_gptq: {bits: 4, group_size: 32}}]", model="random:qwen3-moe-tiny")
    stats = next(p["stats"] for p in read(artifact).manifest.to_json()["passes"] if p["name"] == "quantize_gptq")
    assert stats["experts_gptq"] + stats["experts_rtn_fallback"] == 2 * 8, stats  # two moe layers of 8
    assert stats["experts_rtn_fallback"] == len(stats["fallback_expert_tokens"]) > 0, stats
    assert max(stats["fallback_expert_tokens"]) < MIN_EXPERT_TOKENS, stats
    assert sum(stats["fallback_expert_tokens"]) < 2 * 16 * 3, stats
    tokens = Engine.load(artifact).generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(tokens[0].token_ids) == 4


def test_a_quantized_expert_is_each_expert_rounded_alone():
    """Expert e of the stacked int4 parts dequantizes to RTN of expert e's matrix alone (its own scales)."""
    from optc.core.formats import dequantize
    from optc.core.ops.moe import expert_parts
    from optc.frontend.quant.options import per_expert
    from optc.frontend.quant.rtn import make_format, quantize_weight

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 16, 64, generator=g) * torch.tensor([1.0, 10.0, 0.1])[:, None, None]
    fmt = make_format(4, 32, True)
    parts = per_expert(quantize_weight, w, fmt, "experts")
    assert {r: tuple(p.shape) for r, p in parts.items()} == {r: s for r, (s, _) in fmt.part_shapes(w.shape).items()}
    for e in range(3):
        assert torch.equal(dequantize(expert_parts(parts, e), fmt), dequantize(quantize_weight(w[e], fmt), fmt))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_experts_shard_along_their_matrix_axes(bits):
    """Format.part_slices of a stacked (E, N, K) weight: every expert's rows (gate and up halves) or columns, its
    parts sliced where they run, the expert axis whole; the expert axis itself is never cut."""
    from optc.core.formats import dequantize
    from optc.core.ops.moe import expert_parts
    from optc.core.ops.sharding import _take
    from optc.frontend.quant.options import per_expert
    from optc.frontend.quant.rtn import make_format, quantize_weight

    fmt = make_format(bits, 32, bits == 4)
    w = torch.randn(3, 64, 128, generator=torch.Generator().manual_seed(0))
    parts = per_expert(quantize_weight, w, fmt, "experts")
    full = torch.stack([dequantize(expert_parts(parts, e), fmt) for e in range(3)])
    for axis, ranges in ((1, ((16, 32), (48, 64))), (2, ((64, 128),))):
        sliced = dict(parts)
        for role, (part_axis, part_ranges) in fmt.part_slices(w.shape, axis, ranges).items():
            assert part_axis >= 1, role
            sliced[role] = _take(parts[role], part_axis, part_ranges)
        got = torch.stack([dequantize(expert_parts(sliced, e), fmt) for e in range(3)])
        assert torch.equal(got, _take(full, axis, ranges)), f"int{bits} axis {axis}"
    with pytest.raises(ValueError, match="the expert axis is not sliced"):
        fmt.part_slices(w.shape, 0, ((0, 1),))


@pytest.mark.parametrize("preset, sizes", [("mixtral-tiny", [2]), ("qwen3-moe-tiny", [4])])
def test_tensor_parallel_sizes_equal_one_rank(preset, sizes, tmp_path):
    # each allowed size is started for one preset only: a rank group costs seconds of process start-up
    artifact = build_artifact(tmp_path / "a", None, "dtype=float32", FUSED, model=f"random:{preset}")
    assert allowed_sizes(read(artifact).graph) == TP_SIZES[preset]
    from optc.commands.inspect import render, summarize

    shown = render(summarize(artifact, 2))
    assert "model.layers.0.mlp.experts.gate_up_proj          expert rows" in shown
    if preset == "qwen3-moe-tiny":
        assert "moe        8 experts of intermediate 32, top-3, in layers 0, 2 (dense MLP: 1)" in shown
    prompts = [[(5 * i + 3 * j) % 256 for j in range(2 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    one = Engine.load(artifact, max_num_batched_tokens=16)
    want = [c.token_ids for c in one.generate(prompts, params)]
    logits_args = ([prompts[3][:20]], [0], [[1, 2]], [20])
    for size in sizes:
        engine = Engine.load(artifact, tensor_parallel_size=size, max_num_batched_tokens=16)
        try:
            assert [c.token_ids for c in engine.generate(prompts, params)] == want, f"{preset} at N = {size}"
            assert_close(engine.runner.forward(*logits_args), one.runner.forward(*logits_args), atol=1e-4,
                         what=f"{preset} logits at N = {size}")
        finally:
            engine.close()


@pytest.mark.parametrize("preset", PRESETS)
def test_a_saved_checkpoint_imports_with_its_experts_stacked(preset, plain_build, tmp_path):
    """transformers 5 saves each expert apart (Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2, Qwen3-MoE's
    mlp.experts.{e}.gate_proj/up_proj/down_proj): the build from the folder holds the random build's weights."""
    random_hf_model(preset).save_pretrained(tmp_path / "hf")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert not any(k.endswith("experts.gate_up_proj") for k in f.keys()), "the checkpoint is saved stacked"
    ours = build_artifact(tmp_path / "a", None, "dtype=float32", "passes=[]", model=str(tmp_path / "hf"))
    first, second = read(ours), read(plain_build(preset))
    assert first.graph.used_tensors() == second.graph.used_tensors()
    for name in second.graph.used_tensors():
        assert torch.equal(first.store.get(name), second.store.get(name)), name


def test_a_pre_quantized_moe_checkpoint_is_refused_by_name(tmp_path):
    import json

    from optc.frontend.sources import SourceError

    random_hf_model("mixtral-tiny").save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match="a pre-quantized Mixture-of-Experts checkpoint \\(MixtralForCausalLM\\) "
                                          "is not read"):
        build_artifact(tmp_path / "a", None, "dtype=float32", "passes=[]", model=str(tmp_path / "hf"))


def test_exports_of_a_moe_model(tmp_path):
    """HF: the dense build loads in transformers (experts under its stacked names) with the runtime's logits
    and builds back to the same weights, and --compare-hf rebuilds the same model; quantized experts and ONNX
    are refused by name."""
    from transformers import AutoModelForCausalLM

    from optc.commands.export import ExportFormat, ExportOptions, export
    from optc.core.errors import UserError

    artifact = build_artifact(tmp_path / "a", None, "dtype=float32", FUSED, model="random:mixtral-tiny")
    folder = export(ExportOptions(artifact, tmp_path / "hf", format=ExportFormat.HF, quiet=True)).out
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    ids = _prompts()[3]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    assert_close(prefill_logits(Engine.load(artifact).model, ids, every_position=True), expected, rtol=1e-4,
                 what="mixtral export: transformers vs optc")
    from optc.frontend.models import hf_model_from_artifact  # --compare-hf's peer, from the artifact's tensors

    rebuilt = hf_model_from_artifact(artifact, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        assert_close(rebuilt(torch.tensor([ids])).logits[0], expected, rtol=1e-5, what="rebuilt vs exported")
    again = build_artifact(tmp_path / "again", None, "dtype=float32", FUSED, model=str(folder))
    for name in read(artifact).graph.used_tensors():
        assert torch.equal(read(artifact).store.get(name), read(again).store.get(name)), name
    int8 = build_artifact(tmp_path / "int8", None, "dtype=float32", "passes=[{quantize_rtn: {bits: 8}}]",
                          model="random:mixtral-tiny")
    with pytest.raises(UserError, match="tensor model.layers.0.mlp.experts.gate_up_proj is the int8_wo experts of "
                                        "moe node model.layers.0.mlp"):
        export(ExportOptions(int8, tmp_path / "hf8", format=ExportFormat.HF, quiet=True))
    pytest.importorskip("onnx")
    with pytest.raises(UserError, match="node model.layers.0.mlp \\(moe\\) of a MixtralForCausalLM graph has no "
                                        "ONNX lowering"):
        export(ExportOptions(artifact, tmp_path / "onnx", quiet=True))


def test_cuda_graphs_says_a_moe_model_runs_eager():
    from optc.frontend.passmanager import PassContext, make_pass
    from optc.frontend.sources import load_source

    said = []
    graph = load_source("random:mixtral-tiny").graph
    result = make_pass("cuda_graphs", {"batch_sizes": [1]}).run(graph, None, PassContext(target="cuda",
                                                                                         progress=said.append))
    assert result.stats["num_eager_only_nodes"] == 2 + 2  # the unbound attentions and the moe nodes
    assert len(said) == 1 and "2 moe node(s) (first: model.layers.0.mlp) have no CUDA kernel" in said[0], said
