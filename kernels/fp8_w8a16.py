"""fp8 W8A16: y = x @ W^T (+ bias) with W stored fp8_e4m3 weight-only (float8_e4m3fn (N, K), a scale
per output channel or per tensor; see optc.core.formats), dequantized in registers.

w8a16's kernel (kernels/w8a16.py) run on an fp8 weight tile: the same launch shapes (a split-K GEMV for M <= 16, a tiled
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

from optc.core.formats import Activations, Format
from optc.core.ops import Param
from optc.kernels import _splitk
from optc.kernels.w8a16 import _KERNELS, SPLIT_ALIGN, _split_k


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

