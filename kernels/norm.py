"""RMSNorm and the residual add fused with it: Triton kernels for the references in optc.core.ops.norm.

Numerical policy (the references'): the mean of squares and the rsqrt are fp32. A plain norm
(transformers' LlamaRMSNorm) casts the normalized value to the input dtype before the weight multiplies
it; an offset norm (Gemma's, `offset` != 0) multiplies the fp32 normalized value by offset + w in fp32
and casts once. One program normalizes one row; the whole row sits in registers (hidden sizes up to
16384 fit).

Tests compare it with its op's torch reference (optc.core.ops), on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 16384


@triton.jit
def _rms_norm_kernel(
    # pointers
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    # sizes
    H, eps, offset,
    # strides (rows; the hidden dim is contiguous)
    stride_x, stride_r, stride_o, stride_s,
    # meta
    HAS_RESIDUAL: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # the sum is rounded to x's dtype first, as the unfused add would be
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_OFFSET:  # Gemma: (offset + w) * normed, all fp32
        out = (w + offset) * (xf * rstd)
    else:  # Llama: the normalized value rounded to x's dtype first
        out = w * (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """optc.core.ops.norm.rms_norm_ref(x, weight, eps, offset) for x: (..., H)."""
    out, _ = _launch(x, None, weight, eps, offset)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """optc.core.ops.norm.add_rms_norm_ref: (rms_norm(x + residual), x + residual)."""
    assert residual.shape == x.shape, f"residual {list(residual.shape)} != x {list(x.shape)}"
    assert residual.dtype == x.dtype, f"residual dtype {residual.dtype} != x dtype {x.dtype}"
    return _launch(x, residual, weight, eps, offset)


def _launch(x, residual, weight, eps, offset):
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), f"weight {list(weight.shape)} must be ({hidden},)"
    assert weight.device == x.device, f"weight on {weight.device}, x on {x.device}"
    assert hidden <= MAX_HIDDEN, f"hidden size {hidden} > {MAX_HIDDEN} does not fit one program"
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    # a plain norm's product promotes as `weight * normed` does; an offset norm's is cast to x's dtype
    dtype = x.dtype if offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=dtype, device=x.device)
    summed = torch.empty_like(x2) if residual is not None else out  # `out` is a placeholder
    block_h = triton.next_power_of_2(hidden)
    num_warps = min(max(block_h // 256, 1), 16)
    grid = lambda meta: (x2.shape[0],)
    _rms_norm_kernel[grid](
        x2, r2 if r2 is not None else x2, weight, out, summed,
        hidden, eps, float(offset),
        x2.stride(0), r2.stride(0) if r2 is not None else 0, out.stride(0), summed.stride(0),
        HAS_RESIDUAL=residual is not None, HAS_OFFSET=bool(offset), BLOCK_H=block_h, num_warps=num_warps,
    )
    out = out.view(*x.shape[:-1], hidden)
    return out, (summed.view(x.shape) if residual is not None else None)
