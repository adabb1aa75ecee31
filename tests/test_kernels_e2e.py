"""End to end: a `target: cuda` artifact of random:tiny served with its Triton kernels bound (under
TRITON_INTERPRET=1 on a machine without CUDA) gives the same greedy tokens as the same recipe built
for `target: cpu` with its CPU kernels disabled (every node on its torch reference). Chunked prefill
(a 32-token budget) makes the engine run both the prefill and the decode attention kernels."""

from pathlib import Path

import pytest

from optc import build
from optc.runtime import Engine, SamplingParams

PROMPTS = [[(i * 13 + j * 7) % 250 + 1 for j in range(1 + 9 * i)] for i in range(5)]  # 1..37 tokens
GREEDY = SamplingParams(max_tokens=6)
FUSIONS = "fuse_qkv, fuse_gate_up, {quant}{{kv_layout: {{block_size: {block_size}}}}}, fuse_add_rmsnorm, fuse_rope_kv"


def _build(tmp: Path, target: str, quant: str, block_size: int) -> Path:
    select = "select_kernels" if target == "cuda" else "{select_kernels: {disable: [cpu.int4pack, cpu.int8pack]}}"
    passes = FUSIONS.format(quant=quant, block_size=block_size) + ", " + select
    recipe = tmp / f"{target}.yaml"
    recipe.write_text(
        f"model: random:tiny\ndtype: float32\ntarget: {target}\npasses: [{passes}]\n"
        "runtime: {max_batch_size: 16, max_seq_len: 512}\n"
    )
    return build.build(build.BuildOptions(recipe=recipe, out=tmp / target, quiet=True))


@pytest.mark.parametrize(
    "quant,block_size,linear_kernel",
    [
        ("", 16, None),
        ("{quantize_rtn: {bits: 4, group_size: 32, zero_point: true}}, ", 32, "triton.w4a16"),
        ("{quantize_rtn: {bits: 8}}, ", 16, "triton.w8a16"),
    ],
    ids=["dense-bs16", "int4-bs32", "int8-bs16"],
)
def test_triton_bound_artifact_matches_reference_greedy_tokens(tmp_path, quant, block_size, linear_kernel):
    cuda = Engine.load(_build(tmp_path, "cuda", quant, block_size), max_num_batched_tokens=32)
    cpu = Engine.load(_build(tmp_path, "cpu", quant, block_size), max_num_batched_tokens=32)
    kernels = {n.attrs["kernel"] for n in cuda.model.graph.nodes}
    assert {"triton.paged_attention", "triton.rope_kv_store", "triton.add_rms_norm"} <= kernels
    assert linear_kernel is None or linear_kernel in kernels
    assert {n.attrs["kernel"] for n in cpu.model.graph.nodes} == {"torch"}
    out = [c.token_ids for c in cuda.generate(PROMPTS, GREEDY)]
    assert out == [c.token_ids for c in cpu.generate(PROMPTS, GREEDY)]
    assert all(len(t) == 6 for t in out)


@pytest.mark.slow
def test_smollm2_triton_bound_matches_reference_greedy_tokens(tmp_path, recipes, smollm2_f32_artifact):
    """SmolLM2 (recipes/smollm2-bf16.yaml in float32) bound to its Triton kernels vs the torch references."""
    from optc.testing import build_artifact

    out = build_artifact(tmp_path / "cuda", recipes / "smollm2-bf16.yaml", "dtype=float32", "target=cuda")
    cuda = Engine.load(out, max_num_batched_tokens=32)
    kernels = {n.attrs["kernel"] for n in cuda.model.graph.nodes}
    assert {"triton.paged_attention", "triton.rope_kv_store", "triton.add_rms_norm", "triton.silu_mul"} <= kernels
    prompts = ["The capital of France is", "def add(a, b):"]
    params = SamplingParams(max_tokens=8)
    reference = Engine.load(smollm2_f32_artifact, max_num_batched_tokens=32)
    assert [c.token_ids for c in cuda.generate(prompts, params)] == [
        c.token_ids for c in reference.generate(prompts, params)
    ]
