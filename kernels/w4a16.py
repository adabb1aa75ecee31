"""W4A16 matmul: y = x @ W^T (+ bias) with W stored int4_g (see optc.formats), dequantized in
registers.

One kernel, two launch shapes chosen by M: a split-K GEMV for M <= 16 (decode; tiles of 16 rows, K
split across programs so a small N still fills the GPU; fp32 partials summed by the launcher) and a
tiled GEMM for larger M (prefill). Per K tile the packed words of W (N, K // 8) int32 are gathered
once per nibble, unpacked `(word >> 4 * (k % 8)) & 0xF`, dequantized as (q - z) * s in fp32 with
the tile's group scale and zero point, rounded to x's dtype (the reference dequantizes to x's dtype
before its matmul), and fed to tl.dot with an fp32 accumulator; bias is added in fp32; one cast on
store. BLOCK_K divides the group size, so one scale (and zero) per output column serves a K tile.

Autotune configs are data (GEMV_CONFIGS, GEMM_CONFIGS), pruned by `_prune`; on the CPU (the Triton
interpreter, which cannot time kernels) the first surviving config runs. Correctness is checked
under TRITON_INTERPRET=1 on the CPU; it has not been run on a CUDA device in the session that wrote
it, and the configs and split heuristic are untuned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optc.formats import Format, FormatKind, linear_ref

GEMV_MAX_M = 16
TARGET_PROGRAMS = 264  # about two waves on an H100's 132 SMs
_cfg = lambda m, n, k, warps, stages: triton.Config(
    {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
GEMV_CONFIGS = [_cfg(16, n, k, 4, s) for n in (64, 32, 128) for k in (128, 64, 32) for s in (2, 4)]
GEMM_CONFIGS = [_cfg(m, n, k, w, s) for m, n, w in ((64, 64, 4), (128, 128, 8), (64, 128, 4), (128, 64, 4))
                for k in (64, 32, 128) for s in (3, 4)]


def _prune(configs, named_args, **kwargs):
    group, k_per_split = named_args["group_size"], named_args["k_per_split"]
    ok = [c for c in configs if group % c.kwargs["BLOCK_K"] == 0 and k_per_split % c.kwargs["BLOCK_K"] == 0]
    return ok if named_args["x_ptr"].is_cuda else ok[:1]


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    if FP32:  # exact fp32 products (no tf32); see _fp32_dot
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _w4a16_kernel(
    # pointers
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
    # sizes
    M, N, K, group_size, k_per_split,
    # strides: x, out (row); qweight, scales, zeros (row n); partials (split)
    stride_xm, stride_om, stride_os, stride_qn, stride_sn, stride_zn,
    # meta
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    rows_n = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # w tile (BLOCK_K, BLOCK_N): nibble k % 8 of word k // 8 of row n
        mask_kn = mask_k[:, None] & mask_n[None, :]
        words = tl.load(qweight_ptr + rows_n[None, :] * stride_qn + (offs_k // 8)[:, None], mask=mask_kn, other=0)
        q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        group = k0 // group_size  # BLOCK_K divides the group size: one group per K tile
        s = tl.load(scales_ptr + rows_n * stride_sn + group, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + rows_n * stride_zn + group, mask=mask_n, other=0).to(tl.float32)
        else:
            z = tl.full([BLOCK_N], 8.0, tl.float32)
        w = ((q.to(tl.float32) - z[None, :]) * s[None, :]).to(x_ptr.dtype.element_ty)
        acc += _dot(x, w, FP32_DOT)

    mask_mn = mask_m[:, None] & mask_n[None, :]
    if IS_SPLIT:  # fp32 partial sums; the launcher reduces them
        out = out_ptr + split * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc, mask=mask_mn)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_mn)


_gemv = triton.autotune(GEMV_CONFIGS, key=["N", "K", "k_per_split"], prune_configs_by={"early_config_prune": _prune})(
    _w4a16_kernel)
_gemm = triton.autotune(GEMM_CONFIGS, key=["N", "K"], prune_configs_by={"early_config_prune": _prune})(
    _w4a16_kernel)


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
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    is_gemv = m <= GEMV_MAX_M
    if split_k is None:
        split_k = _split_k(n, k, group) if is_gemv else 1
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), group) * group  # whole groups per split
    split_k = triton.cdiv(k, k_per_split)
    dest = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    kernel = _gemv if is_gemv else _gemm
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), split_k)
    kernel[grid](
        x2, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, dest,
        m, n, k, group, k_per_split,
        x2.stride(0), dest.stride(-2), dest.stride(0) if split_k > 1 else 0, qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0,
        HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, IS_SPLIT=split_k > 1, FP32_DOT=_fp32_dot(x),
    )
    if split_k > 1:
        y = dest.sum(0)
        out.copy_(y if bias is None else y + bias.float())
    return out.view(*x.shape[:-1], n)


def w4a16_linear_ref(x, parts, fmt, bias=None) -> torch.Tensor:
    """The specification: optc.formats.linear_ref."""
    return linear_ref(x, parts, fmt, bias)


def _split_k(n: int, k: int, group: int) -> int:
    # enough (N tile, split) programs to fill the GPU, at least 4 groups of K per split
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, triton.cdiv(n, 64)), k // (4 * group)))


def _fp32_dot(x: torch.Tensor) -> bool:
    # fp32 inputs keep fp32 products; on the CPU (the Triton interpreter) bf16 operands are upcast
    # too, because the interpreter's tl.dot multiplies bf16 bit patterns (triton-lang/triton#11584)
    return x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and not x.is_cuda)
