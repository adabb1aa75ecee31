"""Launchers for qdot.cpp (kernels/cpu_ext): int4_gf, int8_gf, int4_g and int8_wo linears and lm_heads with the
activations rounded to integers per block of 32 and integer dot products (llama.cpp's scheme, at int16's precision
where it takes int8: int8 activations cost SmolLM2's kept build +0.015 KL, docs/PERF.md). int8 codes meet int16
activations; int4 codes meet an int8 pair per element (xq = 128 q + r: int8 instructions, 2^-15 of the block's
largest |x|).

`prepare_qdot` leaves the codes where the artifact has them (int4 packed k8_lsb, int8 row-major: qdot.cpp reads
both as stored) and adds what the kernel reads beside them in float32: `qdot_scales` (N, K / G) (int8_wo's
per-channel scale as one group of K) and, for int4_g with zero points, `qdot_soff` = scale * zero point; the
GGUF kinds' `mins` are float32 already. A format's constant code offset (8 for symmetric int4, 0 for int8) is
an argument. Where the extension cannot be built
(kernels/cpu_ext `load`), `prepare_qdot` returns torch's packed kernel's layout instead and the launcher runs
that kernel: int4pack for the int4 kinds, int8pack for int8_wo, int8gf_int4x2 (or the widened weight) for
int8_gf; the table offers qdot only where that fallback takes the shape too.

Numerics: the reference multiplies x by the weight dequantized to x's dtype; here each block of 32 inputs is
x ~ dx * xq with |x - dx * xq| <= dx / 2 elementwise, dx = max|x| / 32767 over the block for int8 codes and
max|x| / (127 * 128) for int4 codes, so an output moves by at most sum over blocks of |s| * dx / 2 * sum |code -
offset| (and |min| terms use x's exact float sum); the integer products are exact, the rest is fp32.
tests/test_kernels_cpu_ext.py holds that bound, and the kernel to a float64 sum over the same integers. The
`_logits` launcher then recomputes each row's best logits in fp32 from the stored parts
(optc.core.ops.linear.exact_top_logits), as every lm_head kernel does.
"""

from __future__ import annotations

import torch

from optc.core.formats import Format, FormatKind
from optc.core.ops import Param
from optc.core.ops.linear import exact_top_logits
from optc.kernels import cpu_ext, gf_cpu, int4_cpu, int8_cpu
from optc.kernels.cpu_ext.ops import top_k

BITS = {FormatKind.INT4_GF: 4, FormatKind.INT4_G: 4, FormatKind.INT8_GF: 8, FormatKind.INT8_WO: 8}
PREPARED = "qdot_scales"  # the part that says the weight is prepared for qdot (not for a fallback)


def prepare_qdot(params: dict[str, Param]) -> dict[str, Param]:
    """A node's params -> the weight's own parts plus qdot's `qdot_scales`; torch's kernel's layout (plus the
    stored parts) where the extension is unavailable."""
    w = params["weight"]
    fmt, parts = w.format, w.parts
    if cpu_ext.isa() is None:
        fallback = _fallback(fmt)[0](params)["weight"].parts
        return {**params, "weight": Param({**parts, **fallback}, fmt)}
    scales = parts["scales"].float()
    if fmt.kind is FormatKind.INT8_WO:
        scales = scales.reshape(-1, 1)  # one group of K inputs
    prepared = {PREPARED: scales.contiguous()}
    if "zeros" in parts:
        prepared["qdot_soff"] = (scales * parts["zeros"].float()).contiguous()
    return {**params, "weight": Param({**parts, **prepared}, fmt)}


def qdot_linear(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_ref for a weight prepared by `prepare_qdot`: x (..., K) -> (..., N) in x's dtype."""
    if PREPARED not in parts:
        return _fallback(fmt)[1](x, parts, fmt, bias)
    q = parts["qweight"]
    k = x.shape[-1]
    y = qlinear(x.reshape(-1, k), parts, fmt, cpu_ext.isa())
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], q.shape[0])


def qdot_logits(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format) -> torch.Tensor:
    """logits_ref for an lm_head prepared by `prepare_qdot`: x (M, K) -> (M, V) float32."""
    stored = {r: parts[r] for r in fmt.part_shapes(_shape(parts, fmt))}
    return exact_top_logits(qdot_linear(x, parts, fmt).float(), x, stored, fmt, top_k)


def qlinear(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format, isa: int) -> torch.Tensor:
    """x (M, K) through qdot.cpp on the ISA path `isa` (cpu_ext.AVX2 or AVX512_VNNI): -> (M, N) in x's dtype."""
    k = x.shape[-1]
    q = parts["qweight"]
    scales = parts[PREPARED]
    group = k // scales.shape[1]
    empty = torch.empty(0)
    mins = parts["mins"] if fmt.zero_point and "mins" in parts else empty
    soff = parts.get("qdot_soff", empty)
    offset = 8.0 if BITS[fmt.kind] == 4 and not fmt.zero_point else 0.0
    return cpu_ext.load().qlinear(x, q, BITS[fmt.kind], group, scales, mins, soff, offset, isa)


def _shape(parts: dict[str, torch.Tensor], fmt: Format) -> tuple[int, int]:
    q = parts["qweight"]
    return q.shape[0], q.shape[1] * (8 if BITS[fmt.kind] == 4 else 1)


def _fallback(fmt: Format):
    """(prepare, launcher) of torch's kernel for the format."""
    if fmt.kind in (FormatKind.INT4_G, FormatKind.INT4_GF):
        return int4_cpu.prepare_int4pack, int4_cpu.int4pack_linear
    if fmt.kind is FormatKind.INT8_WO:
        return int8_cpu.prepare_int8pack, int8_cpu.int8pack_linear
    return gf_cpu.prepare_int8gf_int4x2, gf_cpu.int8gf_int4x2_linear
