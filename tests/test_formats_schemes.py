"""Format schemes: one per kind, each one's reference dequantize, linear and rounding primitives against
the per-kind formulas written out here (the ones docs/FORMATS.md states), and the rules the passes read
(cast roles, row concatenation, quantization options)."""

import pytest
import torch

from optc.core.formats import (
    SCHEMES,
    Format,
    FormatKind,
    dequantize,
    kind_for_bits,
    linear_ref,
    pack_int4,
    quantized_format,
)
from optc.frontend.quant.rtn import fake_quantize, group_params, quantize_weight


def _int4(zero_point: bool, act_order: bool = False, dtype: str = "float32", group: int = 32) -> Format:
    return Format(FormatKind.INT4_G, dtype=dtype, bits=4, group_size=group, zero_point=zero_point,
                  packing="k8_lsb", act_order=act_order)


def _parts(fmt: Format, n: int = 6, k: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if not fmt.is_quantized:
        return {"weight": torch.randn(n, k, generator=g).to(fmt.torch_dtype)}
    if fmt.bits == 8:
        return {"qweight": torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
                "scales": (torch.rand(n, generator=g) + 0.1).to(fmt.torch_dtype)}
    parts = {"qweight": pack_int4(torch.randint(0, 16, (n, k), generator=g)),
             "scales": (torch.rand(n, k // fmt.group_size, generator=g) + 0.1).to(fmt.torch_dtype)}
    if fmt.zero_point:
        parts["zeros"] = torch.randint(0, 16, (n, k // fmt.group_size), generator=g, dtype=torch.uint8)
    if fmt.act_order:
        parts["perm"] = torch.randperm(k, generator=g).to(torch.int32)
    return parts


def _expected_dense(parts: dict[str, torch.Tensor], fmt: Format) -> torch.Tensor:
    """The FORMATS.md value of every weight, in float64, written per kind."""
    if fmt.kind is FormatKind.DENSE:
        return parts["weight"].double()
    if fmt.kind is FormatKind.INT8_WO:
        return parts["qweight"].double() * parts["scales"].double()[:, None]
    words = parts["qweight"].long() & 0xFFFFFFFF
    q = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], -1).reshape(words.shape[0], -1).double()
    rep = lambda t: t.double().repeat_interleave(fmt.group_size, 1)  # noqa: E731
    z = rep(parts["zeros"]) if fmt.zero_point else 8.0
    w = (q - z) * rep(parts["scales"])
    if fmt.act_order:  # stored column j is input channel perm[j]
        w = torch.zeros_like(w).index_copy_(1, parts["perm"].long(), w)
    return w


FORMATS = [Format(), Format(dtype="bfloat16"), Format(FormatKind.INT8_WO, dtype="float16", bits=8),
           _int4(False), _int4(True), _int4(True, act_order=True), _int4(False, dtype="bfloat16", group=64)]


def test_every_kind_has_a_scheme():
    assert set(SCHEMES) == set(FormatKind)
    assert [k for k, s in SCHEMES.items() if s.is_quantized] == [FormatKind.INT8_WO, FormatKind.INT4_G,
                                                                 FormatKind.FP8_E4M3, FormatKind.INT4_GF,
                                                                 FormatKind.INT8_GF]
    # the quantization passes write the first three; the GGUF kinds are imported (kind_for_bits never picks them)
    assert [k for k, s in SCHEMES.items() if s.bits is not None] == [FormatKind.INT8_WO, FormatKind.INT4_G]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.kind.value}-{f.dtype}-zp{f.zero_point}-ao{f.act_order}")
def test_scheme_dequantize_and_linear_match_the_formats_formulas(fmt):
    parts = _parts(fmt)
    expected = _expected_dense(parts, fmt)
    for out in (torch.float32, torch.bfloat16):
        w = dequantize(parts, fmt, out)
        assert w.dtype == out and w.shape == (6, 64)
        # fp32 arithmetic, one cast at the end: exactly the rounded float64 value
        assert torch.equal(w, expected.float().to(out))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(6, generator=torch.Generator().manual_seed(2))
    y = linear_ref(x, parts, fmt, bias)
    assert torch.equal(y, torch.nn.functional.linear(x, expected.float(), bias))
    assert torch.equal(fmt.scheme.linear(x, parts, fmt), linear_ref(x, parts, fmt))


@pytest.mark.parametrize("fmt", FORMATS[2:], ids=lambda f: f"{f.kind.value}-zp{f.zero_point}-ao{f.act_order}")
def test_part_shapes_are_what_the_scheme_dequantizes(fmt):
    parts = _parts(fmt)
    assert {r: (tuple(t.shape), t.dtype) for r, t in parts.items()} == fmt.part_shapes((6, 64))


def test_rounding_primitives_per_kind():
    w = torch.tensor([[0.5, -1.0, 0.25, 2.0]] * 2)
    int8 = quantized_format(8)
    scale, zero = group_params(w, int8)
    assert torch.equal(scale, torch.full((2,), 2.0 / 127)) and torch.equal(zero, torch.zeros(2))
    assert int8.scheme.qrange(int8) == (-127, 127) and int8.scheme.group_width(int8, 4096) == 4096
    sym = quantized_format(4, group_size=32)
    scale, zero = group_params(w, sym)
    assert torch.equal(scale, torch.full((2,), 2.0 * 2 / 15)) and torch.equal(zero, torch.full((2,), 8.0))
    asym = quantized_format(4, group_size=32, zero_point=True)
    scale, zero = group_params(w, asym)  # range [-1, 2] in 15 steps, z = round(1 / 0.2)
    assert torch.allclose(scale, torch.full((2,), 0.2)) and torch.equal(zero, torch.full((2,), 5.0))
    assert asym.scheme.qrange(asym) == (0, 15) and asym.scheme.group_width(asym, 4096) == 32
    bf16 = quantized_format(4, "bfloat16", group_size=32)
    assert torch.equal(group_params(w, bf16)[0], (torch.full((2,), 4 / 15)).to(torch.bfloat16).float())


@pytest.mark.parametrize("bits,zero_point", [(8, False), (4, False), (4, True)])
def test_quantize_weight_packs_what_fake_quantize_rounds(bits, zero_point):
    fmt = quantized_format(bits, "bfloat16", 32, zero_point)
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    parts = quantize_weight(w, fmt)
    assert {r: (tuple(t.shape), t.dtype) for r, t in parts.items()} == fmt.part_shapes((16, 64))
    assert torch.equal(dequantize(parts, fmt, torch.float32), fake_quantize(w, fmt))


def test_quantized_format_options_and_errors():
    assert quantized_format(8, "float16", group_size=128) == Format(FormatKind.INT8_WO, "float16", bits=8)
    assert quantized_format(4, group_size=64, zero_point=True, act_order=True) == Format(
        FormatKind.INT4_G, bits=4, group_size=64, zero_point=True, packing="k8_lsb", act_order=True)
    assert kind_for_bits(4) is FormatKind.INT4_G
    with pytest.raises(ValueError, match=r"unsupported bits 3; supported: \(4, 8\)"):
        quantized_format(3)
    with pytest.raises(ValueError, match="int8 weight-only quantization is symmetric"):
        quantized_format(8, zero_point=True)
    with pytest.raises(ValueError, match=r"int4 group_size must be one of \(32, 64, 128\), got 16"):
        quantized_format(4, group_size=16)
    with pytest.raises(ValueError, match="act_order"):
        Format(FormatKind.INT8_WO, bits=8, act_order=True)
    with pytest.raises(ValueError, match="int4_g needs bits=4"):
        Format(FormatKind.INT4_G, bits=8, group_size=32, packing="k8_lsb")


def test_cast_roles_and_row_concat_rules():
    assert Format().scheme.float_roles == ("weight",)
    assert all(SCHEMES[k].float_roles == ("scales",) for k in (FormatKind.INT8_WO, FormatKind.INT4_G))
    assert _int4(True).scheme.can_concat_rows(_int4(True))
    assert not _int4(True, act_order=True).scheme.can_concat_rows(_int4(True, act_order=True))  # own perms
    fmt = _int4(True)
    a, b = _parts(fmt, n=4, seed=1), _parts(fmt, n=2, seed=2)
    fused = {r: fmt.scheme.concat_rows(r, [a[r], b[r]], fmt) for r in a}
    assert torch.equal(dequantize(fused, fmt), torch.cat([dequantize(a, fmt), dequantize(b, fmt)]))


def test_export_refusal_is_the_int4_portable_rule():
    assert _int4(True).scheme.export_refusal(_int4(True), "ort") is None
    assert _int4(False, group=64).scheme.export_refusal(_int4(False, group=64), "portable") is None
    assert "int4_g group_size=32 zero_point=false" in _int4(False).scheme.export_refusal(_int4(False), "portable")
    assert quantized_format(8).scheme.export_refusal(quantized_format(8), "portable") is None


def test_fusion_asks_the_scheme():
    from optc.core.ir import Graph, ModelConfig, Node, TensorInfo
    from optc.passes._linears import can_fuse

    config = ModelConfig("LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                         num_kv_heads=4, head_dim=16, vocab_size=256, rms_norm_eps=1e-5, rope_theta=1e4,
                         max_position_embeddings=64, tie_word_embeddings=False)
    nodes = [Node(n, "linear", ["x"], [f"{n}_out"], {"in_features": 64, "out_features": 64}, {"weight": f"{n}.w"})
             for n in ("gate", "up")]
    for fmt, fusable in ((_int4(True), True), (_int4(True, act_order=True), False)):
        graph = Graph(config, nodes, {f"{n}.w": TensorInfo((64, 64), fmt) for n in ("gate", "up")})
        assert can_fuse(graph, nodes) is fusable
