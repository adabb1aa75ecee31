"""`int4_gf` and `int8_gf`: integer codes in groups of G consecutive inputs with a float32 scale (and, with
`zero_point`, a float32 minimum) per row and group: the formats a GGUF file's block quantizations are kept in.

`int4_gf` parts: `qweight` (N, K // 8) int32 packed k8_lsb as int4_g's (codes u in [0, 15]), `scales`
(N, K // G) float32 and with `zero_point` `mins` (N, K // G) float32;
w = s * (u - 8) without mins (GGUF Q4_0), w = (s * u) + m with them (Q4_1; Q4_K's effective per-32 scale
d * sc and minimum -(dmin * m)).
`int8_gf` parts: `qweight` (N, K) int8 (codes q), `scales`, and with `zero_point` `mins`, as above;
w = s * q without mins (Q8_0; Q5_0 with q = u - 16; Q6_K in groups of 16 with q = u - 32), w = (s * q) + m
with them (Q5_1; Q5_K). A 5- or 6-bit code widened to int8 is exact and takes 8 bits instead of 5-6.

Every product and sum is the one gguf-py's dequantization computes (its quants.py is the specification),
in float32 and in its order, so `dequantize` returns llama.cpp's weights bit for bit: an fp16 scale times a
code of at most 8 bits, or an fp16 factor times a 6-bit sub-block scale, is exact in float32 but not in
bfloat16. So the scales and minimums stay float32 whatever the model's dtype: these kinds have no
`float_roles`, and a format's `dtype` is the dtype its weight dequantizes to (the activations'), which
the cast pass sets without touching a part. A float minimum is no integer zero point: compressed-tensors
and ONNX's DequantizeLinear cannot hold it, and nothing quantizes into these kinds (they are imported).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from optc.core.errors import InputError
from optc.core.formats.int4_g import INT4_PACKING, unpack_int4
from optc.core.formats.scheme import PartShapes, Scheme, check_2d

if TYPE_CHECKING:
    from optc.core.formats import Format

GF_GROUP_SIZES = {4: (32,), 8: (16, 32)}  # what GGUF's blocks need: 32 (Q4_*, Q5_*, Q8_0, K-quants), 16 (Q6_K)


class _FloatGroups(Scheme):
    """What the two kinds share: float32 scales and minimums per group, w = s * q (+ m) in float32."""

    is_quantized = True
    float_roles = ()  # float32 always: cast changes the format's dtype (the dequantized weight's) only
    code_bits: ClassVar[int]
    code_offset: ClassVar[int]  # subtracted from a stored code when there are no minimums

    def check_format(self, fmt: Format) -> None:
        kind = fmt.kind.value
        if fmt.bits != self.code_bits:
            raise ValueError(f"{kind} needs bits={self.code_bits}")
        if fmt.group_size not in GF_GROUP_SIZES[self.code_bits]:
            raise ValueError(f"{kind} group size {fmt.group_size} not in {GF_GROUP_SIZES[self.code_bits]}")
        super().check_format(fmt)

    def part_shapes(self, fmt: Format, shape: tuple[int, ...]) -> PartShapes:
        n, k = shape
        groups = (n, k // fmt.group_size)
        parts = {"qweight": self.code_shape(n, k), "scales": (groups, torch.float32)}
        if fmt.zero_point:
            parts["mins"] = (groups, torch.float32)
        return parts

    def check_shape(self, fmt: Format, shape: tuple[int, ...], what: str) -> None:
        check_2d(fmt, shape, what)
        if shape[1] % fmt.group_size:
            raise InputError(f"{what}: input dimension {shape[1]} is not a multiple of {fmt.kind.value}'s group "
                             f"size {fmt.group_size}")

    def dequantize(self, parts: dict[str, torch.Tensor], fmt: Format, out_dtype: torch.dtype) -> torch.Tensor:
        q = self.codes(parts["qweight"]).float()  # (N, K), exact small integers
        n, k = q.shape
        g = fmt.group_size
        q = q.view(n, k // g, g)
        s = parts["scales"].float()[..., None]
        if fmt.zero_point:  # gguf: (d * q) + m, two roundings in this order (no fused multiply-add)
            w = (s * q) + parts["mins"].float()[..., None]
        else:  # gguf: d * (q - offset); q - offset is exact
            w = s * (q - self.code_offset)
        return w.reshape(n, k).to(out_dtype)

    def label(self, fmt: Format) -> str:
        return f"{fmt.kind.value}/g{fmt.group_size}" + ("/min" if fmt.zero_point else "")

    def format_fields(self, group_size: int | None, zero_point: bool, act_order: bool = False) -> dict:
        raise InputError(f"{self.kind_name} holds a GGUF file's own blocks (`source_quantization: keep`); "
                         "the quantization passes write int8_wo, int4_g or fp8_e4m3")

    def export_refusal(self, fmt: Format, flavor: str) -> str | None:
        what = "a float32 scale and minimum" if fmt.zero_point else "a float32 scale"
        return (f"{fmt.label} (a GGUF block quantization kept as it is: {what} per group of {fmt.group_size}); "
                f"the {flavor} export has no form for it: build without `source_quantization: keep` (the GGUF "
                f"dequantized, then a quantization pass) to export")

    # --- what differs between the kinds ---
    kind_name: ClassVar[str]

    def code_shape(self, n: int, k: int) -> tuple[tuple[int, int], torch.dtype]:
        raise NotImplementedError

    def codes(self, qweight: torch.Tensor) -> torch.Tensor:
        """The stored codes (N, K) as integers."""
        raise NotImplementedError


class Int4Gf(_FloatGroups):
    """int4 codes packed k8_lsb, float32 scales (and minimums) per group."""

    code_bits = 4
    code_offset = 8
    kind_name = "int4_gf"

    def check_format(self, fmt: Format) -> None:
        if fmt.packing != INT4_PACKING:
            raise ValueError(f"int4_gf needs packing={INT4_PACKING!r}")
        super().check_format(fmt)

    def code_shape(self, n: int, k: int) -> tuple[tuple[int, int], torch.dtype]:
        return (n, k // 8), torch.int32

    def codes(self, qweight: torch.Tensor) -> torch.Tensor:
        return unpack_int4(qweight)


class Int8Gf(_FloatGroups):
    """int8 codes, float32 scales (and minimums) per group."""

    code_bits = 8
    code_offset = 0
    kind_name = "int8_gf"

    def code_shape(self, n: int, k: int) -> tuple[tuple[int, int], torch.dtype]:
        return (n, k), torch.int8

    def codes(self, qweight: torch.Tensor) -> torch.Tensor:
        return qweight
