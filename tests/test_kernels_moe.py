"""The fused MoE kernel (kernels/moe_fused.py) against the moe reference (optc/core/ops/moe.py), under the
Triton interpreter without a GPU: several experts, top-2 and top-3, token counts that are not multiples of
the tile, an expert no token chooses, DeepSeek's grouped routing and scale, dense float32 / bfloat16 and
int8_wo / int4_g experts; the sort's exact tiles; the kernel table's predicate; and the kernel compiled for
sm_90 at Mixtral-8x7B's and Qwen3-MoE-30B-A3B's shapes in bfloat16, without register spills."""

from __future__ import annotations

import pytest
import torch

from optc.core.formats import Format, FormatKind
from optc.core.ops.moe import moe_ref
from optc.testing import assert_close

pytest.importorskip("triton")

E, H, N = 6, 64, 96  # experts, hidden, expert intermediate (not a multiple of the 64-column tile)


def _experts(fmt: Format | None, dtype: torch.dtype, tokens: int, seed: int = 0):
    """x (T, H), a router whose last expert no token chooses, and gate_up / down parts in `fmt` (None: dense)."""
    from optc.frontend.quant.options import per_expert
    from optc.frontend.quant.rtn import quantize_weight

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    x[:, 0] = 3.0
    router = torch.randn(E, H, generator=g)
    router[E - 1] = 0.0
    router[E - 1, 0] = -100.0  # expert 5 scores -300 for every token
    w = {"gate_up": torch.randn(E, 2 * N, H, generator=g) / 8, "down": torch.randn(E, H, N, generator=g) / 6}
    if fmt is None:
        fmt = Format(dtype=str(dtype).removeprefix("torch."))
        parts = {name: {"weight": t.to(dtype)} for name, t in w.items()}
    else:
        parts = {name: per_expert(quantize_weight, t, fmt, name) for name, t in w.items()}
    return x.to(dtype), router.to(dtype), parts, fmt


def _both(x, router, parts, fmt, top_k, renormalize, **attrs):
    from optc.kernels.moe_fused import fused_moe

    args = (x, router, parts["gate_up"], fmt, parts["down"], fmt, top_k, renormalize, "silu")
    ids = torch.softmax(x.float() @ router.float().T, -1).topk(top_k).indices
    assert (ids != E - 1).all(), "the test wants an expert that receives no tokens"
    return fused_moe(*args, **attrs), moe_ref(*args, **attrs)


# bf16 (one bf16 step of the largest output, 2^-7 of it): top-2 measured bit-identical (the same roundings in the same
# order; the interpreter's bf16 casts rounded by hand, _dot.to_dtype), top-3 0.43% in 3% of elements (its three slots
# summed with one rounding, the reference's with two)
@pytest.mark.parametrize("weights, dtype, tokens, top_k, attrs, rtol", [
    (None, torch.float32, 13, 2, {}, 1e-5),
    (None, torch.float32, 101, 3, {"num_groups": 3, "topk_groups": 2, "routed_scale": 2.5}, 1e-5),  # large tiles
    (None, torch.bfloat16, 21, 3, {"round_weights": True}, 2**-7),
    (None, torch.float16, 19, 2, {}, 2**-10),  # one fp16 step; measured 1e-4 (the interpreter's fp16 dot)
    (8, torch.bfloat16, 21, 2, {}, 2**-7),
    (4, torch.bfloat16, 13, 2, {}, 2**-7),
    (4, torch.float32, 5, 3, {}, 1e-5),
], ids=["dense-f32-top2", "dense-f32-top3-groups-large", "dense-bf16-top3-round", "dense-f16-top2", "int8-bf16-top2",
        "int4zp-bf16-top2", "int4-f32-top3"])
def test_fused_moe_equals_the_reference(weights, dtype, tokens, top_k, attrs, rtol):
    from optc.frontend.quant.rtn import make_format

    fmt = None if weights is None else make_format(weights, 32, weights == 4 and dtype == torch.bfloat16,
                                                   str(dtype).removeprefix("torch."))
    x, router, parts, fmt = _experts(fmt, dtype, tokens)
    renormalize = "num_groups" not in attrs
    got, want = _both(x, router, parts, fmt, top_k, renormalize, **attrs)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape == (tokens, H)
    assert_close(got.float(), want.float(), rtol=rtol,
                 what=f"fused moe {fmt.label} {dtype} T={tokens} top-{top_k} {attrs}")


