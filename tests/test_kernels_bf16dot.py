"""cpu.bf16dot (kernels/cpu_ext/bf16dot.cpp): dense bfloat16 linears within float32 rounding of the exact product, a
row's bits independent of the call's row count and of the ISA path, the launchers' bias, leading dims, torch's GEMM
above ROWS rows and the exact best logits, the references where the extension is absent; the kernel choice keeps
such a kernel over a speculative step's rows."""

import pytest
import torch

from optc.core.formats import Format
from optc.core.ir import Node
from optc.core.ops.linear import logits_ref
from optc.kernels import cpu_ext
from optc.kernels.spec import KernelQuery, KernelSpec
from optc.testing import cpu_extension

DENSE = Format(dtype="bfloat16")


@pytest.fixture(scope="module")
def ext():
    module = cpu_extension()
    if cpu_ext.bf16_isa() is None:
        pytest.skip("bf16dot.cpp NOT TESTED: built, but this CPU has no AVX2 with FMA to run it")
    return module


def _isas(ext) -> list[int]:
    return [cpu_ext.AVX2] + ([cpu_ext.AVX512_BF16] if ext.best_isa()["bf16dot"] == cpu_ext.AVX512_BF16 else [])


def _operands(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()


@pytest.mark.parametrize("shape", [(1, 37, 64), (5, 576, 576), (13, 100, 1536), (20, 3, 32)])
def test_bf16dot_is_the_exact_product_within_float32_rounding_on_each_isa(ext, shape):
    m, n, k = shape
    x, w = _operands(m, n, k)
    exact = x.double() @ w.double().T
    # every partial sum rounds once: |error| <= k * 2^-24 * sum |x_i w_i| (a generous float32 bound)
    bound = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    outs = [ext.bf16dot(x, w, isa) for isa in _isas(ext)]
    for y in outs:
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert ((y.double() - exact).abs() <= bound).all()
    assert all(torch.equal(y, outs[0]) for y in outs)  # the AVX2 path computes AVX-512 BF16's lanes


def test_a_rows_bits_do_not_depend_on_the_calls_rows(ext):
    """Each row of a 17-row call equals that row alone and inside calls of 2 to 16 rows at any position: a decode
    row and its speculative verification row agree."""
    x, w = _operands(17, 200, 576, seed=1)
    for isa in _isas(ext):
        alone = torch.cat([ext.bf16dot(x[i:i + 1], w, isa) for i in range(17)])
        assert torch.equal(ext.bf16dot(x, w, isa), alone)
        for rows in range(2, 17):
            assert torch.equal(ext.bf16dot(x[17 - rows:], w, isa), alone[17 - rows:])


def test_bf16dot_refuses_what_it_cannot_take(ext):
    x, w = _operands(2, 8, 48)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ext.bf16dot(x, w, cpu_ext.bf16_isa())
    x, w = _operands(2, 8, 64)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.bf16dot(x.float(), w, cpu_ext.bf16_isa())


def test_the_launchers_take_leading_dims_bias_and_run_torch_above_their_rows(ext):
    from optc.kernels.cpu_ext import bf16dot

    x, w = _operands(6, 40, 64, seed=2)
    bias = torch.randn(40).bfloat16()
    parts = {"weight": w}
    y = bf16dot.bf16dot_linear(x.view(2, 3, 64), parts, DENSE, bias)
    want = (ext.bf16dot(x, w, cpu_ext.bf16_isa()).bfloat16() + bias).view(2, 3, 40)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    many, _ = _operands(bf16dot.ROWS + 1, 40, 64, seed=3)
    assert torch.equal(bf16dot.bf16dot_linear(many, parts, DENSE), torch.nn.functional.linear(many, w))
    # the logits: float32 sums, each row's best recomputed exactly as logits_ref does
    logits = bf16dot.bf16dot_logits(x, parts, DENSE)
    ref = logits_ref(x, parts, DENSE)
    assert logits.dtype == torch.float32
    top = ref.topk(16, dim=-1).indices
    assert torch.equal(logits.gather(-1, top), ref.gather(-1, top))
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("rows_independent", [True, False])
def test_a_rows_independent_winner_of_one_row_keeps_the_speculative_rows(monkeypatch, rows_independent):
    """Timed: the kernel wins one row and loses every larger bucket. A rows-independent kernel keeps the buckets up
    to SPECULATIVE_ROWS (a decode row and its verification rows sum alike); any other kernel only the bucket it
    won."""
    from optc.kernels import choose

    spec = KernelSpec("cpu.fake", "linear", lambda q: True, "cpu_ext.bf16dot:bf16dot_linear", target="cpu",
                      rows_independent=rows_independent)
    monkeypatch.setattr(choose.Chooser, "_time_bucket", staticmethod(
        lambda node, query, m, fns, params: {"cpu.fake": 1.0 if m == 1 else 3.0, "torch": 2.0}))
    node = Node("qkv", "linear", ["x"], ["y"], {"in_features": 64, "out_features": 96}, {"weight": "w"})
    choice = choose.Chooser().choose(node, KernelQuery("linear", "bfloat16", DENSE, (96, 64)), [spec])
    bound = choose.SPECULATIVE_ROWS if rows_independent else 1
    assert choice.by_m == ((bound, "cpu.fake"), (None, "torch"))


def test_without_the_extension_the_launchers_run_the_references(monkeypatch):
    from optc.kernels.cpu_ext import bf16dot

    monkeypatch.setattr(cpu_ext, "bf16_isa", lambda: None)
    x, w = _operands(3, 40, 64, seed=4)
    parts = {"weight": w}
    assert torch.equal(bf16dot.bf16dot_linear(x, parts, DENSE), torch.nn.functional.linear(x, w))
    assert torch.equal(bf16dot.dense_linear(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(bf16dot.bf16dot_logits(x, parts, DENSE), logits_ref(x, parts, DENSE))
