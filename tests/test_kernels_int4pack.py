"""torch's packed int4 matmuls on prepared int4_g parts against linear_ref: cpu.int4pack (its selection:
target cpu, on by default, N a multiple of 16; a tiny model's logits with it bound) and its CUDA twin
torch.int4pack (tinygemm; off unless enabled): its repacking and selection here, the matmul itself in the
`gpu` test."""

import pytest
import torch

from optc.core.execute import Executor, bind_params, run_dense
from optc.core.formats import Format, FormatKind, dequantize, linear_ref, pack_int4
from optc.core.ops import Param
from optc.frontend.passmanager import PassContext, make_pass
from optc.frontend.sources import load_source
from optc.kernels.int4_cpu import int4pack_linear, prepare_int4pack
from optc.kernels.int4_cuda import inner_k_tiles, int4pack_cuda_linear, nibbles_high_first, prepare_int4pack_cuda
from optc.kernels.registry import KernelQuery, impls, select
from optc.kernels.table_cpu import CPP_KERNELS


def _weight(n, k, group, zero_point, seed=0) -> Param:
    g = torch.Generator().manual_seed(seed)
    fmt = Format(FormatKind.INT4_G, dtype="bfloat16", bits=4, group_size=group, zero_point=zero_point,
                 packing="k8_lsb")
    parts = {"qweight": pack_int4(torch.randint(0, 16, (n, k), generator=g)),
             "scales": (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).to(torch.bfloat16)}
    if zero_point:
        parts["zeros"] = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8)
    return Param(parts, fmt)


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("group,zero_point", [(32, True), (64, False), (128, True)])
def test_int4pack_matches_linear_ref(m, group, zero_point):
    w = _weight(48, 256, group, zero_point)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    prepared = prepare_int4pack({"weight": w, "bias": Param({"weight": bias}, Format(dtype="bfloat16"))})
    assert prepared["bias"].parts["weight"] is bias
    assert set(prepared["weight"].parts) == {"int4pack", "scales_and_zeros"}
    y = int4pack_linear(x, prepared["weight"].parts, w.format, bias)
    ref = linear_ref(x, w.parts, w.format, bias)
    exact = x.double() @ dequantize(w.parts, w.format, torch.float64).T + bias.double()
    assert y.dtype == torch.bfloat16 and y.shape == (m, 48)
    # both round to bfloat16 at the end; the packed kernel also rounds (8 - z) * s to bfloat16
    scale = exact.abs().max()
    assert (ref.double() - exact).abs().max() <= 0.01 * scale
    assert (y.double() - exact).abs().max() <= 0.02 * scale, float((y.double() - exact).abs().max() / scale)
    x3 = x.reshape(1, m, 256)  # leading dimensions are kept
    assert torch.equal(int4pack_linear(x3, prepared["weight"].parts, w.format, bias).reshape(m, 48), y)


def test_int4pack_is_selected_for_cpu_int4_with_whole_tiles_of_16_rows():
    fmt = _weight(48, 256, 64, True).format
    q = KernelQuery("linear", "bfloat16", fmt, (48, 256))
    assert select(q, "cpu").name == "cpu.int4pack"
    assert select(q, "cpu", ("cpu.int4pack",)).name == "cpu.int4pack"  # recipes that opted in still validate
    assert select(q, "cuda").name == "triton.w4a16"  # a cpu kernel never binds for cuda
    # float32 activations: offered, and select_kernels' measurement keeps it only where it wins (M = 1)
    assert select(KernelQuery("linear", "float32", fmt, (48, 256)), "cpu").name == "cpu.int4pack"
    assert select(KernelQuery("linear", "bfloat16", fmt, (40, 256)), "cpu") is None  # N % 16


def test_tinygemm_repacking_and_selection():
    q = torch.randint(0, 16, (24, 96), generator=torch.Generator().manual_seed(3))
    packed = nibbles_high_first(q)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 48)
    assert torch.equal((packed >> 4).long(), q[:, 0::2]) and torch.equal((packed & 15).long(), q[:, 1::2])
    assert [inner_k_tiles(k) for k in (4096, 14336, 576, 1536, 96)] == [8, 8, 4, 8, 2]
    fmt = _weight(48, 256, 64, True).format
    query = lambda dtype="bfloat16", shape=(48, 256), f=fmt: KernelQuery("linear", dtype, f, shape)  # noqa: E731
    enabled = ("torch.int4pack",)
    assert select(query(), "cuda").name == "triton.w4a16"  # off by default
    assert select(query(), "cuda", enabled).name == "torch.int4pack"
    assert select(query("float16"), "cuda", enabled).name == "triton.w4a16"  # bfloat16 activations only
    assert select(query(shape=(44, 256)), "cuda", enabled).name == "triton.w4a16"  # N % 8
    assert select(query(), "cpu", enabled).name == "cpu.int4pack"  # a cuda kernel never binds for cpu


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 5, 32, 300])
@pytest.mark.parametrize("n,k,group,zero_point", [(4096, 4096, 128, True), (14336, 4096, 64, False),
                                                  (1536, 576, 64, True), (1000, 1536, 32, True)])
def test_tinygemm_on_cuda_matches_linear_ref(m, n, k, group, zero_point):
    # Llama-3-8B and SmolLM2 shapes (inner K tiles 8, 4), a ragged N, with and without zero points
    w = _weight(n, k, group, zero_point)
    w = Param({r: t.cuda() for r, t in w.parts.items()}, w.format)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).cuda()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).cuda()
    prepared = prepare_int4pack_cuda({"weight": w})["weight"].parts
    y = int4pack_cuda_linear(x, prepared, w.format, bias)
    exact = x.double() @ dequantize(w.parts, w.format, torch.float64).T + bias.double()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert (y.double() - exact).abs().max() <= 0.02 * exact.abs().max()  # as cpu.int4pack: b rounded to bf16


def test_tiny_model_logits_with_int4pack_bound():
    src = load_source("random:tiny")
    ctx = PassContext(target="cpu", dtype="bfloat16")
    graph, store = src.graph, src.store
    for name, options in (("cast", {"dtype": "bfloat16"}), ("quantize_rtn", {"bits": 4, "group_size": 32}),
                          ("fuse_qkv", {})):
        result = make_pass(name, options).run(graph, store, ctx)
        graph, store = result.graph, result.store
    torch_only = {"disable": ("cpu.int4pack", "cpu.qdot", "cpu.bf16dot", "cpu.bf16dot_logits", *CPP_KERNELS)}
    reference = make_pass("select_kernels", torch_only).run(graph, store, ctx).graph
    graph = make_pass("select_kernels", {"measure": False}).run(graph, store, ctx).graph
    bound = {n.name for n in graph.nodes if n.kernel == "cpu.int4pack"}
    assert bound and bound == {n.name for n in graph.nodes if n.op == "linear" and n.attrs["out_features"] % 16 == 0}
    params = bind_params(graph, store)
    ids = torch.randint(0, graph.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    fast = run_dense(Executor(graph, params, impls({n.kernel for n in graph.nodes} - {"torch"})), ids)
    ref = run_dense(Executor(reference, params), ids)
    assert (fast - ref).abs().max() <= 0.05 * ref.abs().max(), float((fast - ref).abs().max() / ref.abs().max())
    assert all("qweight" in p.parts for p in params.values() if p.format.is_quantized)  # prepared aside, not in place
