"""W8A8 linears through torch's 8-bit matmuls: `torch._scaled_mm` (cuBLASLt fp8) for fp8_e4m3 with
dynamic activations, `torch._int_mm` (int8 × int8 -> int32) for int8_wo with dynamic activations.

Both launchers quantize x per token with the reference's own functions (optc/core/formats/activations.py),
so the 8-bit inputs are bit-identical to the reference's; only the matmul differs. `_int_mm` sums exactly
in int32. `_scaled_mm` on Hopper does not sum in fp32: its fp8 tensor-core instructions (wgmma, MMA_K = 32
products each) keep about 14 significant bits of the running sum (the DeepSeek-V3 report, §3.3.2: "limited
to retaining around 14 bits", a relative error near 2% at K = 4096 when nothing is promoted). We call it with
torch's default `use_fast_accum=False`: cuBLASLt's FAST_ACCUM off, the mode in which (by its documentation of
CUBLASLT_MATMUL_DESC_FAST_ACCUM) intermediate results are periodically promoted to a higher precision; how
often is not documented, so `accumulation_bound` assumes never: one truncation to ACCUMULATOR_BITS per
instruction. Fast accumulation stays off: it trades exactly this precision for speed.
On the CPU torch's `_scaled_mm` sums in fp32.
`prepare_w8a8` runs once per node: the weight as the (K, N) column-major operand both matmuls want
(qweight (N, K) row-major, transposed: a view, no copy) and the weight scales as a (1, N) fp32 row.

`scaled_mm_linear`: with bfloat16 activations, row-wise scaling (scale_a (M, 1) per token, scale_b
(1, N) per channel, bf16 output: the cuBLASLt / CUTLASS path on sm_90, scales applied in the
epilogue); otherwise unit tensor-wise scales with an fp32 output and the scales applied after, in
fp32, as the reference does (row-wise scaling takes only a bf16 output). `int_mm_linear`: the int32
product, then both scales in fp32. On CUDA `_int_mm` takes more than 16 rows, so decode-sized x is
padded with zero rows (`pad_rows`).

The registry binds them for `target: cuda` only: `_scaled_mm` from sm_89, `_int_mm` from the runtime's
floor. Tests compare them with the reference on the CPU, where torch runs both matmuls; on a GPU, on
identical 8-bit inputs within `accumulation_bound` (tests/test_fp8_accumulation.py).
"""

from __future__ import annotations

import torch

from optc.core.formats import Activations, Format
from optc.core.formats.activations import quantize_rows_fp8, quantize_rows_int8
from optc.core.ops import Param

INT_MM_MIN_ROWS = 17  # CUDA `_int_mm` needs M > 16
MMA_K = 32  # fp8 products one Hopper wgmma instruction adds to the accumulator (its K for 8-bit inputs)
ACCUMULATOR_BITS = 14  # significant bits the fp8 tensor cores keep of a running sum (DeepSeek-V3, §3.3.2)
FP32_BITS = 24
OUT_BITS = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}  # significand bits of the output dtype


def prepare_w8a8(params: dict[str, Param]) -> dict[str, Param]:
    """A linear node's params -> the weight as {"qweight_t": (K, N) column-major, "scales": (1, N) fp32}."""
    w = params["weight"]
    qweight, scales = w.parts["qweight"], w.parts["scales"]
    n = qweight.shape[0]
    row = scales.float().reshape(1, -1).expand(1, n).contiguous()  # per-tensor (1,) widened to (1, N)
    return {**params, "weight": Param({"qweight_t": qweight.contiguous().t(), "scales": row}, w.format)}


