"""DeepSeek-V2 (`random:deepseek-v2-tiny`: MLA with q_lora_rank, kv_lora_rank 16 and a rope key of 8; 8 routed
experts in 4 groups of which the best 2 are kept, top-3, weights scaled by 1.5; 2 shared experts; layer 0 dense)
against transformers, float32.

Greedy tokens equal transformers' (stepped over its own KV cache) batched and one at a time, with chunked
prefill and preemption, prefix caching and n-gram speculation, decoding across block boundaries; every prompt
position's logits within 1e-4, plain and fused builds; yarn rope past the original context; bf16 within a
bf16 step. The latent cache holds kv_lora_rank + rope dims per token per layer (`bytes_per_block`);
the absorbed decode (W_UK in the query, W_UV after attention, reading only the latent cache) equals the
expanded form; int8 and fp8 latent caches (one scale per token) stay within KL 0.01; the group-limited
router equals transformers'. int8 and int4 RTN builds run within a KL
bound; tensor parallelism (heads split, latent replicated) equals one rank; what cannot run is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from optc.commands.eval import evaluate, load_model
from optc.core.artifact import read
from optc.core.ops.sharding import allowed_sizes
from optc.runtime import Engine, SamplingParams
from optc.testing import assert_close, build_artifact, hf_cached_greedy, prefill_logits, random_hf_model

PRESET = "deepseek-v2-tiny"
MODEL = f"random:{PRESET}"
FUSED = "passes=[fuse_qkv, fuse_gate_up, fuse_add_rmsnorm, fuse_rope_kv, kv_layout]"
NEW_TOKENS = 16
ENGINES = {"plain": ({}, "plain"),
           "preempt-chunked8": ({"num_blocks": 12, "max_num_batched_tokens": 8, "max_num_seqs": 4}, "fused")}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 9, 23, 40)]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """MODEL in float32 without passes, built once for the module: the tests only read it."""
    return build_artifact(tmp_path_factory.mktemp(PRESET) / "plain", None, "dtype=float32", "passes=[]", model=MODEL)


@pytest.fixture(scope="module")
def family(tmp_path_factory, plain):
    out = tmp_path_factory.mktemp(PRESET)
    fused = build_artifact(out / "fused", None, "dtype=float32", FUSED, model=MODEL)
    hf = random_hf_model(PRESET)
    prompts = _prompts()
    return hf, plain, fused, prompts, [hf_cached_greedy(hf, ids, NEW_TOKENS) for ids in prompts]


@pytest.mark.parametrize("engine_config, build", list(ENGINES.values()), ids=list(ENGINES))
def test_greedy_tokens_match_transformers(family, engine_config, build):
    _, plain, fused, prompts, expected = family
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = Engine.load(plain if build == "plain" else fused, **engine_config)
    assert [c.token_ids for c in engine.generate(prompts, params)] == expected, f"{build}: batched"
    assert [engine.generate([p], params)[0].token_ids for p in prompts] == expected, f"{build}: one at a time"


def test_prefix_caching_and_speculation_over_the_latent_cache(family):
    # the engine serves an MLA model as any other: a shared prefix hits the latent cache, n-gram drafts are verified
    from optc.runtime.speculative import SpeculativeConfig

    hf, _, fused, prompts, expected = family
    periodic = [7, 8, 9, 10] * 6  # its last 3 tokens recur in it: the n-gram proposer drafts from the first step
    engine = Engine.load(fused, max_num_batched_tokens=16, speculative=SpeculativeConfig("ngram", 3))
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [c.token_ids for c in engine.generate([*prompts, periodic], params)]
    assert got == [*expected, hf_cached_greedy(hf, periodic, NEW_TOKENS)]
    assert engine.generate([prompts[3]], params)[0].token_ids == expected[3], "the cached prefix"
    stats = engine.stats()
    assert stats.num_drafts > 0, "no n-gram drafts were proposed"
    assert stats.num_prefix_cache_hit_tokens >= 32, "the 40-token prompt's two full blocks were not reused"


def test_every_prompt_position_logits_match_transformers(family):
    hf, plain, fused, prompts, _ = family
    for artifact in (plain, fused):
        model = Engine.load(artifact).model
        for ids in prompts[1:]:
            with torch.no_grad():
                expected = hf(torch.tensor([ids])).logits[0]
            assert_close(prefill_logits(model, ids, every_position=True), expected, rtol=1e-4,
                         what=f"{artifact.name}: logits of a {len(ids)}-token prompt")


def test_the_latent_cache_holds_one_latent_and_rope_key_per_token_per_layer():
    from optc.core.kv_cache import KVCacheSpec
    from optc.frontend.sources import load_source

    c = load_source(MODEL).graph.config
    spec = KVCacheSpec(16, "float32")
    assert spec.block_shape(c) == (1, 16, 1, 16 + 8)  # kv_lora_rank + qk_rope_head_dim, no head axis
    assert spec.bytes_per_block(c) == 3 * 16 * (16 + 8) * 4  # 3 layers, 16 tokens, fp32
    assert spec.bytes_per_token(c) == 3 * 24 * 4
    assert KVCacheSpec(16, "bfloat16").bytes_per_block(c) == 3 * 16 * 24 * 2
    # the same model's MHA cache would hold K (qk_nope + rope) and V per head: 4 * (24 + 16) values per token
    assert spec.allocate_layer(c, 5, "cpu").data.shape == (5, 1, 16, 1, 24)
    # int8 / fp8: one byte a value and one fp32 scale per token per layer (latent and rope key together)
    assert KVCacheSpec(16, "int8").bytes_per_block(c) == 3 * 16 * (24 + 4)
    assert KVCacheSpec(16, "fp8_e4m3").allocate_layer(c, 5, "cpu").scales.shape == (5, 1, 16, 1)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [5, 1, 12]], ids=["decode", "mixed"])
def test_absorbed_attention_equals_the_expanded_form(query_lens):
    """The same cache and queries: W_UK folded into the query and W_UV after attention in latent space give
    the expanded keys' and values' attention (the op runs the absorbed form for a decode step)."""
    from optc.core.kv_cache import KVCacheSpec
    from optc.core.ops.mla import mla_attention_ref
    from optc.core.rope import cos_sin_tables
    from optc.frontend.sources import load_source

    c = load_source(MODEL).graph.config
    g = torch.Generator().manual_seed(0)
    h, dn, dr, r, dv, bs = c.num_heads, c.qk_nope_head_dim, c.head_dim, c.kv_lora_rank, c.v_head_dim, 4
    context = [9, 3, 14]  # tokens already cached per request before this step
    seq_lens = torch.tensor([n + q for n, q in zip(context, query_lens, strict=True)])
    tables = torch.tensor([[1, 2, 3, 4, 0, 0, 0], [5, 6, 0, 0, 0, 0, 0], [7, 8, 9, 10, 11, 12, 13]])
    positions = torch.cat([torch.arange(n, n + q) for n, q in zip(context, query_lens, strict=True)])
    request = torch.repeat_interleave(torch.arange(3), torch.tensor(query_lens))
    slots = tables[request, positions // bs] * bs + positions % bs
    start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    cache = KVCacheSpec(bs, "float32").allocate_layer(c, 14, "cpu")
    cache.data.normal_(generator=g)  # the earlier tokens' latents
    t = len(positions)
    q, kv_a = torch.randn(t, h, dn + dr, generator=g), torch.randn(t, r + dr, generator=g)
    kv_norm, kv_b = 1 + 0.1 * torch.randn(r, generator=g), torch.randn(h * (dn + dv), r, generator=g) / 4
    table = cos_sin_tables(c, 64)["global"]
    out = {}
    for absorb in (True, False):
        stored = type(cache)(cache.data.clone())
        out[absorb] = mla_attention_ref(q, kv_a, positions, table, kv_norm, kv_b, stored, slots, tables, seq_lens,
                                        start, 0.2, 1e-6, dn, dv, absorb=absorb)
    assert out[True].shape == (t, h * dv)
    assert_close(out[True], out[False], atol=1e-5, what=f"absorbed vs expanded, query lengths {query_lens}")


def test_group_limited_routing_equals_transformers():
    from optc.core.ops.moe import route
    from optc.frontend.sources import load_source

    hf = random_hf_model(PRESET)
    node = load_source(MODEL).graph.node("model.layers.1.mlp")
    a = node.attrs
    assert (a["num_groups"], a["topk_groups"], a["routed_scale"], a["float_router"]) == (4, 2, 1.5, True)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    gate = hf.model.layers[1].mlp.gate
    with torch.no_grad():
        _, want_w, want_ids = gate(x)
    weights, ids = route(x, gate.weight.data, a["top_k"], a["renormalize"], num_groups=4, topk_groups=2,
                         routed_scale=1.5, float_router=True)
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(-1, order), want_ids.gather(-1, want_order))
    assert torch.equal(weights.gather(-1, order), want_w.gather(-1, want_order))
    groups = [set((row // 2).tolist()) for row in ids]
    assert max(len(s) for s in groups) <= 2  # at most topk_group groups per token
    plain, _ = route(x, gate.weight.data, 3, False)
    assert not torch.equal(plain.sort(-1).values * 1.5, weights.sort(-1).values), "group limiting changed nothing"


def test_the_graph_has_a_dense_first_layer_and_shared_experts():
    from optc.frontend.sources import load_source

    graph = load_source(MODEL).graph
    assert [n.attrs["layer"] for n in graph.nodes if n.op == "moe"] == [1, 2]
    assert [n.attrs["layer"] for n in graph.nodes if n.op == "mla_attention"] == [0, 1, 2]
    shared = graph.node("model.layers.1.mlp.shared_experts.down_proj")
    assert shared.attrs["in_features"] == 2 * 32  # n_shared_experts * moe_intermediate_size
    assert graph.node("model.layers.0.mlp.down_proj").attrs["in_features"] == 128


# method -> (its pass, the experts' format, the KL bound vs float32)
RTN = {"int8": ("{quantize_rtn: {bits: 8}}", "int8_wo", 0.002),  # measured 0.00016
       "int4": ("{quantize_rtn: {bits: 4, group_size: 32}}", "int4_g", 0.05)}  # measured 0.0167


def test_rtn_builds_run_and_stay_within_kl_of_float32(plain, tmp_path):
    f32 = load_model(str(plain))
    for name, (passes, kind, bound) in RTN.items():
        artifact = build_artifact(tmp_path / name, None, "dtype=float32", f"passes=[fuse_gate_up, {passes}, "
                                  "kv_layout]", model=MODEL)
        graph = read(artifact).graph
        moe = graph.node("model.layers.1.mlp")
        assert graph.tensors[moe.params["gate_up"]].format.kind.value == kind
        assert graph.tensors[moe.params["router"]].format.kind.value == "dense"
        mla = graph.node("model.layers.1.self_attn.attention")
        assert graph.tensors[mla.params["kv_b"]].format.kind.value == "dense"  # read per head by the absorbed form
        tokens = Engine.load(artifact).generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(tokens[0].token_ids) == 4
        kl = evaluate(load_model(str(artifact)), f32, max_tokens=256, window=128)["kld"]
        assert 0 < kl < bound, f"{name}: KL {kl:.5f} not in (0, {bound})"


# the bar for a quantized latent cache: KL <= 0.01 against the float32 cache (256 tokens)
KV_KL = {"int8": 0.01, "fp8_e4m3": 0.01}  # measured 0.00011 and 0.00052


def test_a_quantized_latent_cache_stays_within_kl_of_float32(family, tmp_path):
    _, plain, _, prompts, expected = family
    f32 = load_model(str(plain))
    for dtype, bound in KV_KL.items():
        artifact = build_artifact(tmp_path / dtype, None, "dtype=float32",
                                  f"passes=[{{kv_layout: {{dtype: {dtype}}}}}]", model=MODEL)
        kl = evaluate(load_model(str(artifact)), f32, max_tokens=256, window=128)["kld"]
        assert 0 < kl <= bound, f"{dtype} latent cache: KL {kl:.5f} not in (0, {bound}]"
        engine = Engine.load(artifact, max_num_batched_tokens=8)  # chunked: later chunks read the scaled latents
        got = engine.generate(prompts[2:], SamplingParams(max_tokens=4, ignore_eos=True))
        assert [c.token_ids for c in got] == [e[:4] for e in expected[2:]], dtype


def test_tensor_parallel_splits_heads_and_equals_one_rank(family):
    _, _, fused, prompts, _ = family
    assert allowed_sizes(read(fused).graph) == [1, 2, 4]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    one = Engine.load(fused, max_num_batched_tokens=16)
    want = [c.token_ids for c in one.generate(prompts, params)]
    logits_args = ([prompts[3][:20]], [0], [[1, 2]], [20])
    engine = Engine.load(fused, tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        assert [c.token_ids for c in engine.generate(prompts, params)] == want, "N = 2"
        assert_close(engine.runner.forward(*logits_args), one.runner.forward(*logits_args), atol=1e-4,
                     what="logits at N = 2")
    finally:
        engine.close()


def test_a_saved_checkpoint_imports_with_its_experts_stacked(plain, tmp_path):
    random_hf_model(PRESET).save_pretrained(tmp_path / "hf")
    ours = build_artifact(tmp_path / "a", None, "dtype=float32", "passes=[]", model=str(tmp_path / "hf"))
    first, second = read(ours), read(plain)
    assert first.graph.used_tensors() == second.graph.used_tensors()
    for name in second.graph.used_tensors():
        assert torch.equal(first.store.get(name), second.store.get(name)), name


@pytest.mark.parametrize("config, message", [
    ({"norm_topk_prob": True}, "norm_topk_prob=true is not supported"),
    ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported"),
    ({"rope_scaling": {"type": "dynamic", "factor": 4.0}}, "rope scaling .* is not supported"),
], ids=["norm-topk", "topk-method", "dynamic-rope"])
def test_unsupported_deepseek_configs_are_user_errors_naming_what(config, message):
    from optc.core.errors import UnsupportedModelError
    from optc.frontend.models import config_from_hf
    from optc.frontend.sources import PRESETS

    with pytest.raises(UnsupportedModelError, match="x/config.json: .*" + message):
        config_from_hf({"model_type": "deepseek_v2", **PRESETS[PRESET][1], **config}, "x/config.json")


# DeepSeek-V2-Lite's config.json (deepseek-ai/DeepSeek-V2-Lite), the fields optc reads
LITE = dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], hidden_size=2048,
            intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
            num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0,
            kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
            topk_method="greedy", n_group=1, topk_group=1, num_experts_per_tok=6, moe_layer_freq=1,
            first_k_dense_replace=1, norm_topk_prob=False, max_position_embeddings=163840, rope_theta=10000,
            rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                          "original_max_position_embeddings": 4096, "type": "yarn"},
            vocab_size=102400, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False)


def test_deepseek_v2_lite_config_reads_with_its_latent_cache_size():
    import math

    from optc.core.kv_cache import KVCacheSpec
    from optc.frontend.models import config_from_hf

    c = config_from_hf(LITE, "DeepSeek-V2-Lite/config.json")
    assert (c.kv_lora_rank, c.q_lora_rank, c.head_dim, c.qk_nope_head_dim, c.v_head_dim) == (512, 0, 64, 128, 128)
    assert (c.num_experts, c.num_experts_per_tok, c.dense_layers, c.shared_expert_intermediate_size,
            c.num_expert_groups) == (64, 6, (0,), 2 * 1408, 1)
    assert KVCacheSpec(16, "bfloat16").bytes_per_token(c) == 27 * (512 + 64) * 2  # docs/PERF.md: 31,104
    mscale = 0.1 * 0.707 * math.log(40) + 1.0  # yarn's softmax correction, squared (transformers' yarn_apply_mscale)
    assert c.attention_scale == pytest.approx(192**-0.5 * mscale**2, rel=1e-12)


def test_yarn_rope_matches_transformers(plain, tmp_path):
    """A yarn table (attention factor from mscale / mscale_all_dim) and MLA's mscale-corrected softmax scale,
    past the original context: logits within 1e-4 and greedy tokens equal transformers'."""
    import shutil

    from transformers import AutoModelForCausalLM

    hf = random_hf_model(PRESET)
    hf.config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                                 "mscale_all_dim": 0.5, "original_max_position_embeddings": 16}
    hf.save_pretrained(tmp_path / "hf")
    for f in (plain / "tokenizer").iterdir():
        shutil.copy(f, tmp_path / "hf" / f.name)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert model.model.rotary_emb.attention_scaling != 1.0
    artifact = build_artifact(tmp_path / "a", None, "dtype=float32", "passes=[]", model=str(tmp_path / "hf"))
    assert read(artifact).graph.config.rope_scaling["rope_type"] == "yarn"
    ids = _prompts()[3]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    engine = Engine.load(artifact)
    assert_close(prefill_logits(engine.model, ids, every_position=True), expected, rtol=1e-4, what="yarn logits")
    got = engine.generate([ids], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0].token_ids
    assert got == hf_cached_greedy(model, ids, NEW_TOKENS)


