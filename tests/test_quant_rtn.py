"""Round-to-nearest quantization: round trips, packing, parameter choice and errors."""

import pytest
import torch

from optc.core.formats import dequantize, pack_int4, unpack_int4
from optc.frontend.quant.rtn import fake_quantize, group_params, make_format, quantize_weight


def _w(n=37, k=192, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_round_trip_within_half_a_step(dtype, zero_point, group_size):
    w = _w()
    fmt = make_format(4, group_size, zero_point, dtype)
    parts = quantize_weight(w, fmt)
    assert parts["qweight"].shape == (37, 24) and parts["qweight"].dtype == torch.int32
    assert parts["scales"].shape == (37, 192 // group_size) and parts["scales"].dtype == fmt.torch_dtype
    assert ("zeros" in parts) == zero_point
    deq = dequantize(parts, fmt, torch.float32)
    step = parts["scales"].float().repeat_interleave(group_size, 1)
    # half a step, plus the clamp at the range edge when the scale was rounded down to the dtype
    slack = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype] * 8
    assert ((deq - w).abs() <= step * (0.5 + slack)).all()
    assert torch.equal(fake_quantize(w, fmt), deq)


def test_int8_round_trip():
    w = _w(37, 100)
    fmt = make_format(8, dtype="float32")
    parts = quantize_weight(w, fmt)
    assert parts["qweight"].dtype == torch.int8 and parts["scales"].shape == (37,)
    assert torch.equal(parts["scales"], w.abs().amax(1) / 127)
    assert parts["qweight"].abs().amax(1).eq(127).all()
    deq = dequantize(parts, fmt)
    assert ((deq - w).abs() <= parts["scales"][:, None] * 0.5 + 1e-7).all()
    assert torch.equal(fake_quantize(w, fmt), deq)


def test_int4_parameters_pinned_on_a_tiny_group():
    w = torch.tensor([[-1.0, 0.5, 2.0, 0.0] * 8])  # one group of 32, min -1, max 2
    sym = make_format(4, 32, False)
    s, z = group_params(w, sym)
    assert torch.equal(s, torch.tensor([4.0 / 15])) and torch.equal(z, torch.tensor([8.0]))
    asym = make_format(4, 32, True)
    s, z = group_params(w, asym)
    assert torch.equal(s, torch.tensor([3.0 / 15])) and torch.equal(z, torch.tensor([5.0]))
    q = unpack_int4(quantize_weight(w, asym)["qweight"])
    assert q[0, :4].tolist() == [0, 7, 15, 5]  # 0.5 / fp32(0.2) = 2.4999998 rounds to 2


def test_zero_group_gets_a_nonzero_scale():
    fmt = make_format(4, 32, True, "float16")
    parts = quantize_weight(torch.zeros(2, 64), fmt)
    assert (parts["scales"] > 0).all()
    assert torch.equal(dequantize(parts, fmt, torch.float32), torch.zeros(2, 64))


def test_pack_unpack_exact_and_layout():
    q = torch.randint(0, 16, (37, 192), generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_int4(pack_int4(q)), q.to(torch.uint8))
    row = torch.arange(8)[None]  # value k at bits 4k
    assert pack_int4(row).item() == 0x76543210
    # the word is int32: a top nibble of 8 or more makes it negative (two's complement)
    assert pack_int4(torch.tensor([[0, 0, 0, 0, 0, 0, 0, 8], [15] * 8])).tolist() == [[-2**31], [-1]]


def test_clip_bounds_the_weight():
    w = _w(4, 64)
    fmt = make_format(4, 32, True)
    clip = torch.full((4, 2), 0.5)
    deq = dequantize(quantize_weight(w, fmt, clip=clip), fmt)
    assert deq.abs().max() <= 0.5 + 1e-6


def test_errors_name_the_tensor_and_dimension():
    with pytest.raises(ValueError, match=r"layers\.0\.q: input dimension 96 is not a multiple of group size"):
        quantize_weight(torch.zeros(8, 96), make_format(4, 64), name="layers.0.q")
    with pytest.raises(ValueError, match="unsupported bits 3; supported: \\(4, 8\\)"):
        make_format(3, 64)
    with pytest.raises(ValueError, match="group_size must be one of"):
        make_format(4, 48)
    with pytest.raises(ValueError, match="must be false"):
        make_format(8, zero_point=True)
    with pytest.raises(ValueError, match="needs a 2-D weight"):
        quantize_weight(torch.zeros(64), make_format(8))


def test_weight_quant_options_shared_by_the_quantization_passes():
    from optc.core.errors import InputError
    from optc.core.formats import FormatKind
    from optc.frontend.passmanager import registry
    from optc.frontend.quant.options import WeightQuantOptions

    int8 = WeightQuantOptions(bits=8, group_size=64, zero_point=True)  # int8 is per channel and symmetric
    assert int8.record() == {"bits": 8, "group_size": None, "zero_point": False}
    assert int8.format("float16").kind is FormatKind.INT8_WO and int8.format("float16").dtype == "float16"
    int4 = WeightQuantOptions(bits=4, group_size=32, zero_point=False)
    assert int4.record() == {"bits": 4, "group_size": 32, "zero_point": False}
    fmt = int4.format()
    assert (fmt.kind, fmt.group_size, fmt.zero_point, fmt.dtype) == (FormatKind.INT4_G, 32, False, "float32")
    with pytest.raises(InputError, match="int4 group_size must be one of"):
        WeightQuantOptions(bits=4, group_size=48)
    passes = registry()
    for name in ("quantize_rtn", "quantize_awq", "quantize_gptq"):
        assert issubclass(passes[name].Options, WeightQuantOptions), name
