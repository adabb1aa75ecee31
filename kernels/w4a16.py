"""W4A16 matmul: y = x @ W^T (+ bias) with W stored int4_g (see optc.core.formats), dequantized in
registers.

One kernel, two launch shapes chosen by M (see _splitk): a split-K GEMV for M <= 16 (decode; tiles
of 16 rows, K split across programs so a small N still fills the GPU; fp32 partials summed by the
launcher) and a tiled GEMM for larger M (prefill). Per K tile the packed words of W (N, K // 8)
int32 are loaded once, as a (BLOCK_K // 8, BLOCK_N) tile, unpacked in registers (nibble j of a
word is `(word >> 4 * j) & 0xF`, laid out (BLOCK_K // 8, 8, BLOCK_N) and reshaped to
(BLOCK_K, BLOCK_N), which is k8_lsb's order), dequantized as (q - z) * s in fp32 with the tile's
group scale and zero point, rounded to x's dtype (the reference dequantizes to x's dtype before
its matmul), and fed to tl.dot with an fp32 accumulator; bias is added in fp32; one cast on store.
One-row tiles at M = 1 (`_row_times_nibbles`) skip the tensor cores, the reshape and the rounding:
they keep the words as they lie, turn nibbles into floats through the exponent bits and multiply
on the FMA units in fp32, closer to the exact product than the reference.
BLOCK_K divides the group size, so one scale (and zero) per output column serves a K tile, and
every K tile is whole (K and each split are whole groups): the weight loads are masked along N
only, which lets them compile to 16-byte copies. (Gathering one word per nibble instead, as an
earlier version did, compiled for sm_90 to 8x the load instructions, 4-byte copies and twice the
shared memory: benchmarks/kernels.py --compile-only.)

Autotune configs are data (M1_CONFIGS, GEMV_CONFIGS, GEMM_CONFIGS), pruned so BLOCK_K divides the group size;
on the CPU (the Triton interpreter, which cannot time kernels) the first surviving config runs.
Tests compare it with its op's torch reference (optc.core.ops), on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optc.core.formats import INT4_PACKING, Format
from optc.core.ops.linear import exact_top_logits
from optc.kernels import _splitk
from optc.kernels._dot import dot
from optc.kernels._splitk import config

GEMV_CONFIGS = [config(16, n, k, 4, s) for n in (64, 32, 128) for k in (128, 64, 32) for s in (2, 4)]
GEMM_CONFIGS = [config(m, n, k, w, s) for m, n, w in ((64, 64, 4), (128, 128, 8), (64, 128, 4), (128, 64, 4))
                for k in (64, 32, 128) for s in (3, 4)]
# M == 1 also tries dot-free tiles of one row (`_row_times_nibbles`), after the GEMV's own, for group
# sizes 32, 64 and 128; their weight and x loads compile to 16-byte copies for sm_90 (num_stages 3
# compiled to the same code as 1: benchmarks/kernels.py --compile-only)
M1_CONFIGS = GEMV_CONFIGS + [config(1, n, k, w, 1) for n, k, w in ((64, 128, 4), (128, 128, 4), (256, 128, 8),
                                                                   (32, 128, 4), (128, 64, 4), (64, 32, 4))]


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
    if BLOCK_M == 1:
        acc = _row_times_nibbles(x_ptr + tl.program_id(0).to(tl.int64) * stride_xm, qweight_ptr, scales_ptr,
                                 zeros_ptr, rows_n, mask_n, k_start, k_end, group_size, stride_qn, stride_sn,
                                 stride_zn, HAS_ZEROS, BLOCK_N, BLOCK_K)[None, :]
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        shifts = tl.arange(0, 8) * 4
        for k0 in range(k_start, k_end, BLOCK_K):
            x, _, _ = _splitk.load_x(x_ptr, offs_m, mask_m, k0, k_end, stride_xm, BLOCK_K, True)
            # w tile (BLOCK_K, BLOCK_N): nibble k % 8 of word k // 8 of row n; whole K tiles, no K mask
            offs_w = tl.multiple_of(k0 // 8, BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
            words = tl.load(qweight_ptr + rows_n[None, :] * stride_qn + offs_w[:, None], mask=mask_n[None, :],
                            other=0)
            q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
            s, z = _group_scale_zero(scales_ptr, zeros_ptr, rows_n, mask_n, k0 // group_size, stride_sn, stride_zn,
                                     HAS_ZEROS, BLOCK_N)
            w = ((q.to(tl.float32) - z[None, :]) * s[None, :]).to(x_ptr.dtype.element_ty)
            acc += dot(x, w, FP32_DOT)
    _splitk.store_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, split, M, N, stride_om, stride_os, HAS_BIAS, IS_SPLIT)


@triton.jit
def _group_scale_zero(scales_ptr, zeros_ptr, rows_n, mask_n, group, stride_sn, stride_zn,
                      HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr):
    # the scale and zero point of quantization group `group` for rows rows_n, in fp32
    s = tl.load(scales_ptr + rows_n * stride_sn + group, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(zeros_ptr + rows_n * stride_zn + group, mask=mask_n, other=0).to(tl.float32)
    else:
        z = tl.full([BLOCK_N], 8.0, tl.float32)
    return s, z


@triton.jit
def _row_times_nibbles(x_row, qweight_ptr, scales_ptr, zeros_ptr, rows_n, mask_n, k_start, k_end, group_size,
                       stride_qn, stride_sn, stride_zn, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    # One row of x times BLOCK_N rows of W over K in [k_start, k_end), fp32 (BLOCK_N,): the decode GEMV
    # at M = 1 on the FMA units. The words stay (BLOCK_N, BLOCK_K // 8), K along the fast axis as they
    # lie in memory: no reshape of the weights, no int -> float conversion instructions (`_nibble`).
    # x is loaded once per K tile as (BLOCK_K // 8, 8) and split into the 8 vectors x[8w + j], nibble j
    # of word w. Per K tile, one scale and zero per row: sum (q - z) s x = s (sum q x - z sum x).
    offs_w = tl.arange(0, BLOCK_K // 8)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        words = tl.load(qweight_ptr + rows_n[:, None] * stride_qn + (tl.multiple_of(k0 // 8, BLOCK_K // 8)
                        + offs_w)[None, :], mask=mask_n[:, None], other=0)
        # x[8w + j] for w in the tile, as 8 vectors (one per nibble j): one contiguous load, split in registers
        x = tl.load(x_row + k0 + offs_w[:, None] * 8 + tl.arange(0, 8)[None, :]).to(tl.float32)
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(tl.reshape(x, (BLOCK_K // 8, 2, 2, 2)))
        qx = (_nibble(words, 0) * x0[None, :] + _nibble(words, 1) * x1[None, :] + _nibble(words, 2) * x2[None, :]
              + _nibble(words, 3) * x3[None, :] + _nibble(words, 4) * x4[None, :] + _nibble(words, 5) * x5[None, :]
              + _nibble(words, 6) * x6[None, :] + _nibble(words, 7) * x7[None, :])
        s, z = _group_scale_zero(scales_ptr, zeros_ptr, rows_n, mask_n, k0 // group_size, stride_sn, stride_zn,
                                 HAS_ZEROS, BLOCK_N)
        acc += s * (tl.sum(qx, axis=1) - z * tl.sum(tl.sum(x, axis=1), axis=0))
    return acc


@triton.jit
def _split8(x):
    # x (..., 2, 2, 2), an axis of 8 reshaped: its 8 slices j = 0..7 (the last axis of 2 is j % 2)
    even, odd = tl.split(x)
    x04, x26 = tl.split(even)
    x15, x37 = tl.split(odd)
    x0, x4 = tl.split(x04)
    x2, x6 = tl.split(x26)
    x1, x5 = tl.split(x15)
    x3, x7 = tl.split(x37)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _nibble(words, J: tl.constexpr):
    # nibble J of each int32 word as an exact float: OR'ed into the mantissa of 2^23, minus 2^23
    return (((words >> (4 * J)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


_KERNELS = _splitk.autotune(_w4a16_kernel, M1_CONFIGS, GEMV_CONFIGS, GEMM_CONFIGS,
                            k_multiples=("group_size", "k_per_split"))


def w4a16_linear(
    x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format, bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """linear_ref for an int4_g weight: x (..., K) -> (..., N) in x's dtype. `split_k` overrides the
    GEMV's split heuristic (M <= 16 only)."""
    assert fmt.bits == 4 and fmt.packing == INT4_PACKING, f"w4a16 needs an int4_g weight, got {fmt.kind.value}"
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


def w4a16_logits(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format) -> torch.Tensor:
    """logits_ref for a quantized lm_head through `w4a16_linear`: x (M, K) -> (M, V) float32."""
    return exact_top_logits(w4a16_linear(x, parts, fmt).float(), x, parts, fmt)
