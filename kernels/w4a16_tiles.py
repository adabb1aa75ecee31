"""W4A16 over int4_g weights packed `n8_tiles` (optc/core/formats/int4_tiles.py): the decode GEMV and
the prefill GEMM of `target: cuda` int4 linears, y = x @ W^T (+ bias), W dequantized in registers.

Every program owns BLOCK_M rows of x and BLOCK_N output columns (whole tiles of 8 weight rows) over all
of K: no split-K, no partial sums, no atomics, one launch writes y. A tile's weights are one contiguous
run of memory: per group, its 8 rows' codes (G/8 words per row, 16-byte aligned) and then one word per
row holding the scale's bits and the zero point, so the codes and their scales come from one stream in
16-byte loads (benchmarks/kernels.py --compile-only counts them).

Two paths, by BLOCK_M (a constexpr of the config):
- BLOCK_M == 1 (M = 1 decode): the FMA units, fp32 throughout. Per K step (BLOCK_K: GROUPS whole groups) the
  words are loaded as (GROUPS, BLOCK_N, G/8) and x once as (GROUPS, G/8, 8), split in registers into the 8
  vectors that meet nibble j of each word. A nibble becomes an exact float through the exponent bits
  (OR'ed into the mantissa of 2^23, minus 2^23: no int -> float conversion instruction), and each
  group's scale and zero apply once per row: sum_k (q - z) s x = s (sum q x - z sum x). Closer to the
  exact product than the reference, which rounds W to x's dtype first.
- BLOCK_M >= 16 (M > 1; prefill): the tensor cores. Per K step the words are loaded as (GROUPS, G/8,
  BLOCK_N), unpacked to (BLOCK_K, BLOCK_N) and dequantized in x's dtype with the 16-bit magic number:
  the nibble OR'ed into the mantissa of 1024.0 (float16, 0x6400) or 128.0 (bfloat16, 0x4300) is
  1024 + q (128 + q) exactly; minus the same for z is q - z exactly; times s rounds once, so the
  weight is the reference's bit for bit. tl.dot then accumulates in fp32.
Bias is added in fp32; one cast on store. The interpreter's bfloat16 arithmetic works on bit patterns
(as its tl.dot, optc.kernels._dot) and its fp32 -> bfloat16 cast truncates, so under TRITON_INTERPRET=1
bfloat16 dequantizes in fp32, its dot runs in fp32 and both roundings go to nearest even by hand
(HALF_DEQUANT False, RNE_BF16 True).

Launchers: `w4a16_decode_linear` (M = 1 configs, then 16-row tiles) and `w4a16_prefill_linear` (the
GEMM tiles); each is correct for every M, and the per-M table (optc.kernels.choose_cuda) says which
runs where. Autotune configs are data; under the interpreter (and with OPTC_AUTOTUNE=0) the first
config runs. Tests compare them with the op's reference
(optc.core.formats.linear_ref) under TRITON_INTERPRET=1 (tests/test_kernels_w4a16_tiles.py).
"""

from __future__ import annotations

import inspect
import os

import torch
import triton
import triton.language as tl

from optc.core.formats import INT4_TILES_PACKING, Format
from optc.kernels import _splitk
from optc.kernels._dot import dot, fp32_dot, interpreting, rne_bf16, to_dtype
from optc.kernels.w4a16 import _nibble, _split8  # a word's nibble as an exact fp32; x split by nibble index


def config(m: int, n: int, k: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)


# BLOCK_K: K values per step, whole groups (every G of 32, 64, 128 divides it), so a step's codes are BLOCK_N x
# BLOCK_K / 2 bytes whatever G is; 16 bytes or more of them per thread is what makes Triton load them 16 bytes
# at a time (fewer per thread compile to narrower loads: benchmarks/kernels.py --compile-only)
# M == 1: one-row FMA tiles, then one 16-row dot tile
M1_CONFIGS = [config(1, n, k, w, 1) for n, k, w in ((16, 512, 4), (8, 1024, 4), (16, 1024, 4), (32, 512, 8),
                                                    (8, 512, 2), (32, 256, 4))] + [config(16, 32, 128, 4, 3)]
# 2 <= M (a decode batch): 16-row dot tiles narrow in N, so N / BLOCK_N programs fill the GPU without a split.
# BLOCK_N 16 loads its codes 8 bytes a thread (1 KB a step): its 16-byte variants spilled at G = 64 or 128
# (2 warps, or BLOCK_K 256 at 4 warps); it stays for the twice as many programs it gives
DECODE_CONFIGS = [config(16, n, 128, 4, s) for n in (32, 16) for s in (3, 4)] + [config(1, 16, 512, 4, 1)]
PREFILL_CONFIGS = [config(m, n, 128, w, s) for m, n, w in ((64, 64, 4), (128, 128, 8), (64, 128, 4), (128, 64, 4))
                   for s in (3, 4)]


