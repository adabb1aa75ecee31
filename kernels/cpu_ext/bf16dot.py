"""Launchers for bf16dot.cpp (kernels/cpu_ext): dense bfloat16 linears and lm_heads for decode and speculative
verification steps.

A row's sums are the same sequence of float32 operations whatever the call's row count (vdpbf16ps's lanes, then
a fixed tree), so a decode step's row and the same row in a k + 1 row verification agree bit for bit, and one pass
over the weight serves every row: capped to AVX2, where torch runs a product row by row, a verification's
extra rows cost a fraction of a step instead of a step each. From a few dozen rows on torch's GEMM is faster,
but the kernel choice keeps bf16dot up to ROWS
(kernels/choose.py, `rows_independent`) so that every speculative step's rows sum as decode rows do; calls of
more rows (long prefills) run torch's GEMM. Where the extension cannot be built, the op references run.

Numerics: bfloat16 products are exact in float32; the sums run in float32 in another order than torch's, so an
output moves within float32 rounding of the exact sum (tests/test_kernels_bf16dot.py) before the linear's
rounding to bfloat16. The `_logits` launcher keeps the float32 sums and recomputes each row's best logits exactly
(optc.core.ops.linear.exact_top_logits), as every lm_head kernel does.
"""

from __future__ import annotations

import torch

from optc.core.formats import Format, linear_ref
from optc.core.ops.linear import exact_top_logits, logits_ref
from optc.kernels import cpu_ext
from optc.kernels.choose import SPECULATIVE_ROWS
from optc.kernels.cpu_ext.ops import top_k

ROWS = SPECULATIVE_ROWS  # the most rows a call sums here (the rows the kernel choice keeps it for); more: torch


def bf16dot_linear(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_ref for a dense bfloat16 weight: x (..., K) bfloat16 -> (..., N) bfloat16."""
    w = parts["weight"]
    return dense_linear(x, w, bias) if _takes(x, w) else linear_ref(x, parts, fmt, bias)


def bf16dot_logits(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format) -> torch.Tensor:
    """logits_ref for a dense bfloat16 lm_head: x (M, K) -> (M, V) float32."""
    w = parts["weight"]
    if not _takes(x, w):
        return logits_ref(x, parts, fmt)
    return exact_top_logits(cpu_ext.load().bf16dot(x, w, cpu_ext.bf16_isa()), x, parts, fmt, top_k)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's signature on bf16dot where it takes the operands (CPU tensors, bfloat16 x and weight, K a multiple
    of 32, at most ROWS rows), else F.linear: the EAGLE head's projections while decoding."""
    if not _takes(x, weight):
        return torch.nn.functional.linear(x, weight, bias)
    k = x.shape[-1]
    y = cpu_ext.load().bf16dot(x.reshape(-1, k), weight, cpu_ext.bf16_isa()).to(x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    k = x.shape[-1]
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and k % 32 == 0
            and x.numel() <= ROWS * k and cpu_ext.bf16_isa() is not None)
