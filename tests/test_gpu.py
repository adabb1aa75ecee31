"""On CUDA (the `gpu` marker; skipped without a GPU): random:tiny built with the full pipeline, bound to the
torch references or to the Triton kernels, against transformers on the same GPU.

Tolerances: float32 - last-position logits within 1e-4 x max|logit| (Triton dots may use tf32: 1e-3) and
greedy tokens identical; bfloat16 - logits within 3e-2 x max|logit|, and the same argmax wherever
transformers' top-2 margin exceeds twice that bound (a closer pair may legitimately swap in bf16).
"""

from __future__ import annotations

import pytest
import torch

from optc.runtime import Engine, SamplingParams
from optc.runtime.batch import ForwardBatch
from optc.testing import assert_close, build_artifact, tiny_hf_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PASSES = "[fuse_qkv, fuse_gate_up, fuse_add_rmsnorm, fuse_rope_kv, {kv_layout: {block_size: 16}}, select_kernels]"
TOL = {
    ("float32", "torch"): 1e-4,
    ("float32", "triton"): 1e-3,
    ("bfloat16", "torch"): 3e-2,
    ("bfloat16", "triton"): 3e-2,
}


@pytest.mark.parametrize(("dtype", "kernels"), list(TOL), ids=[f"{d}-{k}" for d, k in TOL])
def test_tiny_on_cuda_matches_transformers(tmp_path, dtype, kernels):
    recipe = tmp_path / "r.yaml"
    target = "cuda" if kernels == "triton" else "cpu"  # a cpu-target artifact binds the references
    recipe.write_text(f"model: random:tiny\ndtype: {dtype}\ntarget: {target}\npasses: {PASSES}\n")
    engine = Engine.load(build_artifact(tmp_path / "a", recipe), device="cuda", num_blocks=256)  # not 90% of the GPU
    bound = {n.attrs.get("kernel", "torch").split(".")[0] for n in engine.model.graph.nodes}
    assert ("triton" in bound) == (kernels == "triton")
    hf = tiny_hf_model(getattr(torch, dtype), "cuda")
    tol = TOL[(dtype, kernels)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 5, 17, 33, 64)]
    for ids in prompts:
        caches = engine.model.allocate_kv_caches(2 + len(ids) // 16, 16)
        batch = ForwardBatch.build([ids], [0], [list(range(1, 2 + len(ids) // 16))], 16)
        ours = engine.model.forward(batch, caches)[-1]
        with torch.no_grad():
            expected = hf(torch.tensor([ids], device="cuda")).logits[0, -1].float()
        assert_close(ours, expected, rtol=tol, what=f"{dtype} {kernels} logits, prompt of {len(ids)}")
        top2 = expected.topk(2).values
        if top2[0] - top2[1] > 2 * tol * expected.abs().max():
            assert int(ours.argmax()) == int(expected.argmax())
    if dtype == "float32":
        out = engine.generate(prompts, SamplingParams(max_tokens=32))
        for ids, c in zip(prompts, out, strict=True):
            ref = hf.generate(
                torch.tensor([ids], device="cuda"),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
            assert c.token_ids == ref, f"prompt of {len(ids)} tokens"
