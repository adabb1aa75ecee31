"""The families beyond Llama through the quantization passes and tensor parallelism, on their random
presets: int8, int4 (RTN, GPTQ and AWQ, whose scales fold into Gemma's (1 + w) norms), fp8 and SmoothQuant
W8A8 builds run and stay within a KL bound of the float32 build (`optc eval`'s numbers; AWQ and GPTQ below
RTN), and a tensor-parallel engine at every size the shapes allow gives the one-rank engine's tokens and
logits.
"""

from __future__ import annotations

import pytest
import torch

from optc.commands.eval import evaluate, load_model
from optc.core.artifact import read
from optc.core.ops.sharding import allowed_sizes
from optc.runtime import Engine, SamplingParams
from optc.testing import assert_close, build_artifact

PRESETS = ["qwen3-tiny", "gemma2-tiny", "gemma3-tiny", "phi3-tiny"]
CALIBRATION = "calibration={source: 'builtin:pydoc', samples: 8, seq_len: 64, seed: 0}"
METHODS = {  # method -> (its passes, the KL bound vs float32 on these presets: measured 0.0001-0.036)
    "int8": ("{quantize_rtn: {bits: 8}}", 0.002),
    "int4-rtn": ("{quantize_rtn: {bits: 4, group_size: 32}}", 0.06),
    "int4-awq": ("{quantize_awq: {bits: 4, group_size: 32, zero_point: true}}", 0.05),
    "int4-gptq": ("{quantize_gptq: {bits: 4, group_size: 32}}", 0.05),
    "fp8": ("{quantize_fp8: {}}", 0.01),
    "w8a8-smoothquant": ("smoothquant, {quantize_rtn: {bits: 8, activations: dynamic}}", 0.002),
}
TP_SIZES = {"qwen3-tiny": [1, 2, 4], "gemma2-tiny": [1, 2, 4], "gemma3-tiny": [1, 2, 4], "phi3-tiny": [1, 2, 4]}


@pytest.fixture(scope="module", params=PRESETS)
def reference(request, tmp_path_factory):
    preset = request.param
    out = tmp_path_factory.mktemp(preset)
    return preset, out, load_model(str(build_artifact(out / "f32", None, "dtype=float32", "passes=[]",
                                                      model=f"random:{preset}")))


def _quantized(preset, out, method) -> dict:
    passes, _ = METHODS[method]
    artifact = build_artifact(out / method, None, "dtype=float32", CALIBRATION,
                              f"passes=[fuse_qkv, fuse_gate_up, {passes}, fuse_add_rmsnorm, fuse_rope_kv, kv_layout]",
                              model=f"random:{preset}")
    tokens = Engine.load(artifact).generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    assert len(tokens) == 4
    return artifact


def test_quantized_builds_stay_within_kl_of_float32(reference):
    preset, out, f32 = reference
    kl = {}
    for method, (_, bound) in METHODS.items():
        q = evaluate(load_model(str(_quantized(preset, out, method))), f32, max_tokens=512, window=128)
        kl[method] = q["kld"]
        assert 0 <= q["kld"] < bound, f"{preset} {method}: KL {q['kld']:.4f} >= {bound}"
    for calibrated in ("int4-awq", "int4-gptq"):
        assert kl[calibrated] < kl["int4-rtn"], f"{preset}: {calibrated}'s KL {kl[calibrated]:.4f} >= RTN's"


def test_awq_folds_its_scales_into_the_input_norms(reference):
    # run after the KL test built the artifacts: AWQ's 1/s lives in the norms before q/k/v (Gemma's (1 + w)
    # norms too), so they differ from the RTN build's, which are the checkpoint's
    preset, out, _ = reference
    awq, rtn = read(out / "int4-awq"), read(out / "int4-rtn")
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(awq.store.get(norm), rtn.store.get(norm)), f"{preset}: AWQ folded nothing into {norm}"


@pytest.mark.parametrize("preset", PRESETS)
def test_tensor_parallel_sizes_equal_one_rank(preset, tmp_path):
    artifact = build_artifact(tmp_path / "a", None, "dtype=float32",
                              "passes=[fuse_qkv, fuse_gate_up, fuse_add_rmsnorm, fuse_rope_kv, kv_layout]",
                              model=f"random:{preset}")
    assert allowed_sizes(read(artifact).graph) == TP_SIZES[preset]
    prompts = [[(5 * i + 3 * j) % 256 for j in range(2 + 9 * i)] for i in range(5)]  # up to 38 tokens: windows
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    one = Engine.load(artifact, max_num_batched_tokens=16)
    want = [c.token_ids for c in one.generate(prompts, params)]
    num_groups = len(one.model.kv_groups)  # KV-cache groups: a block list each, one after the other
    logits_args = ([prompts[4][:20]], [0], [list(range(1, 1 + 2 * num_groups))], [20])
    for size in TP_SIZES[preset][1:]:
        engine = Engine.load(artifact, tensor_parallel_size=size, max_num_batched_tokens=16)
        try:
            assert [c.token_ids for c in engine.generate(prompts, params)] == want, f"{preset} at N = {size}"
            assert_close(engine.runner.forward(*logits_args), one.runner.forward(*logits_args), atol=1e-4,
                         what=f"{preset} logits at N = {size}")
        finally:
            engine.close()
    assert torch.isfinite(one.runner.forward(*logits_args)).all()
