"""W8A16 matmul: y = x @ W^T (+ bias) with W stored int8_wo (int8 (N, K), one scale per output
channel; see optc.core.formats), dequantized in registers.

One kernel, two launch shapes chosen by M (see _splitk): a split-K GEMV for M <= 16 (decode; fp32
partials summed by the launcher) and a tiled GEMM for larger M (prefill). Per K tile, W is loaded
as (BLOCK_K, BLOCK_N) int8, dequantized as q * s in fp32, rounded to x's dtype (the reference
dequantizes to x's dtype before its matmul) and fed to tl.dot (or, in one-row tiles at M = 1,
multiplied on the FMA units and summed over K) with an fp32 accumulator; bias is
added in fp32; one cast on store.

Autotune configs are data (M1_CONFIGS, GEMV_CONFIGS, GEMM_CONFIGS); every BLOCK_K divides SPLIT_ALIGN, so the
pruning keeps them all, and on the CPU (the Triton interpreter, which cannot time kernels) the
first config runs. Tests compare it with its op's torch reference (optc.core.ops), on the CPU under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optc.core.formats import Format
from optc.core.ops.linear import exact_top_logits
from optc.kernels import _splitk
from optc.kernels._dot import dot_or_fma
from optc.kernels._splitk import config

SPLIT_ALIGN = 128  # split boundaries fall on multiples of this many K
GEMV_CONFIGS = [config(16, n, k, 4, s) for n in (64, 32, 128) for k in (128, 64) for s in (2, 4)]
GEMM_CONFIGS = [config(m, n, k, w, s) for m, n, w in ((64, 64, 4), (128, 128, 8), (64, 128, 4), (128, 64, 4))
                for k in (64, 128) for s in (3, 4)]
# M == 1 also tries dot-free tiles of one row (FMA and a sum over K), after the GEMV's own; the
# tiles whose x and weight loads compile to 16-byte copies (benchmarks/kernels.py --compile-only)
M1_CONFIGS = GEMV_CONFIGS + [config(1, n, k, 4, 1) for n, k in ((64, 128), (128, 128), (32, 128), (128, 64))]


@triton.jit(do_not_specialize=["M_BUCKET"])
def _w8a16_kernel(
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
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_K, BLOCK_N) int8 | fp8
        w = (q.to(tl.float32) * s[None, :]).to(x_ptr.dtype.element_ty)
        acc += dot_or_fma(x, w, FP32_DOT, BLOCK_M)
    _splitk.store_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, split, M, N, stride_om, stride_os, HAS_BIAS, IS_SPLIT)


_KERNELS = _splitk.autotune(_w8a16_kernel, M1_CONFIGS, GEMV_CONFIGS, GEMM_CONFIGS, k_multiples=("k_per_split",))


def w8a16_linear(
    x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format, bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """linear_ref for an int8_wo weight: x (..., K) -> (..., N) in x's dtype. `split_k` overrides the
    GEMV's split heuristic (M <= 16 only)."""
    assert fmt.bits == 8 and fmt.group_size is None, f"w8a16 needs an int8_wo weight, got {fmt.kind.value}"
    qweight, scales = parts["qweight"], parts["scales"]
    n, k = qweight.shape
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, the weight {k}"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported x dtype {x.dtype}"
    assert qweight.dtype == torch.int8 and qweight.stride(1) == 1, "qweight must be int8 with contiguous K"
    assert scales.shape == (n,) and scales.is_contiguous(), f"scales {list(scales.shape)} != ({n},)"
    assert bias is None or bias.shape == (n,), f"bias {None if bias is None else list(bias.shape)} != ({n},)"
    return _splitk.launch(
        _KERNELS, x, n, bias, split_k, SPLIT_ALIGN, _split_k,
        qweight_ptr=qweight, scales_ptr=scales, stride_qn=qweight.stride(0),
    )


def _split_k(n: int, k: int) -> int:
    # enough (N tile, split) programs to fill the GPU, at least 512 K per split
    return max(1, min(triton.cdiv(_splitk.TARGET_PROGRAMS, triton.cdiv(n, 64)), k // 512))


def w8a16_logits(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format) -> torch.Tensor:
    """logits_ref for a quantized lm_head through `w8a16_linear`: x (M, K) -> (M, V) float32."""
    return exact_top_logits(w8a16_linear(x, parts, fmt).float(), x, parts, fmt)