def test_the_plain_q_projection_without_q_lora_rank_matches_transformers(plain, tmp_path):
    """DeepSeek-V2-Lite's q path (q_lora_rank null: one q_proj), on the preset's other weights."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from optc.frontend.models import hf_config
    from optc.frontend.sources import load_source

    src = load_source(MODEL)
    fields = hf_config(src.graph.config) | {"q_lora_rank": None}
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    g = torch.Generator().manual_seed(0)
    state = {n: src.store.get(n) for n in src.store.names() if ".q_a_" not in n and ".q_b_" not in n}
    for i in range(3):
        state[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.randn(4 * 24, 64, generator=g) / 8
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    hf.eval().save_pretrained(tmp_path / "hf")
    for f in (plain / "tokenizer").iterdir():
        shutil.copy(f, tmp_path / "hf" / f.name)
    artifact = build_artifact(tmp_path / "a", None, "dtype=float32", "passes=[]", model=str(tmp_path / "hf"))
    graph = read(artifact).graph
    assert graph.config.q_lora_rank == 0 and "model.layers.0.self_attn.q_proj.weight" in graph.tensors
    ids = _prompts()[3]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    engine = Engine.load(artifact)
    assert_close(prefill_logits(engine.model, ids, every_position=True), expected, rtol=1e-4, what="q_proj logits")
    got = engine.generate([ids], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0].token_ids
    assert got == hf_cached_greedy(hf, ids, NEW_TOKENS)


def test_hf_export_loads_in_transformers_with_the_runtime_logits(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from optc.commands.export import ExportFormat, ExportOptions, export

    _, _, fused, prompts, _ = family
    folder = export(ExportOptions(fused, tmp_path / "hf", format=ExportFormat.HF, quiet=True)).out
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        expected = model(torch.tensor([prompts[3]])).logits[0]
    assert_close(prefill_logits(Engine.load(fused).model, prompts[3], every_position=True), expected, rtol=1e-4,
                 what="deepseek-v2 export: transformers vs optc")


def test_what_mla_cannot_take_is_refused_by_name(plain, tmp_path):
    from optc.commands.export import ExportOptions, export
    from optc.core.errors import UserError
    from optc.frontend.passmanager import PassContext, make_pass
    from optc.frontend.sources import load_source

    said = []
    graph = load_source(MODEL).graph
    make_pass("cuda_graphs", {"batch_sizes": [1]}).run(graph, None, PassContext(target="cuda", progress=said.append))
    assert any("mla_attention" in s for s in said), said
    pytest.importorskip("onnx")
    artifact = plain
    with pytest.raises(UserError, match="\\(mla_attention\\) of a DeepseekV2ForCausalLM graph has no ONNX lowering"):
        export(ExportOptions(artifact, tmp_path / "onnx", quiet=True))


def test_inspect_shows_the_latent_cache_and_the_routing(family):
    from optc.commands.inspect import render, summarize

    shown = render(summarize(family[2]))
    assert "kv cache   288 bytes per token over 3 layers" in shown  # 3 x (16 + 8) fp32 values
    assert ("mla        latent 16 + rope key 8 values per token per layer, one copy for all heads (an MHA cache of "
            "these heads: 160); q_lora_rank 32, qk_nope 16, v 16") in shown
    assert ("moe        8 experts of intermediate 32, top-3, in layers 1, 2 (dense MLP: 0), the best 2 of 4 expert "
            "groups, weights x1.5; shared experts of intermediate 64") in shown


def test_bf16_greedy_like_transformers(tmp_path):
    """tests/test_families.py's bf16 rule: tokens equal up to the first difference, and there transformers' own
    bfloat16 logits of both tokens are at most one bfloat16 step apart."""
    from optc.testing import assert_greedy_like_bf16

    hf = random_hf_model(PRESET, torch.bfloat16)
    artifact = build_artifact(tmp_path / "a", None, "dtype=bfloat16", FUSED, model=MODEL)
    prompts = _prompts()[2:]
    completions = Engine.load(artifact).generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert_greedy_like_bf16(hf, prompts, completions, 16)
