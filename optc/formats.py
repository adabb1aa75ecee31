"""Tensor formats: how a logical weight is stored, as data on the tensor (never guessed from names).

A logical weight of shape (N, K) (out features, in features) is stored as one or more parts:

- `dense`    part `weight`: (N, K) in `dtype`.
- `int8_wo`  parts `qweight`: (N, K) int8, `scales`: (N,) in `dtype`; w = qweight * scales[:, None]
             (symmetric, per output channel).
- `int4_g`   parts `qweight`: (N, K // 8) int32, `scales`: (N, K // G) in `dtype`, and when
             `zero_point` is set `zeros`: (N, K // G) uint8 holding integer zero points in [0, 15];
             w[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G], with z = 8 when symmetric.
             Packing `k8_lsb`: the 8 values k = 8j .. 8j + 7 of row n live in qweight[n, j], value
             k at bits 4 * (k % 8) .. 4 * (k % 8) + 3 (the lowest nibble is the lowest k). Rows stay
             contiguous along K, which is what the w4a16 GEMV streams.
             With `act_order` (only for imported GPTQ desc_act checkpoints) a part `perm`: (K,)
             int32 says stored column j is input channel perm[j]: the groups are contiguous in the
             permuted order, y = x[..., perm] @ W_stored^T, and dequantize returns W in input order.

This module defines the formats, the storage names of their parts, and the torch reference
dequantization; it does not choose quantization parameters (that is the quantization passes' job).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from enum import StrEnum

import torch

from optc.errors import InputError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INT4_PACKING = "k8_lsb"
INT4_GROUP_SIZES = (32, 64, 128)


class FormatKind(StrEnum):
    DENSE = "dense"
    INT8_WO = "int8_wo"
    INT4_G = "int4_g"


@dataclass(frozen=True)
class Format:
    kind: FormatKind = FormatKind.DENSE
    dtype: str = "float32"  # the dense dtype, or the dtype of the scales
    bits: int | None = None
    group_size: int | None = None
    zero_point: bool = False
    packing: str | None = None
    act_order: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; allowed: {', '.join(DTYPES)}")
        if self.kind is FormatKind.INT4_G:
            if self.bits != 4 or self.packing != INT4_PACKING:
                raise ValueError(f"int4_g needs bits=4 and packing={INT4_PACKING!r}")
            if self.group_size not in INT4_GROUP_SIZES:
                raise ValueError(f"int4 group size {self.group_size} not in {INT4_GROUP_SIZES}")
        if self.kind is FormatKind.INT8_WO and self.bits != 8:
            raise ValueError("int8_wo needs bits=8")
        if self.act_order and self.kind is not FormatKind.INT4_G:
            raise ValueError("act_order (a perm part) exists only for int4_g")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def is_quantized(self) -> bool:
        return self.kind is not FormatKind.DENSE

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if v is not None and v is not False}
        d["kind"] = self.kind.value
        return d

    @staticmethod
    def from_json(d: dict) -> Format:
        return Format(**{**d, "kind": FormatKind(d["kind"])})

    def part_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Role -> (shape, dtype) of each stored part of a logical tensor of `shape`."""
        if self.kind is FormatKind.DENSE:
            return {"weight": (tuple(shape), self.torch_dtype)}
        n, k = shape
        if self.kind is FormatKind.INT8_WO:
            return {"qweight": ((n, k), torch.int8), "scales": ((n,), self.torch_dtype)}
        g = self.group_size
        parts = {"qweight": ((n, k // 8), torch.int32), "scales": ((n, k // g), self.torch_dtype)}
        if self.zero_point:
            parts["zeros"] = ((n, k // g), torch.uint8)
        if self.act_order:
            parts["perm"] = ((k,), torch.int32)
        return parts

    def check_shape(self, shape: tuple[int, ...], what: str) -> None:
        """Raise a ValueError naming `what` when `shape` cannot be stored in this format."""
        if self.kind is FormatKind.DENSE:
            return
        if len(shape) != 2:
            raise InputError(f"{what}: {self.kind.value} needs a 2-D weight, got shape {list(shape)}")
        k = shape[1]
        if self.kind is FormatKind.INT4_G and (k % self.group_size or k % 8):
            raise InputError(
                f"{what}: input dimension {k} is not a multiple of group size {self.group_size} "
                f"(allowed group sizes dividing {k}: "
                f"{[g for g in INT4_GROUP_SIZES if k % g == 0] or 'none'})"
            )


DENSE_F32 = Format()


def part_name(name: str, role: str, fmt: Format) -> str:
    """Storage key of one part of logical tensor `name`."""
    return name if fmt.kind is FormatKind.DENSE else f"{name}.{role}"


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) integers in [0, 15] -> (N, K // 8) int32, layout k8_lsb.

    Built from bytes: byte i of a word holds nibbles 2i (low) and 2i + 1 (high), and the word is
    those 4 bytes read little-endian, so nibble j sits at bits 4j. (13x faster than shifting int64
    copies of the 8B model's largest weight, and a sixteenth of the memory.)
    """
    n, k = q.shape
    assert k % 8 == 0, f"K={k} must be a multiple of 8"
    assert sys.byteorder == "little", "pack_int4 reads bytes as little-endian words"
    pairs = q.to(torch.uint8).reshape(n, k // 2, 2)
    byts = pairs[..., 0] | (pairs[..., 1] << 4)
    return byts.reshape(n, k // 8, 4).view(torch.int32).reshape(n, k // 8)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K // 8) int32 -> (N, K) uint8 in [0, 15]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = (qweight.unsqueeze(-1) >> shifts) & 0xF
    return q.reshape(qweight.shape[0], -1).to(torch.uint8)


def dequantize(parts: dict[str, torch.Tensor], fmt: Format, out_dtype: torch.dtype | None = None):
    """The reference dequantization: stored parts -> dense (N, K) weight in `out_dtype`.

    Arithmetic is fp32 (q - z) * s, then one cast, so every caller gets the same bits.
    """
    out_dtype = out_dtype or fmt.torch_dtype
    if fmt.kind is FormatKind.DENSE:
        return parts["weight"].to(out_dtype)
    scales = parts["scales"].float()
    if fmt.kind is FormatKind.INT8_WO:
        return (parts["qweight"].float() * scales[:, None]).to(out_dtype)
    q = unpack_int4(parts["qweight"]).float()
    n, k = q.shape
    g = fmt.group_size
    z = parts["zeros"].float() if fmt.zero_point else torch.full_like(scales, 8.0)
    w = ((q.view(n, k // g, g) - z[..., None]) * scales[..., None]).reshape(n, k)
    if fmt.act_order:  # stored column j is input channel perm[j]
        w = torch.empty_like(w).index_copy_(1, parts["perm"].long(), w)
    return w.to(out_dtype)


def linear_ref(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format, bias=None) -> torch.Tensor:
    """y = x @ W^T (+ bias) with W dequantized in x's dtype: the reference for every weight format."""
    w = dequantize(parts, fmt, x.dtype)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))
