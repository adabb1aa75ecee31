"""cpu.int8pack: torch's int8 weight-only CPU matmul against linear_ref, its selection predicate
(K a multiple of 16) and a tiny model's logits with it bound."""

import pytest
import torch

from optc.core.execute import Executor, bind_params, run_dense
from optc.core.formats import Format, FormatKind, dequantize, linear_ref
from optc.core.ops import Param
from optc.frontend.passmanager import PassContext, make_pass
from optc.frontend.sources import load_source
from optc.kernels.int8_cpu import int8pack_linear
from optc.kernels.registry import KernelQuery, candidates, impls
from optc.kernels.table_cpu import CPP_KERNELS


def _weight(n, k, dtype, seed=0) -> Param:
    g = torch.Generator().manual_seed(seed)
    fmt = Format(FormatKind.INT8_WO, dtype=dtype, bits=8)
    parts = {"qweight": torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
             "scales": (torch.rand(n, generator=g) * 0.02 + 0.001).to(getattr(torch, dtype))}
    return Param(parts, fmt)


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("n,k", [(48, 256), (17, 80), (40, 16)])
@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.01), ("float32", 1e-5)])
def test_int8pack_matches_linear_ref(m, n, k, dtype, tol):
    w = _weight(n, k, dtype)
    dt = getattr(torch, dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dt)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dt)
    y = int8pack_linear(x, w.parts, w.format, bias)
    ref = linear_ref(x, w.parts, w.format, bias)
    exact = x.double() @ dequantize(w.parts, w.format, torch.float64).T + bias.double()
    scale = exact.abs().max()
    assert y.dtype == dt and y.shape == (m, n)
    assert (ref.double() - exact).abs().max() <= tol * scale
    assert (y.double() - exact).abs().max() <= tol * scale, float((y.double() - exact).abs().max() / scale)
    x3 = x.reshape(1, m, k)  # leading dimensions are kept
    assert torch.equal(int8pack_linear(x3, w.parts, w.format, bias).reshape(m, n), y)


def test_int8pack_is_offered_for_cpu_int8_with_k_a_multiple_of_16():
    fmt = _weight(48, 256, "bfloat16").format
    names = [s.name for s in candidates(KernelQuery("linear", "bfloat16", fmt, (48, 256)), "cpu")]
    assert names == ["cpu.int8pack", "cpu.qdot"]
    assert not candidates(KernelQuery("linear", "bfloat16", fmt, (48, 104)), "cpu")  # wrong rows there; qdot: K % 32
    assert [s.name for s in candidates(KernelQuery("linear", "float32", fmt, (48, 256)), "cuda")] == ["triton.w8a16"]


def test_tiny_model_logits_with_int8pack_bound():
    src = load_source("random:tiny")
    ctx = PassContext(target="cpu", dtype="bfloat16")
    graph, store = src.graph, src.store
    for name, options in (("cast", {"dtype": "bfloat16"}), ("quantize_rtn", {"bits": 8}), ("fuse_qkv", {})):
        result = make_pass(name, options).run(graph, store, ctx)
        graph, store = result.graph, result.store
    torch_only = {"disable": ("cpu.int8pack", "cpu.qdot", "cpu.bf16dot", "cpu.bf16dot_logits", *CPP_KERNELS)}
    reference = make_pass("select_kernels", torch_only).run(graph, store, ctx).graph
    graph = make_pass("select_kernels", {"measure": False}).run(graph, store, ctx).graph
    bound = {n.name for n in graph.nodes if n.kernel == "cpu.int8pack"}
    assert bound == {n.name for n in graph.nodes if n.op == "linear"}
    params = bind_params(graph, store)
    ids = torch.randint(0, graph.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    fast = run_dense(Executor(graph, params, impls({n.kernel for n in graph.nodes} - {"torch"})), ids)
    ref = run_dense(Executor(reference, params), ids)
    assert (fast - ref).abs().max() <= 0.05 * ref.abs().max(), float((fast - ref).abs().max() / ref.abs().max())


UNALIGNED = """
import torch
from optc.core.formats import Format, FormatKind, linear_ref
from optc.core.ir import Node
from optc.core.ops import Param
from optc.kernels.registry import impls

# a weight and an x that start 8 bytes past a 64-byte boundary, as safetensors offsets leave them: the
# bare kernel crashes on them with M >= 8 (torch 2.13); bound through the registry it must not
g = torch.Generator().manual_seed(0)
n, k = 4096, 576
buf = torch.empty(n * k + 64, dtype=torch.int8)
q = buf[8:8 + n * k].view(n, k)
q.copy_(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8))
fmt = Format(FormatKind.INT8_WO, dtype="bfloat16", bits=8)
params = {"weight": Param({"qweight": q, "scales": torch.rand(n, generator=g).bfloat16() * 0.01}, fmt)}
node = Node("l", "linear", ["x"], ["y"], {"in_features": k, "out_features": n, "kernel": "cpu.int8pack"},
            {"weight": "w"})
impl = impls(["cpu.int8pack"])["cpu.int8pack"]
for m in (1, 8, 32):
    xs = torch.randn(m * k + 4, generator=g).bfloat16()[4:].view(m, k)
    assert q.data_ptr() % 64 and xs.data_ptr() % 64
    y = impl(node, [xs], params, None)[0]
    ref = linear_ref(xs, params["weight"].parts, fmt)
    assert (y.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()
print("ok")
"""


def test_int8pack_through_the_registry_takes_unaligned_weights_and_inputs():
    # in a subprocess: a regression is a segmentation fault, which would end the test session
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", UNALIGNED], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
