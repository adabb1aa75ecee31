"""cpu.qdot (kernels/cpu_ext): optc's C++ CPU linear against the format's reference, per format and ISA path.

Every format the table offers it for, at M = 1, 3, 8 and an odd N, with K that leaves an odd block (int4 pairs
blocks) and a partial chunk of 8 blocks, on the AVX2 path and (where the CPU has it) the AVX-512 VNNI path: the
two paths' outputs are equal bit for bit (integer dot products are exact, and the fp32 arithmetic is the same
code), both equal a float64 reference of the same activation integers within fp32 roundings, and both stay
within the bound the activation rounding implies (qdot.py: |x - dx * xq| <= dx / 2 per element, so an output
moves by at most sum over blocks of dx / 2 * sum |w - min|), plus fp32 slack. The extension is
built once for the module (and cached on disk across runs); the fallback is checked in a child process whose
compiler does not exist.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from optc.core.formats import Format, FormatKind, dequantize, linear_ref
from optc.core.ops import Param
from optc.testing import cpu_extension

N = 37  # odd: no tile of rows
CASES = {  # name: (kind, bits, group size, zero point, K)
    "int4_gf/g32": (FormatKind.INT4_GF, 4, 32, False, 288),  # Q4_0: 9 blocks
    "int4_gf/g32/min": (FormatKind.INT4_GF, 4, 32, True, 352),  # Q4_1 / Q4_K: 11 blocks
    "int8_gf/g32": (FormatKind.INT8_GF, 8, 32, False, 288),  # Q8_0
    "int8_gf/g32/min": (FormatKind.INT8_GF, 8, 32, True, 288),  # Q5_1 / Q5_K widened
    "int4_g/g64/zp": (FormatKind.INT4_G, 4, 64, True, 576),  # AWQ: 9 groups of 2 blocks
    "int4_g/g128": (FormatKind.INT4_G, 4, 128, False, 640),  # GPTQ symmetric: 20 blocks
    "int8_wo": (FormatKind.INT8_WO, 8, None, False, 96),  # one scale per row
}


@pytest.fixture(scope="module")
def ext():
    return cpu_extension()  # without a compiler, the fallback test below covers this machine


def _weight(name: str, seed: int = 0) -> Param:
    kind, bits, group, zero_point, k = CASES[name]
    g = torch.Generator().manual_seed(seed)
    if kind is FormatKind.INT8_WO:
        fmt = Format(kind, "bfloat16", bits=8)
        return Param({"qweight": torch.randint(-128, 128, (N, k), dtype=torch.int8, generator=g),
                      "scales": (torch.rand(N, generator=g) * 0.01).bfloat16()}, fmt)
    packing = "k8_lsb" if bits == 4 else None
    fmt = Format(kind, "bfloat16", bits=bits, group_size=group, zero_point=zero_point, packing=packing)
    groups = (N, k // group)
    if bits == 4:
        codes = torch.randint(0, 16, (N, k), generator=g, dtype=torch.int32)
        shifts = torch.arange(8, dtype=torch.int32) * 4
        parts = {"qweight": (codes.view(N, k // 8, 8) << shifts).sum(-1, dtype=torch.int32)}
    else:
        parts = {"qweight": torch.randint(-128, 128, (N, k), dtype=torch.int8, generator=g)}
    scales = torch.rand(groups, generator=g) * 0.02 + 1e-3
    parts["scales"] = scales if kind is not FormatKind.INT4_G else scales.bfloat16()
    if zero_point and kind is FormatKind.INT4_G:
        parts["zeros"] = torch.randint(0, 16, groups, dtype=torch.uint8, generator=g)
    elif zero_point:
        parts["mins"] = -torch.rand(groups, generator=g) * 0.1
    return Param(parts, fmt)


def _qmax(w: Param) -> int:
    """qdot.cpp's activation integers' range: int16 for int8 codes, an int8 pair 128 q + r for int4 codes."""
    return 127 * 128 if w.format.bits == 4 else 32767


def _dense_less_mins(w: Param) -> torch.Tensor:
    """(N, K) float32: the dequantized weight less its per-group minimum (the part that meets xq)."""
    dense = dequantize(w.parts, w.format, torch.float32)
    if "mins" in w.parts:
        dense = dense - w.parts["mins"].repeat_interleave(w.format.group_size, 1)
    return dense


def _bound(x: torch.Tensor, w: Param) -> torch.Tensor:
    """(M, N): sum over blocks of dx / 2 * sum |w - min| (the activation rounding's error), plus fp32 slack."""
    m, k = x.shape
    dense = _dense_less_mins(w)
    dx = x.float().view(m, k // 32, 32).abs().amax(-1).repeat_interleave(32, 1) / _qmax(w)  # (M, K)
    return 0.5 * dx @ dense.abs().T + 1e-5 * (x.float().abs() @ dense.abs().T) + 1e-6


def _quantized_ref(x: torch.Tensor, w: Param) -> torch.Tensor:
    """(M, N) float64: qdot.cpp's sum with its activation integers, xq = round(x / dx), dx = max|x| / qmax per
    block of 32 (dx and 1 / dx rounded to fp32 as there), times the weight less its minimum, plus the minimum
    times x's exact sum: what the kernel computes, but for its fp32 accumulation."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    dx = blocks.abs().amax(-1, keepdim=True) / _qmax(w)  # (M, K / 32, 1) fp32
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    xq = torch.round(blocks * inv).double() * dx.double()  # round half to even, as nearbyint
    y = xq.view(m, k) @ _dense_less_mins(w).double().T
    if "mins" in w.parts:
        y = y + x.double() @ w.parts["mins"].double().repeat_interleave(w.format.group_size, 1).T
    return y


def _isas(ext) -> list[int]:
    from optc.kernels import cpu_ext

    return [cpu_ext.AVX2] + ([cpu_ext.AVX512_VNNI] if ext.best_isa()["qdot"] == cpu_ext.AVX512_VNNI else [])


@pytest.mark.parametrize("name", list(CASES))
def test_qdot_is_its_quantized_reference_and_within_the_rounding_bound_on_each_isa(ext, name):
    from optc.kernels.cpu_ext import qdot

    w = _weight(name)
    parts = qdot.prepare_qdot({"weight": w})["weight"].parts
    k = CASES[name][4]
    for m in (1, 3, 8):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).float()
        ref = linear_ref(x, w.parts, w.format).float()  # float32 x: the reference's product in fp32
        outs = [qdot.qlinear(x, parts, w.format, isa) for isa in _isas(ext)]
        excess = (outs[0] - ref).abs() - _bound(x, w)
        assert excess.max() <= 0, f"{name} M={m}: past the bound by {excess.max():.3e}"
        # the same integers, so only fp32 roundings apart (measured: < 2^-24 of sum |x w|; one xq off by one: ~2^-20)
        exact = _quantized_ref(x, w)
        magnitude = x.double().abs() @ dequantize(w.parts, w.format, torch.float64).abs().T
        fp32 = (outs[0].double() - exact).abs() - 2 ** -22 * magnitude
        assert fp32.max() <= 0, f"{name} M={m}: off the quantized reference by {fp32.max():.3e} past fp32"
        for other in outs[1:]:
            assert torch.equal(other, outs[0]), f"{name} M={m}: the ISA paths differ"
        assert (outs[0] - ref).abs().max() > 0, "x was not rounded: the bound is not what this test checks"


def test_qdot_launcher_takes_bfloat16_and_leading_dims_and_bias(ext):
    from optc.kernels.cpu_ext import qdot

    w = _weight("int4_gf/g32/min")
    parts = qdot.prepare_qdot({"weight": w})["weight"].parts
    x = torch.randn(2, 3, 352, generator=torch.Generator().manual_seed(1)).bfloat16()
    bias = torch.randn(N).bfloat16()
    got = qdot.qdot_linear(x, parts, w.format, bias)
    assert got.shape == (2, 3, N) and got.dtype == torch.bfloat16
    flat = qdot.qlinear(x.reshape(6, 352), parts, w.format, qdot.cpu_ext.isa())
    assert torch.equal(got, (flat + bias).reshape(2, 3, N))


@pytest.mark.parametrize("name", ["int4_g/g64/zp", "int8_wo"])
def test_prepare_keeps_the_formats_parts_and_adds_float32_scales(ext, name):
    from optc.kernels.cpu_ext import qdot

    w = _weight(name)
    parts = qdot.prepare_qdot({"weight": w})["weight"].parts
    for role, t in w.parts.items():
        assert parts[role] is t, role  # the artifact's own tensors, not copies
    assert torch.equal(dequantize({r: parts[r] for r in w.parts}, w.format), dequantize(w.parts, w.format))
    scales = w.parts["scales"].float().reshape(N, -1)
    assert torch.equal(parts["qdot_scales"], scales)
    if "zeros" in w.parts:
        assert torch.equal(parts["qdot_soff"], scales * w.parts["zeros"].float())


def test_a_failed_build_falls_back_to_torchs_packed_kernel(tmp_path):
    """No compiler (CXX names none, an empty cache): load() logs and returns None, prepare makes int4pack's
    layout, and the launcher's output is int4pack's exactly. With ATEN_CPU_CAPABILITY=avx2 (and the cached
    build) the path is AVX2."""
    script = textwrap.dedent("""
        import logging, sys, torch
        logging.basicConfig(level=logging.WARNING)
        sys.path.insert(0, sys.argv[1])
        from test_kernels_cpu_ext import _weight
        from optc.kernels import cpu_ext, int4_cpu
        from optc.kernels.cpu_ext import qdot
        assert cpu_ext.load() is None and cpu_ext.isa() is None
        w = _weight("int4_gf/g32/min")
        w = type(w)({**w.parts, "qweight": w.parts["qweight"][:32], "scales": w.parts["scales"][:32],
                     "mins": w.parts["mins"][:32]}, w.format)
        parts = qdot.prepare_qdot({"weight": w})["weight"].parts
        assert "qdot_scales" not in parts and "int4pack" in parts
        x = torch.randn(3, 352).bfloat16()
        ref = int4_cpu.int4pack_linear(x, int4_cpu.prepare_int4pack({"weight": w})["weight"].parts, w.format)
        assert torch.equal(qdot.qdot_linear(x, parts, w.format), ref)
        print("fell back")
    """)
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "OPTC_CACHE": str(tmp_path / "cache"),
           "OMP_NUM_THREADS": "1"}
    tests = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, "-c", script, tests], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "fell back" in out.stdout, out.stderr[-3000:]
    assert "optc's C++ CPU kernels could not be built" in out.stderr


def test_the_aten_avx2_cap_selects_the_avx2_path(ext):
    """qdot's and bf16dot's paths both follow torch's cap."""
    code = "from optc.kernels import cpu_ext; print(cpu_ext.isa(), cpu_ext.bf16_isa())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-2:] == ["2", "2"], out.stderr[-2000:]


@pytest.mark.parametrize("name", ["int8_wo", "int8_gf/g32"])
def test_qdot_logits_recomputes_each_rows_best_exactly(ext, name):
    """An lm_head: each row's best logit equal to logits_ref's exactly (both recompute it in fp32); the others
    within bf16 roundings of it: the reference's matmul runs on the weight rounded to bfloat16 (2^-9 of each
    |x_i w_i|) and rounds its output, qdot rounds its output."""
    from optc.core.ops.linear import logits_ref
    from optc.kernels.cpu_ext import qdot

    w = _weight(name)
    parts = qdot.prepare_qdot({"weight": w})["weight"].parts
    x = torch.randn(3, CASES[name][4], generator=torch.Generator().manual_seed(3)).bfloat16()
    got, ref = qdot.qdot_logits(x, parts, w.format), logits_ref(x, w.parts, w.format)
    assert got.dtype == torch.float32
    best = ref.argmax(-1, keepdim=True)
    assert torch.equal(got.argmax(-1, keepdim=True), best) and torch.equal(got.gather(-1, best), ref.gather(-1, best))
    magnitude = x.float().abs() @ dequantize(w.parts, w.format, torch.float32).abs().T  # sum_i |x_i w_i|
    assert ((got - ref).abs() <= 2 ** -9 * magnitude + 2 ** -7 * ref.abs()).all()


def test_the_kernels_split_their_work_over_torchs_threads(ext):
    """at::parallel_for divides a range only in code compiled with OpenMP (it is a header): the extensions
    are (cpu_ext.build's flags, the same for every translation unit), so a 2-thread decode step runs their rows
    on both threads."""
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert ext.threads_used(64) == 2
        torch.set_num_threads(1)
        assert ext.threads_used(64) == 1
    finally:
        torch.set_num_threads(saved)
