"""fp8 and W8A8 kernels against optc.core.formats.linear_ref: the Triton fp8 W8A16 kernel under the
interpreter (M on the GEMV and GEMM paths, N and K not multiples of the tiles), the torch `_scaled_mm` /
`_int_mm` W8A8 bindings on the CPU (where torch runs both), their argument preparation, which kernel the
registry binds to which format, and the fp8 kernel compiled for sm_90 (and refused for sm_80); on a GPU
(the `gpu` test), all of them compiled on Llama-3-8B-sized shapes."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from optc.core.formats import Activations, Format, FormatKind, linear_ref
from optc.core.formats.activations import quantize_rows_int8
from optc.core.formats.fp8_e4m3 import quantize_fp8_weight
from optc.core.ir import Node
from optc.core.ops import Param
from optc.frontend.quant.rtn import quantize_weight
from optc.kernels import w8a8
from optc.kernels.fp8_w8a16 import fp8_w8a16_linear, prepare_fp8_w8a16
from optc.kernels.registry import KERNELS, KernelQuery, select
from optc.testing import assert_close

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# outputs are O(10); fp32 exact up to summation order; half precision a few ulps of the output
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _fp8(n, k, dtype, per_tensor=False, activations=Activations.NONE):
    fmt = Format(FormatKind.FP8_E4M3, dtype=DTYPES[dtype], per_tensor=per_tensor, activations=activations)
    return quantize_fp8_weight(torch.randn(n, k, generator=_gen(0)), fmt), fmt


def _x(m, k, dtype):
    return torch.randn(m, k, generator=_gen(1)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_fp8_w8a16_kernel_matches_ref(dtype, m, per_tensor):
    parts, fmt = _fp8(72, 200, dtype, per_tensor)
    prepared = prepare_fp8_w8a16({"weight": Param(parts, fmt)})["weight"].parts
    assert prepared["scales"].shape == (72,)  # per tensor: widened once, for the kernel's per-column load
    x, bias = _x(m, 200, dtype), torch.randn(72, generator=_gen(2)).to(dtype)
    for b in (None, bias):
        assert_close(fp8_w8a16_linear(x, prepared, fmt, b), linear_ref(x, parts, fmt, b), rtol=TOL[dtype],
                     what=f"fp8 w8a16 m={m}")


def test_fp8_w8a16_split_k_and_refusals():
    parts, fmt = _fp8(40, 1024, torch.float32)
    x = _x(3, 1024, torch.float32)
    assert_close(fp8_w8a16_linear(x, parts, fmt, split_k=4), linear_ref(x, parts, fmt), rtol=1e-5)
    tensor_parts, tensor_fmt = _fp8(40, 1024, torch.float32, per_tensor=True)
    with pytest.raises(AssertionError, match="per-tensor scales go through prepare_fp8_w8a16"):
        fp8_w8a16_linear(x, tensor_parts, tensor_fmt)
    dynamic = Format(FormatKind.FP8_E4M3, activations=Activations.DYNAMIC)
    with pytest.raises(AssertionError, match="needs a weight-only fp8_e4m3 weight, got fp8_e4m3/act-dynamic"):
        fp8_w8a16_linear(x, parts, dynamic)


def _w8a8(kind, n, k, dtype, per_tensor=False):
    if kind is FormatKind.FP8_E4M3:
        return _fp8(n, k, dtype, per_tensor, Activations.DYNAMIC)
    fmt = Format(FormatKind.INT8_WO, dtype=DTYPES[dtype], bits=8, activations=Activations.DYNAMIC)
    return quantize_weight(torch.randn(n, k, generator=_gen(0)), fmt), fmt


def test_prepare_w8a8_makes_the_column_major_operand_without_copying():
    parts, fmt = _w8a8(FormatKind.FP8_E4M3, 48, 64, torch.bfloat16, per_tensor=True)
    prepared = w8a8.prepare_w8a8({"weight": Param(parts, fmt)})["weight"].parts
    w = prepared["qweight_t"]
    assert w.shape == (64, 48) and w.stride() == (1, 64) and w.data_ptr() == parts["qweight"].data_ptr()
    assert prepared["scales"].dtype == torch.float32 and prepared["scales"].shape == (1, 48)
    assert torch.equal(prepared["scales"], parts["scales"].float().expand(1, 48))


@pytest.mark.parametrize("kind", [FormatKind.FP8_E4M3, FormatKind.INT8_WO])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 20])
def test_w8a8_bindings_match_ref_on_the_cpu(kind, dtype, m):
    parts, fmt = _w8a8(kind, 48, 64, dtype)
    name = "torch.scaled_mm" if kind is FormatKind.FP8_E4M3 else "torch.int_mm"
    node = Node("l", "linear", ["x"], ["y"], {"in_features": 64, "out_features": 48}, {"weight": "w", "bias": "b"})
    impl = KERNELS[name].bind()  # prepare on the first call, the launcher through the op's adapter
    x, bias = _x(m, 64, dtype), torch.randn(48, generator=_gen(3)).to(dtype)
    params = {"weight": Param(parts, fmt), "bias": Param({"weight": bias}, Format(dtype=DTYPES[dtype]))}
    (y,) = impl(node, [x], params, None)
    expected = linear_ref(x, parts, fmt, bias)
    if kind is FormatKind.INT8_WO and dtype == torch.float32:
        assert torch.equal(y, expected)  # int32 sums are exact, and so are the reference's fp32 ones here
    else:
        assert_close(y, expected, rtol=TOL[dtype], what=f"{name} {dtype} m={m}")


def _sm89() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm89(), reason="needs a CUDA device of sm_89 or newer (fp8)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 33, 300])
def test_fp8_and_w8a8_kernels_on_cuda(dtype, m, monkeypatch):
    """Compiled, on Llama-3-8B's down_proj K and a ragged N (fp8 W8A16, per channel and per tensor) or
    N a multiple of 16 (the W8A8 bindings: torch._scaled_mm for fp8, torch._int_mm for int8)."""
    monkeypatch.setenv("OPTC_AUTOTUNE", "0")  # formats and shapes here, not the tuner
    x = _x(m, 4096, dtype).cuda()
    for per_tensor in (False, True):
        parts, fmt = _fp8(1000, 4096, dtype, per_tensor)
        parts = {r: t.cuda() for r, t in parts.items()}
        prepared = prepare_fp8_w8a16({"weight": Param(parts, fmt)})["weight"].parts
        assert_close(fp8_w8a16_linear(x, prepared, fmt), linear_ref(x, parts, fmt), rtol=TOL[dtype],
                     what=f"fp8 w8a16 per_tensor={per_tensor} m={m}")
    node = Node("l", "linear", ["x"], ["y"], {"in_features": 4096, "out_features": 1008}, {"weight": "w"})
    for kind, name in ((FormatKind.FP8_E4M3, "torch.scaled_mm"), (FormatKind.INT8_WO, "torch.int_mm")):
        parts, fmt = _w8a8(kind, 1008, 4096, dtype)
        parts = {r: t.cuda() for r, t in parts.items()}
        (y,) = KERNELS[name].bind()(node, [x], {"weight": Param(parts, fmt)}, None)
        assert_close(y, linear_ref(x, parts, fmt), rtol=TOL[dtype], what=f"{name} {dtype} m={m}")


def test_int_mm_padding_to_the_cuda_minimum_keeps_the_rows():
    parts, fmt = _w8a8(FormatKind.INT8_WO, 48, 64, torch.float32)
    xq, _ = quantize_rows_int8(_x(3, 64, torch.float32))
    w = parts["qweight"].t()
    padded = w8a8.pad_rows(xq, w8a8.INT_MM_MIN_ROWS)
    assert padded.shape == (17, 64) and torch.equal(padded[:3], xq) and not padded[3:].any()
    assert w8a8.pad_rows(padded, 17) is padded
    assert torch.equal(torch._int_mm(padded, w)[:3], torch._int_mm(xq, w))


def test_registry_binds_each_format_to_its_kernel():
    def chosen(fmt, shape=(64, 128), dtype="bfloat16"):
        spec = select(KernelQuery("linear", dtype, fmt, shape), "cuda")
        return spec.name if spec else None

    fp8 = Format(FormatKind.FP8_E4M3, dtype="bfloat16")
    fp8_dyn = Format(FormatKind.FP8_E4M3, dtype="bfloat16", activations=Activations.DYNAMIC)
    int8 = Format(FormatKind.INT8_WO, dtype="bfloat16", bits=8)
    int8_dyn = Format(FormatKind.INT8_WO, dtype="bfloat16", bits=8, activations=Activations.DYNAMIC)
    assert chosen(fp8) == chosen(Format(FormatKind.FP8_E4M3, per_tensor=True)) == "triton.fp8_w8a16"
    assert chosen(fp8_dyn) == "torch.scaled_mm" and chosen(fp8_dyn, (64, 120)) is None  # K % 16
    assert chosen(int8) == "triton.w8a16"
    assert chosen(int8_dyn) == "torch.int_mm" and chosen(int8_dyn, (68, 128)) is None  # N % 8: the reference
    assert select(KernelQuery("linear", "bfloat16", fp8_dyn, (64, 128)), "cpu") is None  # cpu: the reference
    caps = {n: KERNELS[n].min_capability for n in ("triton.fp8_w8a16", "torch.scaled_mm", "torch.int_mm")}
    assert caps == {"triton.fp8_w8a16": (8, 9), "torch.scaled_mm": (8, 9), "torch.int_mm": None}


COMPILE = textwrap.dedent('''
    import sys
    import torch
    from optc.core.formats import Format, FormatKind
    from optc.kernels.compile_only import compile_only
    from optc.kernels.fp8_w8a16 import fp8_w8a16_linear

    arch = int(sys.argv[1])
    fmt = Format(FormatKind.FP8_E4M3, dtype="bfloat16")
    parts = {"qweight": torch.zeros(1536, 576, dtype=torch.float8_e4m3fn),
             "scales": torch.ones(1536, dtype=torch.bfloat16)}
    try:
        with compile_only(arch, all_configs=False) as launches:
            for m in (1, 4, 64):  # the M = 1 GEMV, the split-K GEMV, the GEMM
                fp8_w8a16_linear(torch.zeros(m, 576, dtype=torch.bfloat16), parts, fmt)
    except Exception as exc:
        print("refused:", str(exc).strip().splitlines()[-1])
        sys.exit(0)
    for launch in launches:
        for c in launch.configs:
            print(launch.kernel, c.config["BLOCK_M"], c.registers, c.spill_bytes, c.fits, 16 in c.loads)
''')


@pytest.mark.parametrize("arch", [90, 80])
def test_fp8_w8a16_compiles_for_sm90_and_is_refused_below_sm89(tmp_path, arch):
    script = tmp_path / "compile.py"
    script.write_text(COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, str(script), str(arch)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.split("\n")
    if arch == 80:  # fp8e4nv needs sm_89: why the format's min capability is 8.9
        assert any("refused:" in line and "fp8e4nv not supported" in line for line in lines), proc.stdout
        return
    compiled = [line.split() for line in lines if line.startswith("_w8a16_kernel")]  # w8a16's kernel on fp8 weights
    assert len(compiled) == 3, proc.stdout
    # every launch shape fits, spills nothing and streams in 16-byte loads
    assert all(spill == "0" and fits == "True" and wide == "True" for _, _, _, spill, fits, wide in compiled)
