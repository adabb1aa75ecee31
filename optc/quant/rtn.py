"""Round-to-nearest quantization of one weight into the parts of an `optc.formats` format.

Also the shared primitives the other quantizers use, so every method chooses scales and rounds
the same way: `group_params` (scale and zero point of groups of weights, the scale already
rounded to the storage dtype) and `quantize_values` (integers for given parameters).

Parameter choice (documented in docs/FORMATS.md):
- int8_wo: symmetric per output channel, s = max|w| / 127, q in [-127, 127].
- int4_g symmetric: s = 2·max|w| / 15 and z = 8 (as GPTQ), q in [0, 15].
- int4_g zero point: the range [min(w, 0), max(w, 0)] over 15 steps, z = round(-min / s).
Scales are rounded to the storage dtype *before* the integers are computed, so the stored
parts dequantize to exactly the values the quantizer rounded to. This module does not search for
scales or clipping (that is AWQ's and GPTQ's job).
"""

from __future__ import annotations

import torch

from optc.errors import InputError
from optc.formats import INT4_GROUP_SIZES, INT4_PACKING, Format, FormatKind, pack_int4

MIN_SCALE = 1e-5  # as AutoAWQ: a group of zeros still gets a usable, non-zero scale
SUPPORTED_BITS = (4, 8)


def make_format(bits: int, group_size: int | None = None, zero_point: bool = False,
                dtype: str = "float32") -> Format:
    """The weight-only format for `bits` (8: int8_wo per channel; 4: int4_g with `group_size`)."""
    if bits == 8:
        if zero_point:
            raise InputError("int8 weight-only quantization is symmetric: zero_point must be false")
        return Format(kind=FormatKind.INT8_WO, dtype=dtype, bits=8)
    if bits == 4:
        if group_size not in INT4_GROUP_SIZES:
            raise InputError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        return Format(kind=FormatKind.INT4_G, dtype=dtype, bits=4, group_size=group_size,
                      zero_point=zero_point, packing=INT4_PACKING)
    raise InputError(f"unsupported bits {bits}; supported: {SUPPORTED_BITS}")


def check_quantizable(shape: tuple[int, ...], fmt: Format, name: str) -> None:
    """Raise a ValueError naming `name` and the offending dimension when `fmt` cannot hold `shape`."""
    if not fmt.is_quantized:
        raise InputError(f"{name}: format {fmt.kind.value} is not a quantized format")
    fmt.check_shape(tuple(shape), name)


def qrange(fmt: Format) -> tuple[int, int]:
    """Smallest and largest stored integer."""
    return (-127, 127) if fmt.kind is FormatKind.INT8_WO else (0, 15)


def group_params(w: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each group: w (..., G) -> (scale (...), zero (...)), both fp32.

    The scale is rounded to the storage dtype (then widened back), the zero is an integer.
    """
    w = w.float()
    if fmt.kind is FormatKind.INT8_WO:
        scale = w.abs().amax(-1) / 127
        zero = torch.zeros_like(scale)
    elif fmt.zero_point:
        lo = w.amin(-1).clamp(max=0)
        hi = w.amax(-1).clamp(min=0)
        scale = (hi - lo) / 15
    else:
        scale = w.abs().amax(-1) * (2 / 15)
        zero = torch.full_like(scale, 8.0)
    scale = scale.clamp(min=MIN_SCALE).to(fmt.torch_dtype).float()
    if fmt.kind is FormatKind.INT4_G and fmt.zero_point:
        zero = torch.round(-lo / scale).clamp(0, 15)
    return scale, zero


def quantize_values(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Integers (as fp32) clamp(round(w / s) + z); scale and zero broadcast against w."""
    qmin, qmax = qrange(fmt)
    return torch.div(w.float(), scale).round_().add_(zero).clamp_(qmin, qmax)  # one temporary, not four


def pack_parts(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               fmt: Format) -> dict[str, torch.Tensor]:
    """Integers q (N, K), scales and zeros (N,) or (N, K // G), fp32 -> the stored parts of `fmt`."""
    if fmt.kind is FormatKind.INT8_WO:
        return {"qweight": q.to(torch.int8), "scales": scales.to(fmt.torch_dtype)}
    parts = {"qweight": pack_int4(q.to(torch.int64)), "scales": scales.to(fmt.torch_dtype)}
    if fmt.zero_point:
        parts["zeros"] = zeros.to(torch.uint8)
    return parts


def quantize_weight(w: torch.Tensor, fmt: Format, name: str = "weight",
                    clip: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Round-to-nearest: dense w (N, K) -> parts of `fmt` (see optc.formats).

    `clip` (N, K // G) optionally bounds |w| per group before the parameters are chosen (AWQ's
    clipping search produces it).
    """
    q, scale, zero = _rtn(w, fmt, name, clip)
    if fmt.kind is FormatKind.INT8_WO:
        scale, zero = scale[:, 0], zero[:, 0]
    return pack_parts(q.reshape(w.shape), scale, zero, fmt)


def fake_quantize(w: torch.Tensor, fmt: Format, clip: torch.Tensor | None = None) -> torch.Tensor:
    """(N, K) fp32 equal to dequantize(quantize_weight(w, fmt, clip=clip)) without packing."""
    q, scale, zero = _rtn(w, fmt, "weight", clip)
    return ((q - zero[..., None]) * scale[..., None]).reshape(w.shape)


def _rtn(w: torch.Tensor, fmt: Format, name: str, clip: torch.Tensor | None):
    """-> integers (N, K // G, G), scales and zeros (N, K // G), all fp32."""
    check_quantizable(tuple(w.shape), fmt, name)
    n, k = w.shape
    g = k if fmt.kind is FormatKind.INT8_WO else fmt.group_size
    wg = w.float().reshape(n, k // g, g)
    if clip is not None:
        c = clip.float().reshape(n, k // g, 1)
        wg = torch.maximum(torch.minimum(wg, c), -c)
    scale, zero = group_params(wg, fmt)
    return quantize_values(wg, scale[..., None], zero[..., None], fmt), scale, zero
