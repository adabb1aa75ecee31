"""fp8_e4m3 and dynamic per-token activations (W8A8): the schemes' dequantize, linear and quantizer
against the formulas of docs/FORMATS.md written out here in float64, and the format's rules (fields,
JSON, concatenation, labels)."""

import pytest
import torch

from optc.core.formats import Activations, Format, FormatKind, dequantize, linear_ref
from optc.core.formats.activations import FP8_MAX, quantize_rows_fp8, quantize_rows_int8
from optc.core.formats.fp8_e4m3 import quantize_fp8_weight
from optc.frontend.quant.rtn import quantize_weight
from optc.testing import assert_close

FP8 = Format(FormatKind.FP8_E4M3)
FP8_TENSOR = Format(FormatKind.FP8_E4M3, per_tensor=True)
FP8_W8A8 = Format(FormatKind.FP8_E4M3, activations=Activations.DYNAMIC)
INT8_W8A8 = Format(FormatKind.INT8_WO, bits=8, activations=Activations.DYNAMIC)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fp8_parts(fmt: Format, n: int = 6, k: int = 64) -> dict[str, torch.Tensor]:
    q = (torch.randn(n, k, generator=_gen(0)) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"qweight": q, "scales": (torch.rand(1 if fmt.per_tensor else n, generator=_gen(1)) + 0.1).to(
        fmt.torch_dtype)}


