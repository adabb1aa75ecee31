"""`int8_wo`: symmetric int8 weights with one scale per output channel.

Parts `qweight`: (N, K) int8 and `scales`: (N,) in the format's dtype; w = qweight * scales[:, None].
Round-to-nearest parameters: s = max|w| / 127 per row, q in [-127, 127], no zero point.
With `activations: dynamic` (int8 W8A8, SmoothQuant's setting) the same parts serve a linear that also
quantizes x per token to int8 and multiplies in fp32 (optc/core/formats/activations.py); the kind's name
predates that mode, which stores nothing more. ONNX export takes the weight-only mode only.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch

from optc.core.errors import InputError
from optc.core.formats.activations import w8a8_linear_ref
from optc.core.formats.scheme import Activations, PartShapes, Scheme, check_2d, round_scale

if TYPE_CHECKING:
    from optc.core.formats import Format


class Int8Wo(Scheme):
    """int8 weight-only, per output channel."""

    is_quantized = True
    bits = 8
    float_roles = ("scales",)
    activation_modes = (Activations.NONE, Activations.DYNAMIC)

    def check_format(self, fmt: Format) -> None:
        if fmt.bits != 8:
            raise ValueError("int8_wo needs bits=8")
        super().check_format(fmt)

    def part_shapes(self, fmt: Format, shape: tuple[int, ...]) -> PartShapes:
        n, k = shape
        return {"qweight": ((n, k), torch.int8), "scales": ((n,), fmt.torch_dtype)}

    def check_shape(self, fmt: Format, shape: tuple[int, ...], what: str) -> None:
        check_2d(fmt, shape, what)

    def dequantize(self, parts: dict[str, torch.Tensor], fmt: Format, out_dtype: torch.dtype) -> torch.Tensor:
        return (parts["qweight"].float() * parts["scales"].float()[:, None]).to(out_dtype)

    def linear(self, x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if fmt.activations is Activations.DYNAMIC:
            return w8a8_linear_ref(x, parts["qweight"], parts["scales"], bias)
        return super().linear(x, parts, fmt, bias)

    def format_fields(self, group_size: int | None, zero_point: bool, act_order: bool = False) -> dict:
        if zero_point:
            raise InputError("int8 weight-only quantization is symmetric: zero_point must be false")
        return {"bits": 8}

    def group_width(self, fmt: Format, k: int) -> int:
        return k

    def qrange(self, fmt: Format) -> tuple[int, int]:
        return -127, 127

    def group_params(self, w: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
        scale = w.float().abs().amax(-1) / 127
        return round_scale(scale, fmt), torch.zeros_like(scale)

    def pack(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             fmt: Format) -> dict[str, torch.Tensor]:
        return {"qweight": q.to(torch.int8), "scales": scales.reshape(q.shape[0]).to(fmt.torch_dtype)}

    def export_refusal(self, fmt: Format, flavor: str) -> str | None:
        if fmt.activations is Activations.NONE:
            return None
        return (f"int8_wo with dynamic per-token activations (W8A8); ONNX export takes int8 weight-only: rebuild "
                f"with `quantize_rtn: {{bits: 8}}` to export (flavor {flavor})")

    def compressed_tensors_args(self, fmt: Format) -> dict | None:
        return {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "channel",
                "dynamic": False}

    def to_compressed_tensors(self, parts: dict[str, torch.Tensor], fmt: Format,
                              shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        # pack-quantized 8-bit: byte k mod 4 of word k / 4 (little-endian) holds q + 128; rows padded with 0
        n, k = shape
        assert sys.byteorder == "little", "int32 words are written as little-endian bytes"
        biased = (parts["qweight"].to(torch.int16) + 128).to(torch.uint8)
        pad = -k % 4
        if pad:
            biased = torch.cat([biased, biased.new_zeros(n, pad)], 1)
        return {"weight_packed": biased.contiguous().view(torch.int32), "weight_scale": parts["scales"].reshape(n, 1),
                "weight_shape": torch.tensor([n, k])}

    def from_compressed_tensors(self, tensors: dict[str, torch.Tensor], fmt: Format,
                                shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        n, k = shape
        biased = tensors["weight_packed"].contiguous().view(torch.uint8)[:, :k]
        return {"qweight": (biased.to(torch.int16) - 128).to(torch.int8), "scales": tensors["weight_scale"].reshape(n)}
