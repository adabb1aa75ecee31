"""The seams under the engine: one KV budget for target and draft, the KV-cache spec, the runtime
settings' one home, the cuda_graphs leave-one-out, and artifacts of manifest schema 2."""

import json
import subprocess
import sys
from dataclasses import fields, replace

import pytest
import torch

from optc.commands.compare.variants import Mode, expand
from optc.core.artifact import read, read_manifest
from optc.core.ir import ModelConfig
from optc.core.kv_cache import QMAX, STORAGE_DTYPES, KVCache, KVCacheSpec, dequantize
from optc.core.ops.attention import kv_store_ref
from optc.core.settings import CUDA_GRAPH_BATCH_SIZES, RuntimeSettings, SpeculativeConfig
from optc.frontend.recipe import Recipe, load_recipe
from optc.frontend.sources import load_source
from optc.runtime import Engine, EngineConfig, SamplingParams
from optc.runtime.cuda_graphs import plan_batch_sizes
from optc.testing import build_artifact
from tests.test_engine import ToyModel, ToyTokenizer

CUDA_PASSES = "passes=[fuse_qkv, fuse_gate_up, kv_layout, fuse_add_rmsnorm, fuse_rope_kv, select_kernels, cuda_graphs]"


class TwoLayerDraft(ToyModel):
    """A draft whose blocks cost twice the target's: two layers of the toy cache."""

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[KVCache]:
        layer = ToyModel.allocate_kv_caches
        return [*layer(self, num_blocks, block_size), *layer(self, num_blocks, block_size)]

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 2 * super().kv_bytes_per_block(block_size)


def _pool_bytes(caches: list[KVCache]) -> tuple[int, int]:
    """(all bytes, bytes of the usable blocks: the null block excluded)."""
    total = sum(c.data.nbytes for c in caches)
    return total, total - sum(c.data[0].nbytes for c in caches)


# -- one KV budget for target and draft --------------------------------------------------------------

@pytest.mark.parametrize("budget", [None, 3000, 64 * 30 + 7])
def test_target_and_draft_pools_stay_within_one_budget(budget):
    config = EngineConfig(block_size=4, max_num_seqs=2, max_seq_len=30, kv_cache_memory=budget)
    spec = SpeculativeConfig("draft", 2, draft="toy")
    engine = Engine(ToyModel(), ToyTokenizer(), config, spec, TwoLayerDraft())
    draft = engine.speculator.proposer
    target_all, target_usable = _pool_bytes(engine.runner.kv_caches)
    draft_all, draft_usable = _pool_bytes(draft.runner.kv_caches)
    per_block = ToyModel().kv_bytes_per_block(4) + TwoLayerDraft().kv_bytes_per_block(4)
    limit = budget if budget is not None else 2 * 8 * per_block  # CPU default: what 2 requests of 30 tokens use
    assert target_usable + draft_usable <= limit < target_usable + draft_usable + per_block  # no block wasted
    assert draft.kv_manager.num_blocks == engine.kv_manager.num_blocks  # a request's blocks fit in both
    assert target_all + draft_all == target_usable + draft_usable + per_block  # plus each pool's null block
    if budget is not None:
        alone = Engine(ToyModel(), ToyTokenizer(), config)
        assert alone.kv_manager.num_blocks > engine.kv_manager.num_blocks  # the draft's share came out of the budget


def test_draft_decode_steps_go_through_its_runner():
    spec = SpeculativeConfig("draft", 3, draft="toy", disable_above_num_requests=8, adaptive=False)
    engine = Engine(ToyModel(), ToyTokenizer(), EngineConfig(block_size=4), spec, ToyModel())
    runner = engine.speculator.proposer.runner
    calls = []
    forward = runner.forward
    runner.forward = lambda *args: calls.append(args[0]) or forward(*args)
    engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=6))
    assert any(len(t) > 1 for feeds in calls for t in feeds)  # catching up on the prompt
    assert any(all(len(t) == 1 for t in feeds) for feeds in calls)  # one-token draft decode steps


# -- the KV-cache spec --------------------------------------------------------------------------------

