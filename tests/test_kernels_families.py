"""End to end per family: a `target: cuda` build of each family's random preset (Qwen3, Gemma 2, Gemma 3,
Phi-3; optc/frontend/sources.py PRESETS) bound to its Triton kernels (under TRITON_INTERPRET=1 on a
machine without CUDA) against the same passes built for `target: cpu` (every node on its torch
reference), float32.

Each family's attributes reach a kernel: QK-norm rows (Qwen3, Gemma 3) in triton.rms_norm, Gemma's
offset norms, GeGLU in triton.gated_act, Gemma 2's soft-capped scores and both Gemmas' sliding windows in
triton.paged_attention, Phi-3's partial rotary in triton.rope_kv_store. Prompts are longer than the
windows (12 and 20 tokens) and a 16-token chunk budget runs the prefill kernel on chunks after context
and the decode kernel across block boundaries. Greedy tokens must be the reference's; teacher-forced
logits within 1e-3 of the largest logit (tests/test_kernels_e2e.py's bound), the same argmax wherever
the reference's top two are further apart than twice that.
"""

from pathlib import Path

import pytest
import torch

from optc.kernels.registry import KERNELS
from optc.runtime import Engine, SamplingParams
from optc.testing import assert_close, build_artifact
from tests.test_kernels_e2e import assert_same_logits

PASSES = "fuse_qkv, fuse_gate_up, {kv_layout: {block_size: 16}}, fuse_add_rmsnorm, fuse_rope_kv"
# the CPU build is the reference: every CPU kernel off
CPU_SELECT = f"{{select_kernels: {{disable: [{', '.join(k for k, s in KERNELS.items() if s.target == 'cpu')}]}}}}"
RTOL = 1e-3
NEW_TOKENS = 5
# preset: (prompt lengths, what must be bound to a Triton kernel: (op, attribute or None))
FAMILIES = {
    "qwen3-tiny": ((3, 21), {("rms_norm", "head_dim"), ("attention", None), ("gated_act", None)}),
    "gemma2-tiny": ((5, 30), {("attention", "softcap"), ("attention", "window"), ("gated_act", "act"),
                              ("add_rms_norm", "offset")}),
    "gemma3-tiny": ((5, 30), {("attention", "window"), ("rms_norm", "head_dim"), ("gated_act", "act")}),
    "phi3-tiny": ((3, 21), {("rope_kv_store", "rotary_dim"), ("attention", None)}),
}


def _build(tmp: Path, preset: str, target: str) -> Path:
    select = "select_kernels" if target == "cuda" else CPU_SELECT
    return build_artifact(tmp / target, None, "dtype=float32", f"target={target}", f"passes=[{PASSES}, {select}]",
                          model=f"random:{preset}")


def _prompts(lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def _bound(engine: Engine) -> set[tuple[str, str | None]]:
    """(op, family attribute) pairs of the nodes bound to a Triton kernel (None: the node has none of them)."""
    attrs = ("softcap", "window", "act", "offset", "rotary_dim", "head_dim")
    pairs = set()
    for n in engine.model.graph.nodes:
        if n.attrs["kernel"].startswith("triton."):
            present = [a for a in attrs if n.attrs.get(a) and not (a == "act" and n.attrs[a] == "silu")
                       and not (a == "head_dim" and not n.op.endswith("rms_norm"))]
            pairs |= {(n.op, a) for a in present} or {(n.op, None)}
    return pairs


@pytest.mark.parametrize("preset", list(FAMILIES))
def test_family_triton_bound_build_matches_reference(tmp_path, preset):
    lengths, must_bind = FAMILIES[preset]
    cuda = Engine.load(_build(tmp_path, preset, "cuda"), device="cpu", max_num_batched_tokens=16, num_blocks=32)
    reference = Engine.load(_build(tmp_path, preset, "cpu"), device="cpu", max_num_batched_tokens=16, num_blocks=32)
    assert must_bind <= _bound(cuda), f"{preset}: {sorted(must_bind - _bound(cuda), key=str)} on torch"
    assert {n.attrs["kernel"] for n in reference.model.graph.nodes} == {"torch"}
    prompts = _prompts(lengths)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    want = [c.token_ids for c in reference.generate(prompts, params)]
    assert [c.token_ids for c in cuda.generate(prompts, params)] == want, preset
    assert_same_logits(cuda, reference, prompts[-1] + want[-1], 16, RTOL, preset)  # past the windows, 3 blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", list(FAMILIES))
def test_family_triton_bound_build_matches_reference_on_cuda(tmp_path, preset, dtype):
    """The compiled twin: the kernels on the GPU against the references on the GPU; logits within the bound
    (bf16: 2e-2 of the largest logit, tests/test_bf16_parity.py's scale), greedy tokens not compared
    (fp32 dots may round differently compiled: tf32 is off, but split and tile orders differ)."""
    lengths, _ = FAMILIES[preset]
    builds = {t: build_artifact(tmp_path / t, None, f"dtype={dtype}", f"target={t}",
                                f"passes=[{PASSES}, {'select_kernels' if t == 'cuda' else CPU_SELECT}]",
                                model=f"random:{preset}") for t in ("cuda", "cpu")}
    cuda, reference = (Engine.load(builds[t], device="cuda", max_num_batched_tokens=16, num_blocks=32)
                       for t in ("cuda", "cpu"))
    rtol = RTOL if dtype == "float32" else 2e-2
    for ids in _prompts(lengths):
        ids = ids + ids  # longer than the windows
        num_blocks = -(-len(ids) // 16) * len(cuda.model.kv_groups)  # a block list per KV-cache group
        args = ([ids], [0], [list(range(1, 1 + num_blocks))], [len(ids)])
        expected = reference.runner.forward(*args).float().clone()
        assert_close(cuda.runner.forward(*args).float(), expected, rtol=rtol, what=f"{preset} {dtype} logits")