def _fp8_value(b: int) -> float:
    """The e4m3fn value of byte b written from its bits: sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    sign, exp, man = -1.0 if b & 0x80 else 1.0, (b >> 3) & 0xF, b & 0x7
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6  # subnormal
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def test_fp8_bytes_decode_as_e4m3fn_and_448_is_the_largest():
    bytes_ = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7F, 0xFF: NaN
    expected = torch.tensor([_fp8_value(int(b)) for b in bytes_], dtype=torch.float64)
    assert torch.equal(bytes_.view(torch.float8_e4m3fn).double(), expected)
    assert expected.max() == FP8_MAX


@pytest.mark.parametrize("fmt", [FP8, FP8_TENSOR, Format(FormatKind.FP8_E4M3, dtype="bfloat16")],
                         ids=["channel", "tensor", "channel-bf16"])
def test_fp8_dequantize_and_weight_only_linear_match_the_formula(fmt):
    parts = _fp8_parts(fmt)
    expected = parts["qweight"].double() * parts["scales"].double()[:, None]  # (1,) broadcasts per tensor
    for out in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize(parts, fmt, out), expected.float().to(out))
    x, bias = torch.randn(3, 64, generator=_gen(2)), torch.randn(6, generator=_gen(3))
    assert torch.equal(linear_ref(x, parts, fmt, bias), torch.nn.functional.linear(x, expected.float(), bias))


def _w8a8_formula(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, qmax: float, cast) -> torch.Tensor:
    """Per token: s_t = max|x_t| / qmax, xq = cast(x / s_t); y = (xq @ qᵀ) s_t s_w, in float64."""
    st = x.double().abs().amax(-1, keepdim=True) / qmax
    xq = cast((x.double() / st).float()).double()
    return (xq @ q.double().T) * st * s.double()[None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_linears_quantize_each_token_with_its_own_scale(dtype):
    x = (torch.randn(5, 64, generator=_gen(4)) * torch.tensor([1.0, 10, 100, 0.1, 1])[:, None]).to(dtype)
    fp8 = _fp8_parts(FP8_W8A8)
    want = _w8a8_formula(x, fp8["qweight"], fp8["scales"], 448, lambda t: t.to(torch.float8_e4m3fn))
    assert_close(linear_ref(x, fp8, FP8_W8A8), want, rtol=1e-5 if dtype == torch.float32 else 8e-3,
                 what="fp8 W8A8")
    int8 = quantize_weight(torch.randn(6, 64, generator=_gen(5)), INT8_W8A8)
    want = _w8a8_formula(x, int8["qweight"], int8["scales"], 127, lambda t: t.round().clamp(-127, 127))
    assert_close(linear_ref(x, int8, INT8_W8A8), want, rtol=1e-5 if dtype == torch.float32 else 8e-3,
                 what="int8 W8A8")
    # the activations are what differs from weight-only: a row's outliers cost only that row's precision
    weight_only = linear_ref(x, int8, Format(FormatKind.INT8_WO, bits=8))
    assert not torch.equal(weight_only, linear_ref(x, int8, INT8_W8A8))


def test_per_token_quantizers_keep_zero_rows_finite_and_stay_in_range():
    x = torch.zeros(3, 8)
    x[1] = torch.linspace(-5, 7, 8)
    x[2, 3] = 1e6
    for quantize, qmax in ((quantize_rows_fp8, 448), (quantize_rows_int8, 127)):
        xq, s = quantize(x)
        assert s.shape == (3, 1) and s.dtype == torch.float32
        assert torch.equal(xq[0].float(), torch.zeros(8)) and torch.isfinite(xq.float()).all()
        assert xq.float().abs().max() == qmax  # each row's largest |x| maps to the top of the range
        assert float(s[1]) == pytest.approx(7 / qmax)


@pytest.mark.parametrize("fmt", [FP8, FP8_TENSOR, Format(FormatKind.FP8_E4M3, dtype="bfloat16")],
                         ids=["channel", "tensor", "channel-bf16"])
def test_quantize_fp8_weight_scales_the_max_to_448_and_rounds_relatively(fmt):
    w = torch.randn(8, 96, generator=_gen(6)) * torch.logspace(-3, 1, 8)[:, None]
    w[3] = 0.0  # a row of zeros still gets a usable scale
    parts = quantize_fp8_weight(w, fmt)
    scales = parts["scales"]
    assert parts["qweight"].dtype == torch.float8_e4m3fn and scales.dtype == fmt.torch_dtype
    assert scales.shape == ((1,) if fmt.per_tensor else (8,))
    amax = w.abs().amax() if fmt.per_tensor else w.abs().amax(-1)
    # the scale is max|w| / 448 rounded to the storage dtype (clamped at 1e-5) before the cast
    assert torch.equal(scales, (amax / 448).clamp(min=1e-5).to(fmt.torch_dtype).reshape(-1))
    back = dequantize(parts, fmt, torch.float32)
    normal = (w / scales.float()[:, None]).abs() >= 2 ** -6  # e4m3 normals: 3 mantissa bits, error <= 2^-4
    err = (back - w).abs()
    assert (err[normal] <= w.abs()[normal] * 2 ** -4 * 1.01).all()
    assert torch.equal(back[3], torch.zeros(96))


def test_fp8_format_fields_json_and_labels():
    for fmt in (FP8, FP8_TENSOR, FP8_W8A8, INT8_W8A8):
        assert Format.from_json(fmt.to_json()) == fmt
    assert FP8_W8A8.to_json() == {"kind": "fp8_e4m3", "dtype": "float32", "activations": "dynamic"}
    # weight-only formats keep the JSON they always had
    assert Format(FormatKind.INT8_WO, bits=8).to_json() == {"kind": "int8_wo", "dtype": "float32", "bits": 8}
    assert [f.label for f in (FP8, FP8_TENSOR, FP8_W8A8, INT8_W8A8)] == [
        "fp8_e4m3", "fp8_e4m3/per-tensor", "fp8_e4m3/act-dynamic", "int8_wo/act-dynamic"]
    assert FP8.scheme.min_capability == (8, 9) and FP8.part_shapes((4, 16))["qweight"] == ((4, 16), torch.float8_e4m3fn)
    assert FP8.scheme.can_concat_rows(FP8) and not FP8.scheme.can_concat_rows(FP8_TENSOR)  # a scale each


@pytest.mark.parametrize("kwargs,message", [
    ({"kind": FormatKind.INT4_G, "bits": 4, "group_size": 32, "packing": "k8_lsb", "activations": "dynamic"},
     "int4_g takes activations none, not dynamic"),
    ({"kind": FormatKind.INT8_WO, "bits": 8, "per_tensor": True}, "per_tensor scales exist only for fp8_e4m3"),
    ({"kind": FormatKind.FP8_E4M3, "bits": 8}, "fp8_e4m3 takes no bits"),
    ({"kind": FormatKind.DENSE, "activations": "dynamic"}, "dense takes activations none"),
    ({"kind": FormatKind.FP8_E4M3, "activations": "static"}, "'static' is not a valid Activations"),
])
def test_formats_refuse_fields_their_kind_does_not_have(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Format(**kwargs)
