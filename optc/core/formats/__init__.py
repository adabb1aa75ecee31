"""Tensor formats: how a logical weight is stored, as data on the tensor (never guessed from names).

A logical weight of shape (N, K) (out features, in features) is stored as one or more parts. A
`Format` is the data (a kind and its fields, in `graph.json`); the kind's `Scheme` (in this package,
one module per kind: `scheme.py` holds the base and `dense`, then `int8_wo.py`, `int4_g.py`,
`fp8_e4m3.py`, `float_groups.py` for the GGUF kinds)
is the behaviour: the parts and their shapes, the reference dequantization and linear
(with the per-token activation quantization of W8A8 formats), the rounding
primitives the quantizers share, the fusion and cast rules and the export hooks. `SCHEMES` maps each
kind to its scheme; a new kind is a new scheme module plus its line here.

This package does not choose where to quantize or search for parameters (that is the quantization
passes' job, with optc/frontend/quant/).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum

import torch

from optc.core.errors import InputError
from optc.core.formats.float_groups import GF_GROUP_SIZES, Int4Gf, Int8Gf
from optc.core.formats.fp8_e4m3 import Fp8E4M3
from optc.core.formats.int4_g import INT4_GROUP_SIZES, INT4_PACKING, Int4G, k8_parts, pack_int4, unpack_int4
from optc.core.formats.int4_tiles import INT4_TILES_PACKING, tile_int4, tiles_format, tiles_refusal, untile_int4
from optc.core.formats.int8_wo import Int8Wo
from optc.core.formats.scheme import Activations, Dense, Scheme

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

__all__ = [
    "Activations", "DENSE_F32", "DTYPES", "GF_GROUP_SIZES", "INT4_GROUP_SIZES", "INT4_PACKING", "INT4_TILES_PACKING",
    "SCHEMES", "Format", "FormatKind", "Scheme",
    "dequantize", "k8_parts", "linear_ref", "pack_int4", "part_name", "quantized_format", "kind_for_bits",
    "tile_int4", "tiles_format", "tiles_refusal", "unpack_int4", "untile_int4",
]


class FormatKind(StrEnum):
    DENSE = "dense"
    INT8_WO = "int8_wo"
    INT4_G = "int4_g"
    FP8_E4M3 = "fp8_e4m3"
    INT4_GF = "int4_gf"  # GGUF blocks kept as they are: float32 scales (and minimums) per group
    INT8_GF = "int8_gf"


SCHEMES: dict[FormatKind, Scheme] = {
    FormatKind.DENSE: Dense(),
    FormatKind.INT8_WO: Int8Wo(),
    FormatKind.INT4_G: Int4G(),
    FormatKind.FP8_E4M3: Fp8E4M3(),
    FormatKind.INT4_GF: Int4Gf(),
    FormatKind.INT8_GF: Int8Gf(),
}


@dataclass(frozen=True)
class Format:
    kind: FormatKind = FormatKind.DENSE
    dtype: str = "float32"  # the dense dtype, or the dtype of the scales (*_gf: float32 scales; the dequantized dtype)
    bits: int | None = None
    group_size: int | None = None
    zero_point: bool = False
    packing: str | None = None
    act_order: bool = False
    per_tensor: bool = False  # one scale for the whole weight (fp8_e4m3), not one per output channel
    activations: Activations = Activations.NONE  # dynamic: the linear quantizes x per token (W8A8)

    def __post_init__(self) -> None:
        object.__setattr__(self, "activations", Activations(self.activations))  # from JSON: a string
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; allowed: {', '.join(DTYPES)}")
        self.scheme.check_format(self)

    @property
    def scheme(self) -> Scheme:
        return SCHEMES[self.kind]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def is_quantized(self) -> bool:
        return self.scheme.is_quantized

    @property
    def label(self) -> str:
        """The format in a word (`optc inspect`): kind, then group size, per-tensor, activation mode."""
        return self.scheme.label(self)

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if v is not None and v is not False}
        d["kind"] = self.kind.value
        if self.activations is Activations.NONE:  # weight-only formats read as they always did
            del d["activations"]
        else:
            d["activations"] = self.activations.value
        return d

    @staticmethod
    def from_json(d: dict) -> Format:
        return Format(**{**d, "kind": FormatKind(d["kind"])})

    def part_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Role -> (shape, dtype) of each stored part of a logical tensor of `shape`. A 3-D shape is a stack
        of matrices along a leading expert axis (a moe block's experts): each part is the matrix's part,
        stacked, so the scheme only ever sees 2-D weights (one expert is `part[e]`)."""
        if len(shape) == 3:
            return {r: ((shape[0], *s), d) for r, (s, d) in self.scheme.part_shapes(self, tuple(shape[1:])).items()}
        return self.scheme.part_shapes(self, tuple(shape))

    def part_slices(self, shape: tuple[int, ...], axis: int, ranges) -> dict[str, tuple[int, tuple]]:
        """The scheme's `part_slices` (where logical slices along `axis` live in the parts); a 3-D shape's
        slices are every expert's, along the matrix axis `axis - 1` (the expert axis is never cut)."""
        if len(shape) == 3:
            if axis == 0:
                raise ValueError("the expert axis is not sliced (expert parallelism is not supported)")
            inner = self.scheme.part_slices(self, tuple(shape[1:]), axis - 1, ranges)
            return {role: (part_axis + 1, r) for role, (part_axis, r) in inner.items()}
        return self.scheme.part_slices(self, tuple(shape), axis, ranges)

    def check_shape(self, shape: tuple[int, ...], what: str) -> None:
        """Raise an InputError naming `what` when `shape` cannot be stored in this format (a 3-D shape:
        when one expert's matrix cannot)."""
        self.scheme.check_shape(self, tuple(shape[1:] if len(shape) == 3 else shape), what)


DENSE_F32 = Format()


def quantized_format(bits: int, dtype: str = "float32", group_size: int | None = None, zero_point: bool = False,
                     act_order: bool = False) -> Format:
    """The weight-only format for `bits` whose scales are stored in `dtype` (8: int8_wo per channel;
    4: int4_g with `group_size`); the scheme says which options it takes."""
    kind = kind_for_bits(bits)
    return Format(kind=kind, dtype=dtype, **SCHEMES[kind].format_fields(group_size, zero_point, act_order))


def kind_for_bits(bits: int) -> FormatKind:
    """The quantized kind that stores `bits`-bit weights; an InputError names the supported bits."""
    kinds = {s.bits: k for k, s in SCHEMES.items() if s.bits is not None}
    if bits not in kinds:
        raise InputError(f"unsupported bits {bits}; supported: {tuple(sorted(kinds))}")
    return kinds[bits]


def part_name(name: str, role: str, fmt: Format) -> str:
    """Storage key of one part of logical tensor `name`: a dense weight's one part is the name itself."""
    return f"{name}.{role}" if fmt.is_quantized else name


def dequantize(parts: dict[str, torch.Tensor], fmt: Format, out_dtype: torch.dtype | None = None):
    """The reference dequantization: stored parts -> dense (N, K) weight in `out_dtype` (default: the
    format's dtype). Quantized kinds compute in fp32 and cast once, so every caller gets the same bits."""
    return fmt.scheme.dequantize(parts, fmt, out_dtype or fmt.torch_dtype)


def linear_ref(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format, bias=None) -> torch.Tensor:
    """y = x @ W^T (+ bias) in x's dtype: the reference for every weight format (its scheme's linear)."""
    return fmt.scheme.linear(x, parts, fmt, bias)
