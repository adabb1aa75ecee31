"""cpu.moe_packed (kernels/moe_cpu.py) against the moe reference: quantized experts through the packed int8 and
int4 matmuls, per expert on its routed tokens only (an expert no token chose included), and bound by
select_kernels where its predicate takes the node."""

from __future__ import annotations

import pytest
import torch

from optc.core.formats import DENSE_F32
from optc.core.ops import Param
from optc.core.ops.moe import moe_ref
from optc.frontend.quant.options import per_expert
from optc.frontend.quant.rtn import make_format, quantize_weight
from optc.kernels.moe_cpu import moe_packed, prepare_moe_packed
from optc.kernels.registry import KernelQuery, candidates
from optc.runtime import Engine, SamplingParams
from optc.testing import assert_close, build_artifact, prefill_logits

E, K, H, N, T = 6, 2, 64, 32, 37  # experts, top-k, hidden, expert intermediate, tokens


def _experts(fmt, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    x[:, 0] = 3.0
    router = torch.randn(E, H, generator=g)
    router[E - 1] = 0.0
    router[E - 1, 0] = -100.0  # expert 5 scores -300 for every token: no token chooses it
    w = {"gate_up": torch.randn(E, 2 * N, H, generator=g) / 8, "down": torch.randn(E, H, N, generator=g) / 6}
    params = {name: Param(per_expert(quantize_weight, t, fmt, name), fmt) for name, t in w.items()}
    return x.to(dtype), router.to(dtype), params


# bf16: measured 0.0043 (int8) and 0.0048 (int4) of the largest output, about one bf16 step
@pytest.mark.parametrize("bits, dtype, rtol", [(8, torch.float32, 1e-5), (8, torch.bfloat16, 1e-2),
                                               (4, torch.bfloat16, 1e-2)], ids=["int8-f32", "int8-bf16", "int4-bf16"])
def test_moe_packed_equals_the_reference(bits, dtype, rtol):
    fmt = make_format(bits, 32, bits == 4, "float32" if dtype == torch.float32 else "bfloat16")
    x, router, params = _experts(fmt, dtype)
    args = (x, router)
    gu, dn = params["gate_up"], params["down"]
    ref = moe_ref(*args, gu.parts, gu.format, dn.parts, dn.format, K, True, "silu")
    prepared = prepare_moe_packed({"router": Param({"weight": router}, DENSE_F32), **params})
    keys = {k.rsplit(".", 1)[0]: None for k in prepared["down"].parts}  # each expert's own parts: `{role}.{e}`
    assert sorted(prepared["down"].parts) == sorted(f"{r}.{e}" for r in keys for e in range(E)), keys
    out = moe_packed(*args, prepared["gate_up"].parts, gu.format, prepared["down"].parts, dn.format, K, True, "silu")
    assert_close(out.float(), ref.float(), rtol=rtol, what=f"moe_packed int{bits} {dtype}")
    ids = torch.softmax(x.float() @ router.float().T, -1).topk(K).indices
    assert (ids != E - 1).all() and len(ids.unique()) == E - 1, "the test wants every expert but one chosen"


def test_the_kernel_serves_only_what_its_matmuls_take():
    def offered(bits, dtype, shape=(E, 2 * N, H)):
        fmt = make_format(bits, 32, False, dtype)
        return [k.name for k in candidates(KernelQuery("moe", dtype, fmt, shape), "cpu")]

    assert offered(8, "float32") == offered(8, "bfloat16") == offered(4, "bfloat16") == ["cpu.moe_packed"]
    assert offered(4, "float32") == []  # float32 int4pack is slower than the reference
    assert offered(8, "float32", (E, 2 * 24, H)) == []  # N = 24: not a multiple of the int8 kernel's 16
    assert [k.name for k in candidates(KernelQuery("moe", "float32", DENSE_F32, (E, 2 * N, H)), "cpu")] == []


def test_a_select_kernels_build_gives_the_reference_build_tokens(tmp_path):
    passes = "passes=[fuse_qkv, fuse_gate_up, {quantize_rtn: {bits: 8}}, kv_layout%s]"
    ref = build_artifact(tmp_path / "ref", None, "dtype=float32", passes % "", model="random:qwen3-moe-tiny")
    ker = build_artifact(tmp_path / "ker", None, "dtype=float32", passes % ", select_kernels",
                         model="random:qwen3-moe-tiny")
    ref_engine, ker_engine = Engine.load(ref), Engine.load(ker)
    bound = {n.name: n.kernel for n in ker_engine.model.graph.nodes if n.op == "moe"}
    assert bound == {"model.layers.0.mlp": "cpu.moe_packed", "model.layers.2.mlp": "cpu.moe_packed"}
    ids = list(range(3, 60))
    assert_close(prefill_logits(ker_engine.model, ids, every_position=True),
                 prefill_logits(ref_engine.model, ids, every_position=True), atol=1e-4, what="moe_packed build")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(40, 80))]
    assert [c.token_ids for c in ker_engine.generate(prompts, params)] == \
        [c.token_ids for c in ref_engine.generate(prompts, params)]