def test_the_bound_kernel_runs_a_moe_node_as_its_reference_does():
    # through the kernel table and the op's node -> arguments adapter, as the executor calls it: DeepSeek-V2's
    # routing attrs (fp32 router, 3 groups keep 2, x2.5, not renormalized) reach the launcher's route()
    from optc.core.formats import DENSE_F32
    from optc.core.ir import Node
    from optc.core.ops import OPS, Param
    from optc.kernels.registry import impls

    x, router, parts, fmt = _experts(None, torch.float32, 11, seed=1)
    attrs = {"num_experts": E, "intermediate_size": N, "top_k": 3, "scoring": "softmax", "renormalize": False,
             "act": "silu", "routed_scale": 2.5, "num_groups": 3, "topk_groups": 2, "float_router": True,
             "kernel": "triton.fused_moe"}
    node = Node("model.layers.0.mlp", "moe", ["x"], ["y"], attrs, {"router": "r", "gate_up": "gu", "down": "d"})
    params = {"router": Param({"weight": router}, DENSE_F32), "gate_up": Param(parts["gate_up"], fmt),
              "down": Param(parts["down"], fmt)}
    (got,) = impls(["triton.fused_moe"])["triton.fused_moe"](node, [x], params, None)
    (want,) = OPS["moe"].ref(node, [x], params, None)
    assert_close(got, want, rtol=1e-5, what="triton.fused_moe bound to a moe node")
    assert not torch.equal(want, OPS["moe"].ref(Node(**{**vars(node), "attrs": {**attrs, "num_groups": 1}}),
                                                [x], params, None)[0]), "the groups must change the routing"


def test_the_sort_pads_each_expert_to_whole_tiles():
    from optc.kernels.moe_fused import _sort_by_expert

    # rows 0..6 of 4 experts at tiles of 2: expert 0 rows 1, 4; expert 1 none; expert 2 rows 0, 3, 5; expert 3 row 2, 6
    rows, tiles = _sort_by_expert(torch.tensor([2, 0, 3, 2, 0, 2, 3]), 4, 2)
    pad = 7
    assert rows.tolist() == [1, 4, 0, 3, 5, pad, 2, 6] + [pad] * (len(rows) - 8)
    assert tiles.tolist() == [0, 2, 2, 3] + [-1] * (len(tiles) - 4)
    assert len(tiles) == 4 + 4  # the bound: cdiv(7, 2) + min(4, 7)


def test_the_kernel_table_offers_it_only_when_enabled():
    from optc.frontend.quant.rtn import make_format
    from optc.kernels.registry import KernelQuery, candidates

    def offered(fmt, dtype="bfloat16", shape=(E, 2 * N, H), act="silu"):
        q = KernelQuery("moe", dtype, fmt, shape, act=act)
        return [k.name for k in candidates(q, "cuda", ("triton.fused_moe",))], [k.name for k in candidates(q, "cuda")]

    dense, int8, int4 = (Format(dtype="bfloat16"), make_format(8, None, False, "bfloat16"),
                         make_format(4, 32, True, "bfloat16"))
    for fmt in (dense, int8, int4):
        assert offered(fmt) == (["triton.fused_moe"], []), fmt
    assert offered(Format(kind=FormatKind.FP8_E4M3, dtype="bfloat16"))[0] == []  # fp8 experts: the reference
    assert offered(make_format(4, 32, False, "bfloat16"), act="gelu")[0] == []