def scaled_mm_linear(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_ref for an fp8_e4m3 weight with dynamic activations, prepared by `prepare_w8a8`."""
    w, sw = _check(x, parts, fmt, torch.float8_e4m3fn)
    k, n = w.shape
    xq, sx = quantize_rows_fp8(x.reshape(-1, k))  # (M, K) fp8, (M, 1) fp32
    if x.dtype == torch.bfloat16:  # row-wise scales in the epilogue, bf16 out
        y = torch._scaled_mm(xq, w, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)
        y = y if bias is None else y + bias.to(y.dtype)
    else:
        one = torch.ones((), dtype=torch.float32, device=x.device)
        y = torch._scaled_mm(xq, w, scale_a=one, scale_b=one, out_dtype=torch.float32) * sx * sw
        y = (y if bias is None else y + bias.float()).to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


def int_mm_linear(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_ref for an int8_wo weight with dynamic activations, prepared by `prepare_w8a8`."""
    w, sw = _check(x, parts, fmt, torch.int8)
    k, n = w.shape
    xq, sx = quantize_rows_int8(x.reshape(-1, k))  # (M, K) int8, (M, 1) fp32
    m = xq.shape[0]
    acc = torch._int_mm(pad_rows(xq, INT_MM_MIN_ROWS if x.is_cuda else 1), w)[:m]  # (M, N) int32, exact
    y = acc.float() * sx * sw
    y = (y if bias is None else y + bias.float()).to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


def accumulation_bound(xq: torch.Tensor, sx: torch.Tensor, qweight_t: torch.Tensor, sw: torch.Tensor,
                       y: torch.Tensor) -> torch.Tensor:
    """How far `scaled_mm_linear`'s output may lie from the exact product on the same 8-bit inputs, per
    element: xq (M, K) fp8 and sx (M, 1), qweight_t (K, N) fp8 and sw (1, N), y (M, N) the output (its dtype
    is the output's) -> (M, N) fp32.

    Derivation. Every product p_k = xq_mk · q_kn of two e4m3 values is exact (4 + 4 significant bits). The
    tensor cores add the K products MMA_K at a time; after each instruction the sum keeps ACCUMULATOR_BITS
    significant bits, cut below: an error under one unit in its last place, 2^-(B-1) · |partial| ≤
    2^-(B-1) · Σ_k |p_k| (no partial sum exceeds the sum of magnitudes). ceil(K / MMA_K) instructions:

        |acc - Σ p| ≤ ceil(K / MMA_K) · 2^-(B-1) · Σ_k |p_k|,   B = ACCUMULATOR_BITS

    (at K = 4096: 1.6% of Σ|p|, DeepSeek-V3's "nearly 2%"). Periodic promotion to fp32 only lowers it. The
    reference sums in fp32 (error ≤ K · 2^-24 · Σ|p|, added so one bound serves the comparison with
    either). Scaling by sx · sw is exact up to two fp32 roundings, and each output is rounded to its dtype
    once by the kernel and once by the reference, plus once more where a bias is added in bf16: 3 · 2^-b
    · |y| with b the dtype's significand bits."""
    k = xq.shape[1]
    magnitude = (xq.float().abs() @ qweight_t.float().abs()) * sx * sw  # Σ|p| in y's units
    acc = -(-k // MMA_K) * 2.0 ** -(ACCUMULATOR_BITS - 1) + k * 2.0 ** -(FP32_BITS - 1)
    return acc * magnitude + 3 * 2.0 ** -OUT_BITS[y.dtype] * y.float().abs() + 4 * 2.0 ** -FP32_BITS * magnitude


def pad_rows(t: torch.Tensor, min_rows: int) -> torch.Tensor:
    """t (M, K) with zero rows appended up to `min_rows` (t itself when it has enough)."""
    m = t.shape[0]
    if m >= min_rows:
        return t
    return torch.cat([t, t.new_zeros((min_rows - m, t.shape[1]))])


def _check(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The prepared (K, N) weight and (1, N) scales, after checking what the matmul needs."""
    assert fmt.activations is Activations.DYNAMIC, f"W8A8 needs dynamic activations, got {fmt.label}"
    assert "qweight_t" in parts, "W8A8 weights go through prepare_w8a8 first"
    w, sw = parts["qweight_t"], parts["scales"]
    k, n = w.shape
    assert w.dtype == dtype and w.stride(0) == 1, f"qweight_t must be {dtype}, column-major (K, N)"
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, the weight {k}"
    assert sw.shape == (1, n) and sw.dtype == torch.float32, f"scales {list(sw.shape)} {sw.dtype} != (1, {n}) fp32"
    return w, sw
