"""How far `torch._scaled_mm` (kernels/w8a8.py) may lie from the exact product on identical 8-bit inputs:
`accumulation_bound`'s arithmetic, a CPU emulation of a tensor core that keeps ACCUMULATOR_BITS of its
running sum (the bound covers it; fp32 rounding alone would not), the CPU `_scaled_mm` within it, and on a
GPU of sm_89 or newer the compiled kernel within it at Llama-3-8B shapes: a kernel defect shows there, on
one matmul, apart from the error W8A8 models propagate across layers (tests/test_kernels_e2e.py)."""

import math

import pytest
import torch

from optc.core.formats import Activations, Format, FormatKind
from optc.core.formats.activations import quantize_rows_fp8
from optc.core.formats.fp8_e4m3 import quantize_fp8_weight
from optc.core.ops import Param
from optc.kernels import w8a8


def _inputs(m, n, k, dtype, device="cpu", seed=0):
    """x (M, K) in dtype and the prepared fp8 weight of a random (N, K) linear, per-channel scales."""
    g = torch.Generator().manual_seed(seed)
    fmt = Format(FormatKind.FP8_E4M3, dtype=str(dtype).removeprefix("torch."), activations=Activations.DYNAMIC)
    parts = quantize_fp8_weight(torch.randn(n, k, generator=g), fmt)
    parts = {r: t.to(device) for r, t in parts.items()}
    prepared = w8a8.prepare_w8a8({"weight": Param(parts, fmt)})["weight"].parts
    x = (torch.randn(m, k, generator=g) * (1 + 3 * torch.rand(k, generator=g))).to(dtype).to(device)
    return x, prepared, fmt


def _exact(xq, sx, qweight_t, sw):
    """The product of the 8-bit inputs in float64 (exact sums: each fp8 product has 8 significant bits)."""
    return (xq.double() @ qweight_t.double()) * sx.double() * sw.double()


def _truncating_sum(products: torch.Tensor, bits: int, mma_k: int) -> torch.Tensor:
    """Σ over the last dim of `products` (float64) the way the bound models the tensor cores: MMA_K products
    added exactly to the running sum, which then keeps `bits` significant bits, cut toward zero."""
    acc = torch.zeros(products.shape[:-1], dtype=torch.float64)
    for k0 in range(0, products.shape[-1], mma_k):
        acc = acc + products[..., k0:k0 + mma_k].sum(-1)
        exp = torch.floor(torch.log2(acc.abs().clamp_min(1e-300)))
        unit = torch.exp2(exp - (bits - 1))
        acc = torch.where(acc == 0, acc, torch.trunc(acc / unit) * unit)
    return acc


def test_bound_arithmetic_on_a_hand_example():
    # 64 products of 1 x 1, scales 1, fp32 out: two instructions (ceil(64 / 32)), each a 2^-13 cut of the sum
    xq = torch.ones(1, 64).to(torch.float8_e4m3fn)
    qt = torch.ones(64, 1).to(torch.float8_e4m3fn)
    one = torch.ones(1, 1)
    y = torch.full((1, 1), 64.0)
    expected = (2 * 2**-13 + 64 * 2**-23) * 64 + 3 * 2**-24 * 64 + 4 * 2**-24 * 64
    assert w8a8.accumulation_bound(xq, one, qt, one, y).item() == pytest.approx(expected, rel=1e-12)
    # the output dtype's rounding: bf16 keeps 8 significant bits
    y16 = y.to(torch.bfloat16)
    assert w8a8.accumulation_bound(xq, one, qt, one, y16).item() == pytest.approx(
        expected - 3 * 2**-24 * 64 + 3 * 2**-8 * 64, rel=1e-12)
    # at Llama-3-8B's K = 4096 the accumulator term is DeepSeek-V3's "nearly 2%" of Σ|p|
    assert math.ceil(4096 / w8a8.MMA_K) * 2.0 ** -(w8a8.ACCUMULATOR_BITS - 1) == pytest.approx(0.0156, abs=1e-4)


@pytest.mark.parametrize("k", [64, 4096])
def test_bound_covers_an_emulated_14_bit_accumulator_whose_error_dwarfs_fp32_rounding(k):
    x, prepared, _ = _inputs(4, 48, k, torch.float32, seed=k)
    xq, sx = quantize_rows_fp8(x)
    qt, sw = prepared["qweight_t"], prepared["scales"]
    products = xq.double()[:, None, :] * qt.double().T[None, :, :]  # (M, N, K), each exact
    emulated = _truncating_sum(products, w8a8.ACCUMULATOR_BITS, w8a8.MMA_K) * sx.double() * sw.double()
    exact = _exact(xq, sx, qt, sw)
    err = (emulated - exact).abs()
    bound = w8a8.accumulation_bound(xq, sx, qt, sw, emulated.float()).double()
    assert (err <= bound).all(), float((err / bound).max())
    # an fp32 sum of the same products errs far less: a bound reasoned from fp32 (as int8's is) is not this one
    fp32_err = ((xq.float() @ qt.float()).double() * sx.double() * sw.double() - exact).abs()
    print(f"K={k}: max err / bound {float((err / bound).max()):.3f}, 14-bit / fp32 max err "
          f"{float(err.max() / fp32_err.max()):.0f}")
    assert err.max() > 100 * fp32_err.max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_scaled_mm_is_within_the_bound(dtype):
    x, prepared, fmt = _inputs(5, 64, 256, dtype)
    y = w8a8.scaled_mm_linear(x, prepared, fmt)
    xq, sx = quantize_rows_fp8(x)
    err = (y.double() - _exact(xq, sx, prepared["qweight_t"], prepared["scales"])).abs()
    assert (err <= w8a8.accumulation_bound(xq, sx, prepared["qweight_t"], prepared["scales"], y)).all()


def _sm89() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm89(), reason="needs a CUDA device of sm_89 or newer (fp8)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n, k", [(1, 6144, 4096), (64, 4096, 14336), (300, 128, 64)])
def test_scaled_mm_on_cuda_is_within_the_accumulator_bound(dtype, m, n, k):
    """Identical 8-bit inputs (the launcher quantizes x with the reference's function): the compiled
    product within `accumulation_bound` of the exact one, at Llama-3-8B's qkv and down_proj shapes and
    random:tiny's K. Prints the largest error as a fraction of the bound and of Σ|p|."""
    x, prepared, fmt = _inputs(m, n, k, dtype, "cuda")
    y = w8a8.scaled_mm_linear(x, prepared, fmt)
    xq, sx = quantize_rows_fp8(x)
    qt, sw = prepared["qweight_t"], prepared["scales"]
    err = (y.double() - _exact(xq, sx, qt, sw)).abs()
    bound = w8a8.accumulation_bound(xq, sx, qt, sw, y).double()
    magnitude = (xq.float().abs() @ qt.float().abs()).double() * sx.double() * sw.double()
    print(f"{dtype} M={m} N={n} K={k}: max err / bound {float((err / bound).max()):.3f}, "
          f"max err / sum|p| {float((err / magnitude).max()):.2e}")
    assert (err <= bound).all(), float((err / bound).max())
