"""Triton w4a16 / w8a16 linear against optc.core.formats.linear_ref (interpreter on the CPU).

Weights are random int4_g (with and without zero point, group sizes 32/64/128) or int8_wo; M covers
the GEMV path (M <= 16, split-K) and the GEMM path; N and M are not multiples of the tiles.
"""

import pytest
import torch

from optc.core.formats import Format, FormatKind, linear_ref, pack_int4
from optc.core.ops.linear import logits_ref
from optc.kernels.w4a16 import w4a16_linear, w4a16_logits
from optc.kernels.w8a16 import w8a16_linear, w8a16_logits


def assert_close(actual, expected, atol, rtol=0.0):
    diff = (actual.float() - expected.float()).abs()
    ok = torch.allclose(actual.float(), expected.float(), atol=atol, rtol=rtol)
    assert ok, f"max diff {diff.max().item():.3g}, mean diff {diff.mean().item():.3g}"


def _int4(n, k, group, zero_point, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    fmt = Format(FormatKind.INT4_G, dtype=_name(dtype), bits=4, group_size=group, zero_point=zero_point,
                 packing="k8_lsb")
    parts = {"qweight": pack_int4(torch.randint(0, 16, (n, k), generator=g)),
             "scales": (torch.rand(n, k // group, generator=g) * 0.02 + 0.005).to(dtype)}
    if zero_point:
        parts["zeros"] = torch.randint(0, 16, (n, k // group), generator=g).to(torch.uint8)
    return parts, fmt


def _int8(n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    fmt = Format(FormatKind.INT8_WO, dtype=_name(dtype), bits=8)
    return {"qweight": torch.randint(-127, 128, (n, k), generator=g).to(torch.int8),
            "scales": (torch.rand(n, generator=g) * 0.001 + 0.0005).to(dtype)}, fmt


def _name(dtype):
    return {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]


def _x(m, k, dtype, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


# outputs are O(1); fp32 exact up to summation order, half precision within a few ulps (bf16 more:
# the interpreter truncates the dequantized weights to bf16 instead of rounding them)
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("m", [1, 5])
def test_w4a16_gemv_kernel_matches_ref(group, zero_point, m):
    parts, fmt = _int4(72, 256, group, zero_point, torch.float32)
    x = _x(m, 256, torch.float32)
    assert_close(w4a16_linear(x, parts, fmt, split_k=2), linear_ref(x, parts, fmt), TOL[torch.float32])


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_one_row_fma_path_matches_ref(monkeypatch, group, zero_point, dtype):
    # M == 1 with a dot-free config (BLOCK_M = 1): nibbles turned into floats through the exponent bits,
    # s (sum q x - z sum x) per group; N = 72 is ragged for every BLOCK_N, K splits in two, with a bias
    from optc.kernels import w4a16

    one_row = [c for c in w4a16.M1_CONFIGS if c.kwargs["BLOCK_M"] == 1 and group % c.kwargs["BLOCK_K"] == 0]
    assert one_row
    parts, fmt = _int4(72, 512, group, zero_point, dtype)
    x, bias = _x(1, 512, dtype), torch.randn(72).to(dtype)
    exact = x.double() @ _dequantized(parts, fmt).T + bias.double()  # no rounding of the weights at all
    for config in one_row:
        monkeypatch.setattr(w4a16._KERNELS.m1, "configs", [config])
        out = w4a16_linear(x, parts, fmt, bias, split_k=2)
        # fp32: within summation order of the unrounded weights; bf16: the output's own rounding
        assert_close(out, exact, 1e-4 if dtype == torch.float32 else 2e-2, 1e-2 if dtype != torch.float32 else 0)
        assert_close(out, linear_ref(x, parts, fmt, bias), TOL[dtype])


def _dequantized(parts, fmt) -> torch.Tensor:
    from optc.core.formats import unpack_int4

    q = unpack_int4(parts["qweight"]).double()
    z = parts["zeros"].double() if fmt.zero_point else torch.full_like(parts["scales"], 8, dtype=torch.float64)
    group = fmt.group_size
    return (q - z.repeat_interleave(group, 1)) * parts["scales"].double().repeat_interleave(group, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [3, 37])
def test_w4a16_kernel_half_precision_with_bias(dtype, m):
    parts, fmt = _int4(100, 384, 128, True, dtype, seed=2)
    x, bias = _x(m, 384, dtype), torch.randn(100, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = w4a16_linear(x, parts, fmt, bias)
    assert out.dtype == dtype and out.shape == (m, 100)
    assert_close(out, linear_ref(x, parts, fmt, bias), TOL[dtype], 1e-2)


@pytest.mark.parametrize("group", [32, 128])
def test_w4a16_gemm_kernel_matches_ref(group):
    parts, fmt = _int4(80, 256, group, group == 32, torch.float32, seed=4)
    x = _x(70, 256, torch.float32).view(2, 35, 256)  # leading dims are flattened
    out = w4a16_linear(x, parts, fmt)
    assert out.shape == (2, 35, 80)
    assert_close(out, linear_ref(x, parts, fmt), TOL[torch.float32])


def test_w4a16_split_k_and_single_pass_agree():
    parts, fmt = _int4(40, 512, 64, False, torch.float32, seed=5)
    x = _x(2, 512, torch.float32)
    assert_close(w4a16_linear(x, parts, fmt, split_k=3), w4a16_linear(x, parts, fmt, split_k=1), 1e-5)


def test_w4a16_kernel_rejects_wrong_format():
    parts, fmt = _int8(8, 64, torch.float32)
    with pytest.raises(AssertionError, match="int4_g"):
        w4a16_linear(_x(1, 64, torch.float32), parts, fmt)


@pytest.mark.parametrize("m", [1, 9, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a16_kernel_matches_ref(m, dtype):
    parts, fmt = _int8(90, 200, dtype, seed=6)  # K not a multiple of BLOCK_K
    x = _x(m, 200, dtype)
    bias = torch.randn(90, generator=torch.Generator().manual_seed(7)).to(dtype) if m == 9 else None
    out = w8a16_linear(x, parts, fmt, bias, split_k=2 if m == 1 else None)
    assert_close(out, linear_ref(x, parts, fmt, bias), TOL[dtype], 1e-2)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_lm_head_logits_kernels_match_logits_ref(kind):
    # a quantized lm_head on cuda: the linear kernel, then logits_ref's fp32 recompute of each row's best
    parts, fmt = _int4(96, 128, 32, True, torch.bfloat16) if kind == "int4" else _int8(96, 128, torch.bfloat16)
    x = _x(3, 128, torch.bfloat16)
    out = (w4a16_logits if kind == "int4" else w8a16_logits)(x, parts, fmt)
    ref = logits_ref(x, parts, fmt)
    top = ref.topk(4, dim=-1)
    assert out.dtype == torch.float32 and torch.equal(out.gather(-1, top.indices), top.values)
    assert_close(out, ref, TOL[torch.bfloat16], 1e-2)


def test_w8a16_kernel_fp16_split_k():
    parts, fmt = _int8(50, 640, torch.float16, seed=8)
    x = _x(4, 640, torch.float16)
    assert_close(w8a16_linear(x, parts, fmt, split_k=4), linear_ref(x, parts, fmt), TOL[torch.float16], 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 8, 32, 300])
def test_linear_kernels_on_cuda_llama_shapes(m, monkeypatch):
    monkeypatch.setenv("OPTC_AUTOTUNE", "0")  # correctness here; every config: test_every_autotune_config_on_cuda
    parts, fmt = _int4(14336, 4096, 128, True, torch.bfloat16)
    parts = {r: t.cuda() for r, t in parts.items()}
    x = _x(m, 4096, torch.bfloat16).cuda()
    assert_close(w4a16_linear(x, parts, fmt), linear_ref(x, parts, fmt), 5e-2, 1e-2)
    parts, fmt = _int8(4096, 14336, torch.bfloat16)
    parts = {r: t.cuda() for r, t in parts.items()}
    x = _x(m, 14336, torch.bfloat16).cuda()
    assert_close(w8a16_linear(x, parts, fmt), linear_ref(x, parts, fmt), 5e-2, 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group,zero_point", [(32, False), (64, True), (128, False)])
@pytest.mark.parametrize("m", [1, 5, 17, 77])
def test_linear_kernels_on_cuda_formats_and_ragged_shapes(dtype, group, zero_point, m, monkeypatch):
    # SmolLM2-sized K (576, 1536), N not a multiple of any tile, with bias; formats, not speed: the
    # first fitting config runs untimed (every config is checked below)
    monkeypatch.setenv("OPTC_AUTOTUNE", "0")
    n, k = 1000, 576 if group != 128 else 1536
    tol = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(dtype).cuda()
    parts, fmt = _int4(n, k, group, zero_point, dtype)
    parts = {r: t.cuda() for r, t in parts.items()}
    x = _x(m, k, dtype).cuda()
    assert_close(w4a16_linear(x, parts, fmt, bias), linear_ref(x, parts, fmt, bias), tol, 1e-2)
    parts, fmt = _int8(n, k, dtype)
    parts = {r: t.cuda() for r, t in parts.items()}
    assert_close(w8a16_linear(x, parts, fmt, bias), linear_ref(x, parts, fmt, bias), tol, 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_lm_head_logits_kernels_on_cuda(kind, m, monkeypatch):
    # SmolLM2's lm_head (49152 x 576) in bfloat16: the kernel's logits, each row's best recomputed in fp32
    monkeypatch.setenv("OPTC_AUTOTUNE", "0")
    parts, fmt = _int4(49152, 576, 64, True, torch.bfloat16) if kind == "int4" else _int8(49152, 576, torch.bfloat16)
    parts = {r: t.cuda() for r, t in parts.items()}
    x = _x(m, 576, torch.bfloat16).cuda()
    out = (w4a16_logits if kind == "int4" else w8a16_logits)(x, parts, fmt)
    ref = logits_ref(x, parts, fmt)
    top = ref.topk(4, dim=-1)
    assert out.dtype == torch.float32 and torch.equal(out.gather(-1, top.indices), top.values)
    assert_close(out, ref, 5e-2, 1e-2)


def _every_config(kernel, monkeypatch, n, k, m_gemv, m_gemm, dtype, tol, device, split_k=None):
    """Run each M == 1, GEMV and GEMM config of `kernel` alone (an autotuner with one config runs it
    unpruned, so K and the group must suit every BLOCK_K); the configs whose output is wrong."""
    import importlib

    module = importlib.import_module(f"optc.kernels.{kernel}")
    parts, fmt = _int4(n, k, 128, True, dtype) if kernel == "w4a16" else _int8(n, k, dtype)
    parts = {r: t.to(device) for r, t in parts.items()}
    linear = module.w4a16_linear if kernel == "w4a16" else module.w8a16_linear
    wrong = []
    kernels = module._KERNELS
    for tuner, configs, m in ((kernels.m1, module.M1_CONFIGS, 1), (kernels.gemv, module.GEMV_CONFIGS, m_gemv),
                              (kernels.gemm, module.GEMM_CONFIGS, m_gemm)):
        x = _x(m, k, dtype).to(device)
        expected = linear_ref(x, parts, fmt)
        for config in configs:
            monkeypatch.setattr(tuner, "configs", [config])
            try:
                assert_close(linear(x, parts, fmt, split_k=split_k if m <= 16 else None), expected, *tol)
            except AssertionError as e:
                wrong.append(f"{config}: {e}")
    return wrong


@pytest.mark.parametrize("kernel", ["w4a16", "w8a16"])
def test_every_autotune_config_matches_ref(kernel, monkeypatch):
    # the interpreter otherwise runs only the first config; N = 70 fits no tile, 2 K splits
    assert not _every_config(kernel, monkeypatch, 70, 512, 3, 20, torch.float16, (1e-2, 1e-2), "cpu", split_k=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["w4a16", "w8a16"])
def test_every_autotune_config_on_cuda(kernel, monkeypatch):
    # Llama-3-8B's K, a ragged N; each config alone, so configs the timing never picks are checked too
    assert not _every_config(kernel, monkeypatch, 1000, 4096, 3, 77, torch.bfloat16, (5e-2, 1e-2), "cuda")

def test_autotune_pruning_keeps_fitting_configs_and_optc_autotune_0_keeps_one(monkeypatch):
    from optc.kernels import _splitk, w4a16

    monkeypatch.setattr(_splitk, "interpreting", lambda: False)  # as compiled for a GPU
    prune = w4a16._KERNELS.gemv.early_config_prune
    args = {"M": 8, "N": 4096, "K": 4096, "group_size": 32, "k_per_split": 1024}  # no tile past the problem
    kept = prune(w4a16.GEMV_CONFIGS, args)
    assert kept == [c for c in w4a16.GEMV_CONFIGS if c.kwargs["BLOCK_K"] == 32] and len(kept) > 1
    monkeypatch.setenv("OPTC_AUTOTUNE", "0")
    assert prune(w4a16.GEMV_CONFIGS, args) == kept[:1]


def test_autotune_keys_on_the_m_bucket_so_prefill_and_decode_tune_apart(monkeypatch):
    from optc.kernels import _splitk, w4a16, w8a16

    assert [_splitk.m_bucket(m) for m in (1, 2, 3, 16, 17, 32, 33, 64, 65, 2048)] == \
        [1, 2, 4, 16, 32, 32, 64, 64, 128, 256]
    for module, linear, make in ((w4a16, w4a16_linear, lambda n, k: _int4(n, k, 32, True, torch.float32)),
                                 (w8a16, w8a16_linear, lambda n, k: _int8(n, k, torch.float32))):
        kernels = module._KERNELS
        for tuner in kernels:
            monkeypatch.setattr(tuner, "cache", {})
        parts, fmt = make(40, 64)
        for m in (3, 4, 9, 20, 30, 70, 300, 600):
            linear(_x(m, 64, torch.float32), parts, fmt)
        # the key starts with M's bucket: 3 and 4 share one, as do 20 and 30, and 300 and 600 (capped)
        assert sorted(k[0] for k in kernels.gemv.cache) == [4, 16]
        assert sorted(k[0] for k in kernels.gemm.cache) == [32, 128, 256]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3, 28])
def test_split_k_reduce_is_one_kernel_matching_the_reference(dtype, num_splits):
    from optc.kernels._splitk import reduce_splits

    g = torch.Generator().manual_seed(num_splits)
    part = torch.randn(num_splits, 5, 1000, generator=g)  # N = 1000: no power of two
    bias = torch.randn(1000, generator=g).to(dtype)
    for b in (None, bias):
        out = reduce_splits(part, b, torch.empty(5, 1000, dtype=dtype))
        ref = part.sum(0) + (b.float() if b is not None else 0)
        assert_close(out, ref.to(dtype), 1e-5 if dtype == torch.float32 else 1e-2, 1e-2)


def test_split_k_gemv_launches_no_torch_reduction(monkeypatch):
    # the partials go through the one Triton reduce: no torch sum / add / copy_ per split linear
    from optc.kernels import _splitk

    calls, reduce = [], _splitk.reduce_splits
    monkeypatch.setattr(_splitk, "reduce_splits", lambda *a: calls.append(a) or reduce(*a))
    parts, fmt = _int4(48, 256, 32, True, torch.float32)
    x = _x(2, 256, torch.float32)
    bias = torch.randn(48)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = w4a16_linear(x, parts, fmt, bias, split_k=4)
    assert len(calls) == 1
    # (copy_ is not checked: the interpreter itself copies kernel arguments)
    assert not {"aten::sum", "aten::add", "aten::add_"} & {e.key for e in prof.key_averages()}
    assert_close(out, linear_ref(x, parts, fmt, bias), TOL[torch.float32])
