"""`tl.dot` with the fp32 policy the kernels share (and `dot_or_fma` for tiles of fewer than 16
rows), and the host-side choice of that policy.

fp32 operands keep exact fp32 products (input_precision="ieee", no tf32). Under the Triton
interpreter (TRITON_INTERPRET=1, the CPU) bf16 operands are upcast too, because the interpreter's
tl.dot multiplies bf16 bit patterns (triton-lang/triton#11584); compiled for a GPU, bf16/fp16
operands go to the tensor cores as they are. The choice follows the interpreter, not the tensor's
device, so a compile-only check on the CPU (optc.kernels.compile_only) builds what CUDA runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def dot(a, b, FP32: tl.constexpr):
    if FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def dot_or_fma(a, b, FP32: tl.constexpr, BLOCK_M: tl.constexpr):
    # a tile of fewer than 16 rows (the decode GEMV at M = 1) multiplies on the FMA units and sums
    # the products over K: no padding to the tensor cores' 16 rows, no shared-memory staging
    if BLOCK_M < 16:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return dot(a, b, FP32)


@triton.jit
def to_dtype(v, DTYPE: tl.constexpr, RNE_BF16: tl.constexpr):
    # fp32 v -> DTYPE, rounded to nearest even. The interpreter's fp32 -> bf16 cast truncates (it ignores
    # the rounding mode), which biases every rounding toward zero; RNE_BF16 (`rne_bf16`) rounds the bits by
    # hand first, so the cast is exact. Compiled for a GPU the cast itself rounds to nearest even.
    if RNE_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return v.to(DTYPE)


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (TRITON_INTERPRET=1)."""
    return triton.knobs.runtime.interpret


def fp32_dot(t: torch.Tensor) -> bool:
    """The FP32 constexpr for kernels whose dot operands have `t`'s dtype."""
    return t.dtype == torch.float32 or (t.dtype == torch.bfloat16 and interpreting())


def rne_bf16(t: torch.Tensor) -> bool:
    """The RNE_BF16 constexpr of `to_dtype` for kernels that round to `t`'s dtype."""
    return t.dtype == torch.bfloat16 and interpreting()