def test_fused_moe_compiles_for_sm90_at_mixtral_and_qwen3_moe_sizes(tmp_path):
    """bf16 at Mixtral-8x7B's experts (8 x (2 x 14336, 4096), top-2) and Qwen3-MoE-30B-A3B's (128 x (2 x 768,
    2048), top-8), dense, int8 and int4 (group 128), at a decode step's and a prefill's token counts: compiled in a
    process without the interpreter (kernels/compile_only.py), fitting shared memory without register spills."""
    import json
    import os
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "compile.py"
    script.write_text(textwrap.dedent('''
        import json
        import torch
        from optc.core.formats import Format
        from optc.frontend.quant.rtn import make_format
        from optc.kernels.compile_only import compile_only
        from optc.kernels.moe_fused import fused_moe

        def parts(fmt, e, n, k):
            if fmt.bits == 8:
                return {"qweight": torch.empty(e, n, k, dtype=torch.int8),
                        "scales": torch.empty(e, n, dtype=torch.bfloat16)}
            if fmt.bits == 4:
                return {"qweight": torch.empty(e, n, k // 8, dtype=torch.int32),
                        "scales": torch.empty(e, n, k // 128, dtype=torch.bfloat16)}
            return {"weight": torch.empty(e, n, k, dtype=torch.bfloat16)}

        out = []
        for e, h, i, k in ((8, 4096, 14336, 2), (128, 2048, 768, 8)):
            for fmt in (Format(dtype="bfloat16"), make_format(8, None, False, "bfloat16"),
                        make_format(4, 128, False, "bfloat16")):
                for tokens in (4, 1024):
                    g = torch.Generator().manual_seed(0)
                    x = torch.randn(tokens, h, generator=g).bfloat16()
                    router = torch.randn(e, h, generator=g).bfloat16()
                    with compile_only(90) as launches:
                        fused_moe(x, router, parts(fmt, e, 2 * i, h), fmt, parts(fmt, e, h, i), fmt, k, True)
                    for launch in launches:
                        (c,) = launch.configs
                        out.append(dict(kernel=launch.kernel, fits=launch.fits, registers=c.registers,
                                        spills=c.spill_bytes, gate_up=c.config["GATE_UP"], block_m=c.config["BLOCK_M"],
                                        weight=c.config["WEIGHT"], shape=[e, h, i, k, tokens]))
        print(json.dumps(out))
    '''))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    compiled = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(compiled) == 2 * 3 * 2 * 2  # per model, format and token count: the gate_up and the down launch
    for c in compiled:
        assert c["kernel"] == "_moe_gemm_kernel" and c["fits"] and c["registers"] > 0 and c["spills"] == 0, c
    assert {(c["gate_up"], c["block_m"], c["weight"]) for c in compiled} == \
        {(g, m, w) for g in (True, False) for m in (16, 64) for w in (0, 1, 2)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(8, 4096, 14336, 2), (128, 2048, 768, 8)], ids=["mixtral-8x7b", "qwen3-moe-30b"])
@pytest.mark.parametrize("bits", [None, 8, 4], ids=["dense", "int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 33, 300])
def test_fused_moe_on_cuda_model_shapes(shape, bits, tokens):
    # random stored parts at the models' shapes (quantizing 8 x 28672 x 4096 on the host would take minutes);
    # bf16 on the tensor cores against the reference's cuBLAS matmuls: sums in another order, so two bf16 steps
    from optc.frontend.quant.rtn import make_format
    from optc.kernels.moe_fused import fused_moe

    e, h, i, k = shape
    g = torch.Generator(device="cuda").manual_seed(0)

    def parts(n, kk):
        if bits is None:
            return {"weight": (torch.randn(e, n, kk, generator=g, device="cuda") / kk ** 0.5).bfloat16()}
        if bits == 8:
            return {"qweight": torch.randint(-127, 128, (e, n, kk), generator=g, device="cuda", dtype=torch.int8),
                    "scales": (torch.rand(e, n, generator=g, device="cuda") / (127 * kk ** 0.5)).bfloat16()}
        return {"qweight": torch.randint(-2**31, 2**31 - 1, (e, n, kk // 8), generator=g, device="cuda",
                                         dtype=torch.int32),
                "scales": (torch.rand(e, n, kk // 128, generator=g, device="cuda") / (8 * kk ** 0.5)).bfloat16()}

    fmt = Format(dtype="bfloat16") if bits is None else make_format(bits, 128 if bits == 4 else None, False,
                                                                   "bfloat16")
    x = torch.randn(tokens, h, generator=g, device="cuda").bfloat16()
    router = torch.randn(e, h, generator=g, device="cuda").bfloat16()
    args = (x, router, parts(2 * i, h), fmt, parts(h, i), fmt, k, True, "silu")
    assert_close(fused_moe(*args).float(), moe_ref(*args).float(), rtol=2**-6,
                 what=f"fused moe on cuda {shape} {fmt.label} T={tokens}")