def test_kv_spec_bytes_per_block_is_what_allocation_takes():
    config = load_source("random:tiny").graph.config
    for spec in (KVCacheSpec(16, "float32"), KVCacheSpec(32, "bfloat16")):
        caches = spec.allocate(config, 5, "cpu")
        assert len(caches) == config.num_layers and caches[0].scales is None
        assert sum(c.data.nbytes for c in caches) == 5 * spec.bytes_per_block(config)
        assert caches[0].data.shape == (5, 2, spec.block_size, config.num_kv_heads, config.head_dim)
    assert KVCacheSpec.from_json({"block_size": 16, "dtype": "float16"}) == KVCacheSpec(16, "float16")  # schema 2
    assert KVCacheSpec.from_json(KVCacheSpec(32, "bfloat16").to_json()) == KVCacheSpec(32, "bfloat16")
    for spec in (KVCacheSpec(16, "int8"), KVCacheSpec(32, "fp8_e4m3")):  # data plus an fp32 scale per (token, head)
        caches = spec.allocate(config, 5, "cpu")
        assert caches[0].scales.shape == (5, 2, spec.block_size, config.num_kv_heads)
        assert sum(c.data.nbytes + c.scales.nbytes for c in caches) == 5 * spec.bytes_per_block(config)
        assert caches[0].data.dtype.itemsize == 1 and caches[0].scales.dtype == torch.float32
    with pytest.raises(ValueError, match="KV cache dtype int8 takes scales 'per_token_head', not 'none'"):
        KVCacheSpec(16, "int8", "none")
    with pytest.raises(ValueError, match="KV cache dtype bfloat16 takes scales 'none', not 'per_token_head'"):
        KVCacheSpec(16, "bfloat16", "per_token_head")


def test_kv_store_goes_through_the_cache_object():
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    cache = KVCache(torch.zeros(2, 2, 4, 2, 4, dtype=torch.bfloat16))
    kv_store_ref(k, v, cache, torch.tensor([4, -1, 6]))
    assert torch.equal(cache.data[1, 0, 0], k[0].bfloat16()) and torch.equal(cache.data[1, 1, 2], v[2].bfloat16())
    assert cache.data[1, :, 1].abs().sum() == 0  # slot -1: nothing stored
    with pytest.raises(ValueError, match="torch.int8 KV cache needs its scales"):  # never a blind cast
        KVCache(torch.zeros(2, 2, 4, 2, 4, dtype=torch.int8))


@pytest.mark.parametrize("kv_dtype,step", [("int8", 0.5 / 127), ("fp8_e4m3", 2.0**-4)])
def test_kv_store_quantizes_per_token_and_head_and_reads_back_within_half_a_step(kv_dtype, step):
    # int8: |error| <= half a step of the row's absmax / 127; e4m3 (3 mantissa bits): relative
    # error <= 2**-4 of the value for normal values, 2**-10 of the absmax below them
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 2, 32, generator=g) * 4, torch.randn(5, 2, 32, generator=g) * 0.01
    cache = KVCache(torch.zeros(2, 2, 16, 2, 32, dtype=STORAGE_DTYPES[kv_dtype]), torch.zeros(2, 2, 16, 2),
                    QMAX[kv_dtype])
    kv_store_ref(k, v, cache, torch.tensor([16, 17, -1, 19, 20]))
    stored = dequantize(cache.data[1], cache.scales[1], torch.float32)  # (2, 16, H_kv, D)
    for i, x in enumerate((k, v)):
        kept = x[[0, 1, 3, 4]]
        amax = kept.abs().amax(-1, keepdim=True)
        assert torch.allclose(cache.scales[1, i, [0, 1, 3, 4]], amax[..., 0] / cache.qmax)
        err = (stored[i, [0, 1, 3, 4]] - kept).abs()
        bound = step * amax if kv_dtype == "int8" else step * kept.abs() + 2.0**-10 * amax
        assert (err <= bound * 1.0001).all(), (err / bound).max()
    assert (cache.scales[1, :, 2] == 0).all() and (cache.data[1, :, 2].float() == 0).all()  # slot -1


def test_model_reads_the_manifest_kv_spec(tiny_artifact):
    engine = Engine.load(tiny_artifact)
    spec = read_manifest(tiny_artifact).kv_layout
    assert engine.model.kv_spec == spec == KVCacheSpec(16, "float32")
    assert engine.model.kv_bytes_per_block(16) == spec.bytes_per_block(engine.model.graph.config)


# -- one home for runtime settings ---------------------------------------------------------------------

def test_recipe_manifest_and_engine_share_the_runtime_settings(tiny_artifact):
    assert {f.name for f in fields(RuntimeSettings)} <= {f.name for f in fields(EngineConfig)}
    assert issubclass(EngineConfig, RuntimeSettings)
    assert [f.type for f in fields(Recipe) if f.name == "runtime"] == ["RuntimeSettings"]
    manifest = read_manifest(tiny_artifact)
    assert manifest.runtime == load_recipe("recipes/tiny.yaml").runtime == RuntimeSettings(max_num_seqs=16,
                                                                                          max_seq_len=512)
    assert EngineConfig.from_manifest(manifest).max_num_seqs == 16


