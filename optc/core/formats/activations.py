"""Per-token quantization of activations and the W8A8 reference matmul: what the formats whose
`activations` is `dynamic` (fp8_e4m3, int8_wo) share.

Each row x_t of x (T, K) (a token) gets its own scale s_t = max|x_t| / QMAX, computed at run time
in fp32 and never rounded to the model dtype (vLLM's "dynamic per-token" scales), and is stored as
xq_t = Q(x_t / s_t): clamp to ±448 and cast to float8_e4m3fn for fp8; round half-to-even and clamp
to ±127 for int8 (symmetric, no zero point). The product is

    y = (xq @ qᵀ) · s_x[:, None] · s_w[None, :] (+ bias)

computed in fp32 and cast once to x's dtype: every fp8 × fp8 and int8 × int8 product is exact in
fp32, and this reference sums over K in fp32. The kernels do not all: `torch._int_mm` sums int32 exactly
(equal to the fp32 sum while |Σ| < 2²⁴, beyond that they differ by fp32 rounding), and Hopper's fp8
tensor cores keep only about 14 significant bits of a running sum (kernels/w8a8.py `accumulation_bound`
says how far that puts `torch._scaled_mm` from this sum on the same 8-bit inputs).

Not here: weight quantization (each scheme's) or choosing a kernel (kernels/registry.py).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
INT8_MAX = 127.0
MIN_ACT_SCALE = 1e-12  # a row of zeros gets a usable scale (0 / 0 otherwise)


def to_fp8(t: torch.Tensor) -> torch.Tensor:
    """Values already divided by their scale -> float8_e4m3fn, clamped to ±448 first (a cast of a larger
    value is NaN on some devices, saturating on others), rounded to nearest even by the cast."""
    return t.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K) -> (xq (T, K) float8_e4m3fn, scales (T, 1) fp32), one scale per row."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_ACT_SCALE)
    return to_fp8(x / scale), scale


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K) -> (xq (T, K) int8 in [-127, 127], scales (T, 1) fp32), one scale per row."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / INT8_MAX).clamp(min=MIN_ACT_SCALE)
    return torch.round(x / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


QUANTIZE_ROWS = {FP8_DTYPE: quantize_rows_fp8, torch.int8: quantize_rows_int8}


def w8a8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, weight_scales: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ Wᵀ with x quantized per token to qweight's dtype (fp8 or int8), W = qweight (N, K) ·
    weight_scales (N,) or (1,): -> (..., N) in x's dtype (module docstring for the arithmetic)."""
    k = x.shape[-1]
    xq, sx = QUANTIZE_ROWS[qweight.dtype](x.reshape(-1, k))
    # (T, K) @ (K, N): fp32 products of 8-bit values are exact, summed in fp32; scales applied to the sum
    y = (xq.float() @ qweight.float().T) * sx * weight_scales.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])
