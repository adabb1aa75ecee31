"""Triton rms_norm / add_rms_norm / gated_act against their references (interpreter on the CPU)."""

import pytest
import torch

from optc.core.ops.elementwise import gated_act_ref
from optc.core.ops.norm import add_rms_norm_ref, rms_norm_ref
from optc.kernels.activation import gated_act
from optc.kernels.norm import add_rms_norm, rms_norm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_close(actual, expected, atol, rtol=0.0):
    diff = (actual.float() - expected.float()).abs()
    ok = torch.allclose(actual.float(), expected.float(), atol=atol, rtol=rtol)
    assert ok, f"max diff {diff.max().item():.3g}, mean diff {diff.mean().item():.3g}"


def _ulp(dtype):
    return {torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 2.0**-7}[dtype]


def _tol(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (3, 5, 384)])
def test_rms_norm_kernel_matches_ref(dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype) * 3
    w = (torch.randn(shape[-1], generator=g) * 0.5 + 1).to(dtype)
    out = rms_norm(x, w, 1e-5)
    ref = rms_norm_ref(x, w, 1e-5)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_close(out, ref, _tol(dtype), _tol(dtype))


def test_rms_norm_kernel_fp32_weight_promotes_like_ref():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    w = torch.rand(96, generator=torch.Generator().manual_seed(2))
    out, ref = rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)
    assert out.dtype == ref.dtype == torch.float32
    assert_close(out, ref, 1e-2, 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (12, 32)])
def test_offset_rms_norm_kernel_matches_ref(dtype, shape):
    # Gemma's (1 + w) norm, products in fp32: also a per-head q/k norm's rows of head_dim (12, 32)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(shape, generator=g).to(dtype) * 3
    w = (torch.randn(shape[-1], generator=g) * 0.3).to(dtype)
    out, ref = rms_norm(x, w, 1e-6, offset=1.0), rms_norm_ref(x, w, 1e-6, offset=1.0)
    assert out.dtype == ref.dtype == dtype
    assert_close(out, ref, _tol(dtype), _tol(dtype))
    summed_out, summed = add_rms_norm(x, x.flip(0), w, 1e-6, offset=1.0)
    ref_out, ref_sum = add_rms_norm_ref(x, x.flip(0), w, 1e-6, offset=1.0)
    assert_close(summed, ref_sum, 0.0, _ulp(dtype))
    assert_close(summed_out, ref_out, _tol(dtype), _tol(dtype))
    assert not torch.allclose(out.float(), rms_norm_ref(x, w, 1e-6).float(), atol=_tol(dtype))  # the offset counts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (9, 200)])
def test_add_rms_norm_kernel_matches_ref(dtype, shape):
    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    w = (torch.randn(shape[-1], generator=g) * 0.5 + 1).to(dtype)
    out, summed = add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_sum = add_rms_norm_ref(x, r, w, 1e-5)
    # the sum is rounded once, as the unfused add; the interpreter's fp32 -> bf16 cast truncates
    # instead of rounding to nearest, so bf16 is allowed one unit in the last place
    assert_close(summed, ref_sum, 0.0, _ulp(dtype))
    assert_close(out, ref_out, _tol(dtype), _tol(dtype))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 48), (6, 2 * 1500)])
def test_gated_act_kernel_matches_ref(act, dtype, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(dtype) * 4
    out, ref = gated_act(x, act=act), gated_act_ref(x, act=act)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_close(out, ref, _tol(dtype), _tol(dtype))


def test_gelu_tanh_kernel_rounds_like_torch_in_fp16():
    # act(gate) rounded to fp16 before the product: torch's fp32 value and the kernel's differ by a few
    # ulps of tanh near -1 (5e-7 at most), so all but about 1% of the normal fp16 outputs carry torch's
    # bits; far gates saturate (0, g). (bf16 is not checked bit for bit here: the interpreter's
    # fp32 -> bf16 cast truncates.)
    gate = torch.cat((torch.linspace(-12, 12, 4001), torch.tensor([-100.0, 100.0]))).to(torch.float16)[None]
    up = torch.ones_like(gate)
    out, ref = gated_act(gate, up, act="gelu_tanh"), gated_act_ref(gate, up, act="gelu_tanh")
    normal = ref.float().abs() > 2**-14
    assert (out != ref)[normal].float().mean() < 0.02
    assert_close(out, ref, 2**-21, 2**-10)
    assert out[0, -2] == 0 and out[0, -1] == 100


def test_gated_act_kernel_refuses_an_activation_it_does_not_compute():
    with pytest.raises(AssertionError, match="activation 'relu'"):
        gated_act(torch.zeros(2, 8), act="relu")


def test_gated_act_kernel_takes_strided_gate_up_views():
    x = torch.randn(5, 2 * 77, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    gate, up = x.split(77, dim=-1)  # column views of one tensor: row stride 154
    assert not gate.is_contiguous()
    assert torch.equal(gated_act(gate, up), gated_act(x))  # same bits from views and from the whole
    assert_close(gated_act(gate, up), gated_act_ref(x), 2e-2, 2e-2)


def test_gated_act_kernel_rejects_mismatched_halves():
    with pytest.raises(AssertionError, match="gate"):
        gated_act(torch.zeros(2, 8), torch.zeros(2, 9))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 4096, 5000])  # SmolLM2, Llama-3-8B, not a power of two
def test_norm_and_gated_act_kernels_on_cuda(dtype, width):
    g = torch.Generator().manual_seed(width)
    x, r = ((torch.randn(33, width, generator=g) * 3).to(dtype).cuda() for _ in range(2))
    w = torch.randn(width, generator=g).to(dtype).cuda()
    tol = _tol(dtype)
    assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), tol, tol)
    (y, s), (y_ref, s_ref) = add_rms_norm(x, r, w, 1e-5), add_rms_norm_ref(x, r, w, 1e-5)
    assert torch.equal(s, s_ref)  # the residual sum is rounded once, in x's dtype, on both sides
    assert_close(y, y_ref, tol, tol)
    gate_up = torch.randn(33, 2 * width, generator=g).to(dtype).cuda()
    for act in ("silu", "gelu_tanh"):
        assert_close(gated_act(gate_up, act=act), gated_act_ref(gate_up, act=act), tol, tol)