@triton.jit(do_not_specialize=["M_BUCKET"])
def _w4a16_tiles_kernel(
    # pointers
    x_ptr, tiles_ptr, bias_ptr, out_ptr,
    # sizes (M_BUCKET: the autotune key's bucket of M, never read)
    M, M_BUCKET, N, K,
    # strides: x and out (row); qtiles (one tile of 8 weight rows: K/G chunks of G + 8 words)
    stride_xm, stride_om, stride_tile,
    # meta
    GROUP: tl.constexpr, SCALE_BF16: tl.constexpr, HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr,
    HALF_DEQUANT: tl.constexpr, RNE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    GROUPS: tl.constexpr = BLOCK_K // GROUP  # groups per K step; a step past K's last group is masked
    W: tl.constexpr = GROUP // 8  # code words per row and group
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    # word offsets in group 0 of row n's codes and of its scale/zero word: multiples of 4 (16 bytes), since
    # G/8, G + 8 and stride_tile = K/G (G + 8) are
    tile = (offs_n // 8).to(tl.int64) * stride_tile
    codes0 = tl.multiple_of(tile + (offs_n % 8) * W, 4)
    meta0 = tl.multiple_of(tile + GROUP + offs_n % 8, 4)
    offs_g, offs_w = tl.arange(0, GROUPS), tl.arange(0, W)
    if BLOCK_M == 1:
        offs_m = pid_m + tl.arange(0, 1)
        acc = _row_fma(x_ptr + pid_m.to(tl.int64) * stride_xm, tiles_ptr, codes0, meta0, mask_n, K, GROUP,
                       SCALE_BF16, BLOCK_N, GROUPS)[None, :]
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        shifts = tl.arange(0, 8) * 4
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            group = k0 // GROUP + offs_g  # (GROUPS,)
            mask_g = group < K // GROUP
            chunk = group * (GROUP + 8)  # within a tile: int32 suffices
            offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                        mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
            # words (GROUPS, G/8, BLOCK_N): a row's G/8 words of a group are contiguous, rows G/8 words apart
            words = tl.load(tiles_ptr + chunk[:, None, None] + offs_w[None, :, None] + codes0[None, None, :],
                            mask=mask_g[:, None, None] & mask_n[None, None, :], other=0)
            meta = tl.load(tiles_ptr + chunk[:, None] + meta0[None, :], mask=mask_g[:, None] & mask_n[None, :],
                           other=0)  # (GROUPS, BLOCK_N)
            q = (words[:, :, None, :] >> shifts[None, None, :, None]) & 0xF  # (GROUPS, G/8, 8, BLOCK_N)
            w = _dequantize(q, meta, x_ptr.dtype.element_ty, SCALE_BF16, HALF_DEQUANT)
            acc += dot(x, tl.reshape(w, (BLOCK_K, BLOCK_N)), FP32_DOT)  # k = G g + 8 w + j
    mask_mn = (offs_m < M)[:, None] & mask_n[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, to_dtype(acc, out_ptr.dtype.element_ty, RNE_BF16), mask=mask_mn)


@triton.jit
def _row_fma(x_row, tiles_ptr, codes0, meta0, mask_n, K, GROUP: tl.constexpr, SCALE_BF16: tl.constexpr,
             BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    # one row of x times BLOCK_N weight rows over all of K, fp32 (BLOCK_N,). Tiles are (GROUPS, BLOCK_N, G/8)
    # with the rows next to the words, so a warp's lanes read a tile's 8 rows of one group: 512 contiguous
    # bytes at G = 128 (rows first, then groups, would stride by a chunk every 64 bytes)
    offs_g = tl.arange(0, GROUPS)
    offs_w = tl.arange(0, GROUP // 8)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, GROUPS * GROUP):
        group = k0 // GROUP + offs_g  # (GROUPS,); the last step's groups past K are masked
        mask_g = group < K // GROUP
        chunk = group * (GROUP + 8)  # within a tile
        words = tl.load(tiles_ptr + chunk[:, None, None] + codes0[None, :, None] + offs_w[None, None, :],
                        mask=mask_g[:, None, None] & mask_n[None, :, None], other=0)  # (GROUPS, BLOCK_N, G/8)
        meta = tl.load(tiles_ptr + chunk[:, None] + meta0[None, :], mask=mask_g[:, None] & mask_n[None, :],
                       other=0)  # (GROUPS, BLOCK_N); 0: scale 0
        # x[k0 + G g + 8 w + j] as (GROUPS, G/8, 8): one contiguous load, split in registers by j
        x = tl.load(x_row + k0 + offs_g[:, None, None] * GROUP + offs_w[None, :, None] * 8
                    + tl.arange(0, 8)[None, None, :], mask=mask_g[:, None, None], other=0.0).to(tl.float32)
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(tl.reshape(x, (GROUPS, GROUP // 8, 2, 2, 2)))
        qx = (_nibble(words, 0) * x0[:, None] + _nibble(words, 1) * x1[:, None] + _nibble(words, 2) * x2[:, None]
              + _nibble(words, 3) * x3[:, None] + _nibble(words, 4) * x4[:, None] + _nibble(words, 5) * x5[:, None]
              + _nibble(words, 6) * x6[:, None] + _nibble(words, 7) * x7[:, None])
        s, z = _scale_zero(meta, SCALE_BF16)
        xs = tl.sum(tl.sum(x, axis=2), axis=1)  # (GROUPS,): sum of x over each group
        acc += tl.sum(s * (tl.sum(qx, axis=2) - z * xs[:, None]), axis=0)
    return acc


@triton.jit
def _scale_zero(meta, SCALE_BF16: tl.constexpr):
    # a scale/zero word -> (scale, zero) in fp32: the scale's 16 bits (bf16: the top half of its fp32)
    if SCALE_BF16:
        s = (meta << 16).to(tl.float32, bitcast=True)
    else:
        s = (meta & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return s, ((meta >> 16) & 0xFF).to(tl.float32)


@triton.jit
def _dequantize(q, meta, DTYPE: tl.constexpr, SCALE_BF16: tl.constexpr, HALF_DEQUANT: tl.constexpr):
    # codes q (GROUPS, G/8, 8, BLOCK_N) int32 and their scale/zero words (GROUPS, BLOCK_N) -> (q - z) s in DTYPE,
    # the scales' 16-bit dtype: (MAGIC | q) - (MAGIC | z) is q - z exactly, one rounding in the product
    if HALF_DEQUANT:
        magic = 0x4300 if SCALE_BF16 else 0x6400
        v = (q | magic).to(tl.int16).to(DTYPE, bitcast=True)
        z = (((meta >> 16) & 0xFF) | magic).to(tl.int16).to(DTYPE, bitcast=True)
        s = (meta & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True)
        return (v - z[:, None, None, :]) * s[:, None, None, :]
    s, z = _scale_zero(meta, SCALE_BF16)
    return to_dtype((q.to(tl.float32) - z[:, None, None, :]) * s[:, None, None, :], DTYPE, True)


def _autotune(configs: list[triton.Config]) -> triton.runtime.Autotuner:
    """An autotuner over `configs` (every one takes any K: a K step past the last group is masked); the first
    runs untimed under the interpreter or with OPTC_AUTOTUNE=0 (as optc.kernels._splitk)."""

    def prune(configs, named_args, **kwargs):
        return configs[:1] if interpreting() or os.environ.get("OPTC_AUTOTUNE", "1") == "0" else configs

    kw = {"prune_configs_by": {"early_config_prune": prune}}
    if "do_bench" in inspect.signature(triton.autotune).parameters:  # Triton >= 3.2
        kw["do_bench"] = _splitk._short_bench
    return triton.autotune(configs, key=["M_BUCKET", "N", "K", "GROUP"], **kw)(_w4a16_tiles_kernel)


_M1, _DECODE, _PREFILL = _autotune(M1_CONFIGS), _autotune(DECODE_CONFIGS), _autotune(PREFILL_CONFIGS)


def w4a16_decode_linear(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_ref for an n8_tiles int4_g weight, decode launch shapes: x (..., K) -> (..., N) in x's dtype."""
    return _launch(x, parts, fmt, bias, prefill=False)


def w4a16_prefill_linear(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_ref for an n8_tiles int4_g weight, GEMM launch shapes: x (..., K) -> (..., N) in x's dtype."""
    return _launch(x, parts, fmt, bias, prefill=True)


def _launch(x, parts, fmt, bias, prefill: bool) -> torch.Tensor:
    assert fmt.bits == 4 and fmt.packing == INT4_TILES_PACKING, f"needs an int4_g weight packed {INT4_TILES_PACKING}"
    tiles = parts["qtiles"]
    num_tiles, groups, chunk = tiles.shape
    group = fmt.group_size
    n, k = num_tiles * 8, groups * group
    assert chunk == group + 8 and tiles.dtype == torch.int32 and tiles.is_contiguous(), "qtiles must be n8_tiles"
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, the weight {k}"
    assert x.dtype == fmt.torch_dtype, f"x is {x.dtype}, the weight's scales {fmt.dtype}: the kernel dequantizes in x's"
    assert bias is None or bias.shape == (n,), f"bias {None if bias is None else list(bias.shape)} != ({n},)"
    x2, out = _splitk.rows_and_output(x, n)
    if x2 is None:
        return out
    m = x2.shape[0]
    kernel = _PREFILL if prefill else _M1 if m == 1 else _DECODE
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))
    kernel[grid](
        x_ptr=x2, tiles_ptr=tiles, bias_ptr=bias if bias is not None else x2, out_ptr=out,  # x2: never read
        M=m, M_BUCKET=_splitk.m_bucket(m), N=n, K=k, stride_xm=x2.stride(0), stride_om=out.stride(0),
        stride_tile=groups * chunk, GROUP=group, SCALE_BF16=x.dtype == torch.bfloat16, HAS_BIAS=bias is not None,
        FP32_DOT=fp32_dot(x), HALF_DEQUANT=not rne_bf16(x), RNE_BF16=rne_bf16(x),
    )
    return out.view(*x.shape[:-1], n)