def test_recipe_and_runtime_do_not_import_each_other():
    # each side, imported alone in a fresh process, loads nothing of the other
    recipe_alone = ("import sys, optc.frontend.recipe; "
                    "assert not [m for m in sys.modules if m.startswith('optc.runtime')]")
    runtime_alone = ("import sys, optc.runtime.engine, optc.runtime.cuda_graphs, optc.runtime.speculative; "
                     "assert 'optc.frontend.recipe' not in sys.modules")
    for code in (recipe_alone, runtime_alone):
        subprocess.run([sys.executable, "-c", code], check=True)


# -- cuda_graphs leave-one-out ---------------------------------------------------------------------------

def test_leave_one_out_without_cuda_graphs_runs_eager(recipes, tmp_path):
    base = load_recipe(recipes / "tiny.yaml", ["target=cuda", CUDA_PASSES])
    variants = {v.name: v for v in expand(base, Mode.LEAVE_ONE_OUT).variants}
    assert "-cuda_graphs" in variants
    configs = {}
    for name in ("base", "-cuda_graphs"):
        recipe = tmp_path / f"{name}.json"
        recipe.write_text(json.dumps(variants[name].recipe.to_json()))
        out = build_artifact(tmp_path / name, recipe)
        configs[name] = EngineConfig.from_manifest(read(out).manifest)
    planned, dropped = configs["base"], configs["-cuda_graphs"]
    assert planned.cuda_graph_batch_sizes == CUDA_GRAPH_BATCH_SIZES and dropped.cuda_graph_batch_sizes == ()
    assert plan_batch_sizes(planned.cuda_graph_batch_sizes, planned.max_num_seqs) == (1, 2, 4, 8, 16)
    assert plan_batch_sizes(dropped.cuda_graph_batch_sizes, dropped.max_num_seqs) == ()  # no graph: eager


# -- artifacts built before the settings and KV spec became typed ---------------------------------------

def test_a_schema_2_manifest_loads_and_gives_the_same_tokens(tiny_artifact, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(tiny_artifact, old)
    m = json.loads((old / "manifest.json").read_text())
    m["schema_version"] = 2
    m["runtime"]["max_batch_size"] = m["runtime"].pop("max_num_seqs")
    del m["kv_layout"]["scales"]
    (old / "manifest.json").write_text(json.dumps(m))
    assert read_manifest(old) == replace(read_manifest(tiny_artifact))
    prompts, params = ["hello world", "abc"], SamplingParams(max_tokens=8, temperature=0.7, seed=1)
    expected = [c.token_ids for c in Engine.load(tiny_artifact).generate(prompts, params)]
    assert [c.token_ids for c in Engine.load(old).generate(prompts, params)] == expected
    assert Engine.load(old).config == Engine.load(tiny_artifact).config


def test_int8_kv_pool_holds_at_least_1_8x_the_tokens_of_a_bfloat16_one(tiny_int8_kv_artifact):
    # SmolLM2-135M's KV shape: 30 layers, 3 KV heads of 64; scales are 2 x 4 bytes per (token, KV head)
    smollm2 = ModelConfig("LlamaForCausalLM", hidden_size=576, intermediate_size=1536, num_layers=30,
                          num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5,
                          rope_theta=1e5, max_position_embeddings=8192, tie_word_embeddings=True)
    bf16, int8, fp8 = (KVCacheSpec(16, d).bytes_per_token(smollm2) for d in ("bfloat16", "int8", "fp8_e4m3"))
    assert (bf16, int8, fp8) == (30 * 2 * 3 * 64 * 2, 30 * (2 * 3 * 64 + 2 * 3 * 4), 30 * (2 * 3 * 64 + 2 * 3 * 4))
    assert bf16 / int8 >= 1.8
    # the engine sizes its pool with the scales counted, and reports the bytes per token
    budget = 100 * 16 * 160 + 7
    engine = Engine.load(tiny_int8_kv_artifact, kv_cache_memory=budget)
    assert engine.stats().kv_bytes_per_token == 160  # 2 layers x (2 x 2 x 16 + 2 x 2 x 4)
    assert engine.kv_manager.num_blocks == 100 + 1
    assert engine.runner.kv_caches[0].scales.shape == (101, 2, 16, 2)
