"""fp8 W8A16: y = x @ W^T (+ bias) with W stored fp8_e4m3 weight-only (float8_e4m3fn (N, K), a scale
per output channel or per tensor; see optc.core.formats), dequantized in registers.

w8a16's kernel with an fp8 weight tile: the same launch shapes (a split-K GEMV for M <= 16, a tiled
GEMM above; kernels/_splitk.py), the same autotune lists (w8a16.M1_CONFIGS, GEMV_CONFIGS,
GEMM_CONFIGS) and split heuristic. Per K tile, W is loaded as (BLOCK_K, BLOCK_N) fp8 (masked lanes
read 0.0: an fp8 load takes a float `other`), converted to fp32 (a hardware conversion from sm_89;
Triton refuses fp8e4nv below), multiplied by the channel's scale, rounded to x's dtype (as the
reference dequantizes to x's dtype before its matmul) and fed to tl.dot, or to the FMA units in
one-row tiles, with an fp32 accumulator; bias added in fp32; one cast on store.

`prepare_fp8_w8a16` widens a per-tensor scale to one per output channel, once per node: the kernel
reads a scale per column. Tests compare it with its op's reference (optc.core.formats.linear_ref) under
TRITON_INTERPRET=1, which runs fp8 loads and conversions, and compile it for sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optc.core.formats import Activations, Format
from optc.core.ops import Param
from optc.kernels import _splitk
from optc.kernels._dot import dot_or_fma
from optc.kernels.w8a16 import GEMM_CONFIGS, GEMV_CONFIGS, M1_CONFIGS, SPLIT_ALIGN


@triton.jit(do_not_specialize=["M_BUCKET"])
def _fp8_w8a16_kernel(
    # pointers
    x_ptr, qweight_ptr, scales_ptr, bias_ptr, out_ptr,
    # sizes (M_BUCKET: the autotune key's bucket of M, never read)
    M, M_BUCKET, N, K, k_per_split,
    # strides: x, out (row); partials (split); qweight (row n)
    stride_xm, stride_om, stride_os, stride_qn,
    # meta
    HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m, offs_n, split, k_start, k_end = _splitk.tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    rows_n = offs_n.to(tl.int64)
    s = tl.load(scales_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x, offs_k, mask_k = _splitk.load_x(x_ptr, offs_m, mask_m, k0, k_end, stride_xm, BLOCK_K, False)
        q = tl.load(qweight_ptr + rows_n[None, :] * stride_qn + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_K, BLOCK_N) fp8
        w = (q.to(tl.float32) * s[None, :]).to(x_ptr.dtype.element_ty)
        acc += dot_or_fma(x, w, FP32_DOT, BLOCK_M)
    _splitk.store_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, split, M, N, stride_om, stride_os, HAS_BIAS, IS_SPLIT)


_KERNELS = _splitk.autotune(_fp8_w8a16_kernel, M1_CONFIGS, GEMV_CONFIGS, GEMM_CONFIGS, k_multiples=("k_per_split",))


def prepare_fp8_w8a16(params: dict[str, Param]) -> dict[str, Param]:
    """A linear node's params -> the same with a per-tensor scale widened to (N,) (per-channel: as is)."""
    w = params["weight"]
    scales, n = w.parts["scales"], w.parts["qweight"].shape[0]
    if scales.shape == (n,):
        return params
    return {**params, "weight": Param({**w.parts, "scales": scales.expand(n).contiguous()}, w.format)}


def fp8_w8a16_linear(
    x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format, bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """linear_ref for a weight-only fp8_e4m3 weight (scales prepared to (N,)): x (..., K) -> (..., N) in
    x's dtype. `split_k` overrides the GEMV's split heuristic (M <= 16 only)."""
    qweight, scales = parts["qweight"], parts["scales"]
    assert qweight.dtype == torch.float8_e4m3fn and fmt.activations is Activations.NONE, \
        f"fp8_w8a16 needs a weight-only fp8_e4m3 weight, got {fmt.label}"
    n, k = qweight.shape
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, the weight {k}"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported x dtype {x.dtype}"
    assert qweight.stride(1) == 1, "qweight must have contiguous K"
    assert scales.shape == (n,) and scales.is_contiguous(), \
        f"scales {list(scales.shape)} != ({n},): per-tensor scales go through prepare_fp8_w8a16"
    assert bias is None or bias.shape == (n,), f"bias {None if bias is None else list(bias.shape)} != ({n},)"
    return _splitk.launch(
        _KERNELS, x, n, bias, split_k, SPLIT_ALIGN, _split_k,
        qweight_ptr=qweight, scales_ptr=scales, stride_qn=qweight.stride(0),
    )


def _split_k(n: int, k: int) -> int:
    # as w8a16: enough (N tile, split) programs to fill the GPU, at least 512 K per split
    return max(1, min(triton.cdiv(_splitk.TARGET_PROGRAMS, triton.cdiv(n, 64)), k // 512))
