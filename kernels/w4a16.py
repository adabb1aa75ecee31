"""W4A16 matmul: y = x @ W^T (+ bias) with W stored int4_g (see optc.formats), dequantized in
registers.

One kernel, two launch shapes chosen by M (see _splitk): a split-K GEMV for M <= 16 (decode; tiles
of 16 rows, K split across programs so a small N still fills the GPU; fp32 partials summed by the
launcher) and a tiled GEMM for larger M (prefill). Per K tile the packed words of W (N, K // 8)
int32 are loaded once, as a (BLOCK_K // 8, BLOCK_N) tile, unpacked in registers (nibble j of a
word is `(word >> 4 * j) & 0xF`, laid out (BLOCK_K // 8, 8, BLOCK_N) and reshaped to
(BLOCK_K, BLOCK_N), which is k8_lsb's order), dequantized as (q - z) * s in fp32 with the tile's
group scale and zero point, rounded to x's dtype (the reference dequantizes to x's dtype before
its matmul), and fed to tl.dot (or, in one-row tiles at M = 1, multiplied on the FMA units and
summed over K) with an fp32 accumulator; bias is added in fp32; one cast on store.
BLOCK_K divides the group size, so one scale (and zero) per output column serves a K tile, and
every K tile is whole (K and each split are whole groups): the weight loads are masked along N
only, which lets them compile to 16-byte copies. (Gathering one word per nibble instead, as an
earlier version did, compiled for sm_90 to 8x the load instructions, 4-byte copies and twice the
shared memory: benchmarks/kernels.py --compile-only.)

Autotune configs are data (M1_CONFIGS, GEMV_CONFIGS, GEMM_CONFIGS), pruned so BLOCK_K divides the group size;
on the CPU (the Triton interpreter, which cannot time kernels) the first surviving config runs.
Tests compare it with its op's torch reference (optc.ops), on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optc.formats import Format, FormatKind
from optc.kernels import _splitk
from optc.kernels._dot import dot_or_fma
from optc.kernels._splitk import config

GEMV_CONFIGS = [config(16, n, k, 4, s) for n in (64, 32, 128) for k in (128, 64, 32) for s in (2, 4)]
GEMM_CONFIGS = [config(m, n, k, w, s) for m, n, w in ((64, 64, 4), (128, 128, 8), (64, 128, 4), (128, 64, 4))
                for k in (64, 32, 128) for s in (3, 4)]
# M == 1 also tries dot-free tiles of one row (FMA and a sum over K), after the GEMV's own; the
# tiles whose x and weight loads compile to 16-byte copies (benchmarks/kernels.py --compile-only)
M1_CONFIGS = GEMV_CONFIGS + [config(1, n, k, 4, 1) for n, k in ((64, 128), (128, 128), (32, 128), (128, 64))]


@triton.jit(do_not_specialize=["M_BUCKET"])
def _w4a16_kernel(
    # pointers
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
    # sizes (M_BUCKET: the autotune key's bucket of M, never read)
    M, M_BUCKET, N, K, group_size, k_per_split,
    # strides: x, out (row); qweight, scales, zeros (row n); partials (split)
    stride_xm, stride_om, stride_os, stride_qn, stride_sn, stride_zn,
    # meta
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m, offs_n, split, k_start, k_end = _splitk.tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    rows_n = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    shifts = tl.arange(0, 8) * 4
    for k0 in range(k_start, k_end, BLOCK_K):
        x, _, _ = _splitk.load_x(x_ptr, offs_m, mask_m, k0, k_end, stride_xm, BLOCK_K, True)
        # w tile (BLOCK_K, BLOCK_N): nibble k % 8 of word k // 8 of row n; whole K tiles, no K mask
        offs_w = tl.multiple_of(k0 // 8, BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        words = tl.load(qweight_ptr + rows_n[None, :] * stride_qn + offs_w[:, None], mask=mask_n[None, :], other=0)
        q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        group = k0 // group_size  # BLOCK_K divides the group size: one group per K tile
        s = tl.load(scales_ptr + rows_n * stride_sn + group, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + rows_n * stride_zn + group, mask=mask_n, other=0).to(tl.float32)
        else:
            z = tl.full([BLOCK_N], 8.0, tl.float32)
        w = ((q.to(tl.float32) - z[None, :]) * s[None, :]).to(x_ptr.dtype.element_ty)
        acc += dot_or_fma(x, w, FP32_DOT, BLOCK_M)
    _splitk.store_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, split, M, N, stride_om, stride_os, HAS_BIAS, IS_SPLIT)


_KERNELS = _splitk.autotune(_w4a16_kernel, M1_CONFIGS, GEMV_CONFIGS, GEMM_CONFIGS,
                            k_multiples=("group_size", "k_per_split"))


def w4a16_linear(
    x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format, bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """linear_ref for an int4_g weight: x (..., K) -> (..., N) in x's dtype. `split_k` overrides the
    GEMV's split heuristic (M <= 16 only)."""
    assert fmt.kind is FormatKind.INT4_G, f"w4a16 needs an int4_g weight, got {fmt.kind.value}"
    qweight, scales, zeros = parts["qweight"], parts["scales"], parts.get("zeros")
    n, k, group = qweight.shape[0], qweight.shape[1] * 8, fmt.group_size
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, the weight {k}"
    assert k % group == 0, f"K={k} is not a multiple of group size {group}"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported x dtype {x.dtype}"
    assert qweight.dtype == torch.int32 and qweight.stride(1) == 1, "qweight must be int32 with contiguous K"
    assert scales.shape == (n, k // group), f"scales {list(scales.shape)} != ({n}, {k // group})"
    assert scales.stride(1) == 1, "scales must be contiguous along K"
    assert (zeros is not None) == fmt.zero_point, "zeros present iff the format has a zero point"
    assert zeros is None or (zeros.shape == scales.shape and zeros.stride(1) == 1), "zeros must match scales"
    assert bias is None or bias.shape == (n,), f"bias {None if bias is None else list(bias.shape)} != ({n},)"
    return _splitk.launch(
        _KERNELS, x, n, bias, split_k, group, lambda n, k: _split_k(n, k, group),  # whole groups per split
        qweight_ptr=qweight, scales_ptr=scales, zeros_ptr=zeros if zeros is not None else scales,
        group_size=group, stride_qn=qweight.stride(0), stride_sn=scales.stride(0),
        stride_zn=zeros.stride(0) if zeros is not None else 0, HAS_ZEROS=zeros is not None,
    )


def _split_k(n: int, k: int, group: int) -> int:
    # enough (N tile, split) programs to fill the GPU, at least 4 groups of K per split
    return max(1, min(triton.cdiv(_splitk.TARGET_PROGRAMS, triton.cdiv(n, 64)), k // (4 * group)))
