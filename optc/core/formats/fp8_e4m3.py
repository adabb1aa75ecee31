"""`fp8_e4m3`: weights as float8_e4m3fn with one scale per output channel, or one for the whole
weight (`per_tensor`); optionally with per-token fp8 activations (`activations: dynamic`, W8A8).

Parts `qweight`: (N, K) float8_e4m3fn and `scales`: (N,) in the format's dtype, (1,) when
`per_tensor`; w = float(qweight) * scales[:, None]. Quantization (`quantize_fp8_weight`): s = max|w| / 448
over the row (or the tensor), rounded to the storage dtype first (as every optc quantizer), then
q = fp8(clamp(w / s, ±448)): the cast rounds to nearest even on 3 mantissa bits, so the error is
relative (at most 2⁻⁴ of |w|) down to the subnormals (2⁻⁹ · s), not a fixed step as in int8.
The scheme's quantizer primitives (`group_params`, `round_values`, `pack`) are that arithmetic split the
way the calibrated quantizers use it: GPTQ rounds one column at a time to the same grid with the same
scales (one group per row, or one for the tensor, from the weight before error feedback).

With `activations: dynamic` the reference linear quantizes x per token to fp8 and multiplies in fp32
(optc/core/formats/activations.py); without, it dequantizes W in x's dtype (W8A16). Per-tensor weights of
sibling linears do not fuse by concatenating rows: each sibling has its own scale.

`min_capability` is 8.9: fp8 tensor cores and hardware fp8 conversion start at Ada / Hopper (Triton
refuses fp8e4nv below sm_89); on an A100 int8 is the 8-bit format to build. The CPU runs every fp8
artifact through the reference (fp8 casts are plain torch there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from optc.core.errors import InputError
from optc.core.formats.activations import FP8_DTYPE, FP8_MAX, to_fp8, w8a8_linear_ref
from optc.core.formats.scheme import Activations, PartShapes, Scheme, check_2d, round_scale

if TYPE_CHECKING:
    from optc.core.formats import Format


class Fp8E4M3(Scheme):
    """float8_e4m3fn weights, per output channel or per tensor; W8A16 or W8A8 with dynamic per-token x."""

    is_quantized = True
    float_roles = ("scales",)
    min_capability = (8, 9)
    supports_per_tensor = True
    activation_modes = (Activations.NONE, Activations.DYNAMIC)

    def check_format(self, fmt: Format) -> None:
        if fmt.bits is not None or fmt.group_size is not None or fmt.zero_point or fmt.packing is not None:
            raise ValueError("fp8_e4m3 takes no bits, group_size, zero_point or packing: its scales are per "
                             "output channel, or per tensor")
        super().check_format(fmt)

    def part_shapes(self, fmt: Format, shape: tuple[int, ...]) -> PartShapes:
        n, k = shape
        return {"qweight": ((n, k), FP8_DTYPE), "scales": ((1,) if fmt.per_tensor else (n,), fmt.torch_dtype)}

    def check_shape(self, fmt: Format, shape: tuple[int, ...], what: str) -> None:
        check_2d(fmt, shape, what)

    def can_concat_rows(self, fmt: Format) -> bool:
        return not fmt.per_tensor

    def dequantize(self, parts: dict[str, torch.Tensor], fmt: Format, out_dtype: torch.dtype) -> torch.Tensor:
        return (parts["qweight"].float() * parts["scales"].float()[:, None]).to(out_dtype)

    def linear(self, x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if fmt.activations is Activations.DYNAMIC:
            return w8a8_linear_ref(x, parts["qweight"], parts["scales"], bias)
        return super().linear(x, parts, fmt, bias)

    def group_width(self, fmt: Format, k: int) -> int:
        return k

    def group_params(self, w: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
        # w (..., K) rows -> scale (...): max|w| / 448 per row, or over all of w (broadcast) per tensor
        w = w.float()
        amax = w.abs().amax().expand(w.shape[:-1]) if fmt.per_tensor else w.abs().amax(-1)
        scale = round_scale(amax / FP8_MAX, fmt)
        return scale, torch.zeros_like(scale)

    def round_values(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: Format) -> torch.Tensor:
        return to_fp8(w.float() / scale).float()  # the e4m3 value as fp32 (exact); fp8 has no zero point

    def pack(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             fmt: Format) -> dict[str, torch.Tensor]:
        scales = scales.reshape(-1)[:1] if fmt.per_tensor else scales.reshape(q.shape[0])
        return {"qweight": q.to(FP8_DTYPE), "scales": scales.to(fmt.torch_dtype)}

    def export_refusal(self, fmt: Format, flavor: str) -> str | None:
        if flavor == "hf":  # compressed-tensors' float-quantized form is not among the ones optc writes
            return ("fp8_e4m3; --format hf writes integer pack-quantized weights (int8, int4): export fp8 with "
                    "--format onnx, or build with quantize_rtn, quantize_awq or quantize_gptq for --format hf")
        if fmt.activations is Activations.NONE:
            return None
        return (f"fp8_e4m3 with dynamic per-token activations (W8A8); ONNX export takes fp8 weight-only: rebuild "
                f"with `quantize_fp8: {{activations: none}}` to export (flavor {flavor})")


def quantize_fp8_weight(w: torch.Tensor, fmt: Format, name: str = "weight") -> dict[str, torch.Tensor]:
    """Dense w (N, K) -> the parts of fp8_e4m3 `fmt` (module docstring for the arithmetic)."""
    if not isinstance(fmt.scheme, Fp8E4M3):
        raise InputError(f"{name}: {fmt.kind.value} is not fp8_e4m3")
    fmt.check_shape(tuple(w.shape), name)
    scheme = fmt.scheme
    scale, zero = scheme.group_params(w, fmt)  # (N,): fp32 holding storage-dtype values
    return scheme.pack(scheme.round_values(w, scale[:, None], zero[:, None], fmt), scale, zero, fmt)
