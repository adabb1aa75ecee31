"""Round-to-nearest quantization of one weight into the parts of an `optc.core.formats` format.

Also the shared primitives the other quantizers use, so every method chooses scales and rounds
the same way: `group_params` (scale and zero point of groups of weights, the scale already
rounded to the storage dtype) and `quantize_values` (stored values for given parameters). The
per-kind choices (documented in docs/FORMATS.md) are the format's scheme's (`optc.core.formats`):
its group width along K, integer range, parameters and packing.

Scales are rounded to the storage dtype *before* the integers are computed, so the stored
parts dequantize to exactly the values the quantizer rounded to. This module does not search for
scales or clipping (that is AWQ's and GPTQ's job).
"""

from __future__ import annotations

import torch

from optc.core.errors import InputError
from optc.core.formats import Format, quantized_format


def make_format(bits: int, group_size: int | None = None, zero_point: bool = False,
                dtype: str = "float32") -> Format:
    """The weight-only format for `bits` (8: int8_wo per channel; 4: int4_g with `group_size`)."""
    return quantized_format(bits, dtype, group_size, zero_point)


def check_quantizable(shape: tuple[int, ...], fmt: Format, name: str) -> None:
    """Raise a ValueError naming `name` and the offending dimension when `fmt` cannot hold `shape`."""
    if not fmt.is_quantized:
        raise InputError(f"{name}: format {fmt.kind.value} is not a quantized format")
    fmt.check_shape(tuple(shape), name)


def group_params(w: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each group: w (..., G) -> (scale (...), zero (...)), both fp32.

    The scale is rounded to the storage dtype (then widened back), the zero is an integer.
    """
    return fmt.scheme.group_params(w, fmt)


def quantize_values(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Stored values (as fp32) nearest to w: clamp(round(w / s) + z) for the integer kinds, the e4m3 value
    of w / s for fp8; scale and zero broadcast against w."""
    return fmt.scheme.round_values(w, scale, zero, fmt)


def pack_parts(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               fmt: Format) -> dict[str, torch.Tensor]:
    """Integers q (N, K), scales and zeros (N, K // G), fp32 -> the stored parts of `fmt`."""
    return fmt.scheme.pack(q, scales, zeros, fmt)


def quantize_weight(w: torch.Tensor, fmt: Format, name: str = "weight",
                    clip: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Round-to-nearest: dense w (N, K) -> parts of `fmt` (see optc.core.formats).

    `clip` (N, K // G) optionally bounds |w| per group before the parameters are chosen (AWQ's
    clipping search produces it).
    """
    q, scale, zero = _rtn(w, fmt, name, clip)
    return pack_parts(q.reshape(w.shape), scale, zero, fmt)


def fake_quantize(w: torch.Tensor, fmt: Format, clip: torch.Tensor | None = None) -> torch.Tensor:
    """(N, K) fp32 equal to dequantize(quantize_weight(w, fmt, clip=clip)) without packing."""
    q, scale, zero = _rtn(w, fmt, "weight", clip)
    return ((q - zero[..., None]) * scale[..., None]).reshape(w.shape)


def _rtn(w: torch.Tensor, fmt: Format, name: str, clip: torch.Tensor | None):
    """-> integers (N, K // G, G), scales and zeros (N, K // G), all fp32."""
    check_quantizable(tuple(w.shape), fmt, name)
    n, k = w.shape
    g = fmt.scheme.group_width(fmt, k)
    wg = w.float().reshape(n, k // g, g)
    if clip is not None:
        c = clip.float().reshape(n, k // g, 1)
        wg = torch.maximum(torch.minimum(wg, c), -c)
    scale, zero = group_params(wg, fmt)
    return quantize_values(wg, scale[..., None], zero[..., None], fmt), scale, zero
