"""int8_wo linear on the CPU through torch's int8 weight-only matmul (`aten._weight_int8pack_mm`).

The kernel reads the format's own parts: `qweight` (N, K) int8 row-major and `scales` (N,) in the
activation dtype, and computes y = x @ (q * s)^T with the scale applied once per output (the reference
dequantizes the whole weight on every call). It needs no layout of its own, but it needs its operands'
memory aligned: `prepare_int8pack` copies a `qweight` whose data does not start on a 64-byte boundary
(a tensor memory-mapped from a safetensors file usually does not), and the launcher copies such an x.

Its limits, found by running it (torch 2.13, `tests/test_kernels_int8_cpu.py` checks them): K must be
a multiple of 16 (bfloat16 with K = 104 gives wrong rows, with K = 100 it crashes the process), so
the registry offers it only for such K; with M >= 8 rows, an x or a qweight that is not 64-byte
aligned crashes the process (a safetensors offset did, on SmolLM2's int8 lm_head); x is 2-D, so
leading dimensions are flattened here.
Where it pays is measured per M by `select_kernels` (docs/PERF.md, "Quantized artifacts that run
faster"): at decode sizes it reads 1 byte per weight instead of dequantizing 2-4. An int8 lm_head at
several rows has a second kernel here, `int_mm_logits` (x rounded to int8, `torch._int_mm`).
"""

from __future__ import annotations

import torch

from optc.core.formats import Format
from optc.core.formats.activations import quantize_rows_int8
from optc.core.ops import Param
from optc.core.ops.linear import exact_top_logits
from optc.kernels.cpu_ext.ops import top_k

K_MULTIPLE = 16  # the kernel's K tiling: other K give wrong results or crash
ALIGNMENT = 64  # bytes: where the kernel's operands must start


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous, starting on an ALIGNMENT-byte boundary (a copy when it does not; torch's CPU
    allocator aligns new storage to 64 bytes)."""
    t = t.contiguous()
    return t if t.data_ptr() % ALIGNMENT == 0 else t.clone()


def prepare_int8pack(params: dict[str, Param]) -> dict[str, Param]:
    """A node's params -> the same with the weight's `qweight` aligned for the kernel."""
    w = params["weight"]
    return {**params, "weight": Param({**w.parts, "qweight": aligned(w.parts["qweight"])}, w.format)}


def int8pack_linear(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_ref for an int8_wo weight: x (..., K) -> (..., N) in x's dtype."""
    q, s = parts["qweight"], parts["scales"]
    n, k = q.shape
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, the weight {k}"
    assert k % K_MULTIPLE == 0, f"K = {k} is not a multiple of {K_MULTIPLE}"
    assert q.data_ptr() % ALIGNMENT == 0, "qweight is not aligned: bind the kernel through prepare_int8pack"
    y = torch.ops.aten._weight_int8pack_mm(aligned(x.reshape(-1, k)), q, s.to(x.dtype))
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], n)


def int8pack_logits(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format) -> torch.Tensor:
    """logits_ref for an int8_wo lm_head: x (M, K) -> (M, V) float32."""
    return exact_top_logits(int8pack_linear(x, parts, fmt).float(), x, parts, fmt, top_k)


def int_mm_logits(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format) -> torch.Tensor:
    """logits_ref for an int8_wo lm_head with 16-bit x, at several rows: x rounded to int8 per row and
    multiplied with the int8 weight in int32 (`torch._int_mm`), scaled back; then each row's best logits
    recomputed in fp32 from x itself (`exact_top_logits`), as every lm_head kernel does. Rounding x moves
    only the logits outside each row's best, but those count in a sampled distribution: off by default
    (`select_kernels: {enable: [cpu.int_mm_logits]}`), then measured per M against int8pack."""
    q, s = parts["qweight"], parts["scales"]
    assert x.dtype != torch.float32, "float32 x keeps every logit as computed: this kernel is for 16-bit x"
    xq, sx = quantize_rows_int8(x)  # (M, K) int8, (M, 1) fp32
    logits = torch._int_mm(xq, q.t()).float() * sx * s.float()
    return exact_top_logits(logits, x, parts, fmt, top_k)
