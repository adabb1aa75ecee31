"""`Scheme`: what optc does with a weight stored in one format kind, in one object.

A format (`optc.formats.Format`) is data: a kind and its fields. The kind's scheme is the behaviour
every consumer needs, so that no call site branches on the kind:

- storage: which fields a format of this kind may have (`check_format`), the parts a logical weight
  of a given shape is stored as (`part_shapes`), which shapes it can hold (`check_shape`), which
  parts carry the format's float dtype (`float_roles`, what `cast` converts), and how the parts of
  sibling linears are concatenated into the fused linear's (`can_concat_rows`, `concat_rows`);
- compute: the reference `dequantize` and `linear` (x may be quantized there by a scheme that
  quantizes activations; today's schemes are weight-only, so `linear` dequantizes W in x's dtype);
- quantizers: the storage fields for quantization options (`format_fields`), the group width along
  K, the integer range, the round-to-nearest parameters of a group (`group_params`) and packing the
  integers into parts (`pack`): what RTN, AWQ and GPTQ share, so they round the same way;
- export: the ONNX matmul of x with a weight in this kind (`onnx_matmul`) and the export flavors
  that cannot hold a format (`export_refusal`);
- the CUDA capability its reference path needs beyond the runtime's floor (`min_capability`).

The schemes are registered by kind in `optc.formats.SCHEMES`; this module imports nothing of
optc, so `optc.formats` can import the schemes while it defines `Format`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from optc.errors import InputError

MIN_SCALE = 1e-5  # as AutoAWQ: a group of zeros still gets a usable, non-zero scale

if TYPE_CHECKING:
    from optc.formats import Format

PartShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]
Ranges = tuple[tuple[int, int], ...]  # [start, stop) slices along one axis, in order


class Scheme:
    """The behaviour of one format kind; subclasses override what differs from a dense weight."""

    is_quantized: ClassVar[bool] = False
    bits: ClassVar[int | None] = None  # the `bits` of quantization options this scheme serves
    float_roles: ClassVar[tuple[str, ...]] = ("weight",)
    min_capability: ClassVar[tuple[int, int] | None] = None  # None: the runtime's floor is enough

    # --- storage ----------------------------------------------------------------------------------
    def check_format(self, fmt: Format) -> None:
        """Raise a ValueError when `fmt`'s fields do not fit this kind."""
        if fmt.act_order:
            raise ValueError("act_order (a perm part) exists only for int4_g")

    def part_shapes(self, fmt: Format, shape: tuple[int, ...]) -> PartShapes:
        """Role -> (shape, dtype) of each stored part of a logical tensor of `shape`."""
        return {"weight": (tuple(shape), fmt.torch_dtype)}

    def check_shape(self, fmt: Format, shape: tuple[int, ...], what: str) -> None:
        """Raise an InputError naming `what` when `shape` cannot be stored in `fmt`."""

    def part_slices(self, fmt: Format, shape: tuple[int, ...], axis: int,
                    ranges: Ranges) -> dict[str, tuple[int, Ranges]]:
        """Where the logical slices `ranges` ([start, stop) along `axis` of a weight of `shape`) live
        in the stored parts: role -> (part axis, part ranges), for the parts that run along `axis`
        (the others are kept whole). A part runs along `axis` when its size there grows with the
        weight's; a slice must not cut a stored unit (8 int4 values of a word, a group of scales):
        ValueError naming the unit otherwise. Tensor parallelism shards weights with it."""
        size = shape[axis]
        grown = self.part_shapes(fmt, tuple(2 * d if i == axis else d for i, d in enumerate(shape)))
        out = {}
        for role, (pshape, _) in self.part_shapes(fmt, shape).items():
            part_axes = [i for i, (a, b) in enumerate(zip(pshape, grown[role][0], strict=True)) if a != b]
            if not part_axes:
                continue
            p = part_axes[0]
            unit = size // pshape[p]  # logical entries per stored entry of this part along the axis
            cut = [x for a, b in ranges for x in (a, b) if x % unit]
            if cut:
                raise ValueError(f"a slice at {cut[0]} of dimension {size} cuts a stored unit of {unit} "
                                 f"({fmt.kind.value} part {role})")
            out[role] = (p, tuple((a // unit, b // unit) for a, b in ranges))
        return out

    def can_concat_rows(self, fmt: Format) -> bool:
        """Whether sibling weights in `fmt` fuse by concatenating their parts along the output rows."""
        return True

    def concat_rows(self, role: str, parts: list[torch.Tensor], fmt: Format) -> torch.Tensor:
        """One part of the fused weight from the siblings' parts of `role` (in output order)."""
        return torch.cat(parts, 0)

    # --- compute ----------------------------------------------------------------------------------
    def dequantize(self, parts: dict[str, torch.Tensor], fmt: Format, out_dtype: torch.dtype) -> torch.Tensor:
        """Stored parts -> the dense (N, K) weight in `out_dtype`."""
        return parts["weight"].to(out_dtype)

    def linear(self, x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """The reference y = x @ W^T (+ bias) in x's dtype: W dequantized in x's dtype (weight-only)."""
        w = self.dequantize(parts, fmt, x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))

    # --- quantizers -------------------------------------------------------------------------------
    def format_fields(self, group_size: int | None, zero_point: bool, act_order: bool = False) -> dict:
        """The Format fields (besides kind and dtype) of a weight quantized with these options."""
        raise InputError("dense is not a quantized format")

    def group_width(self, fmt: Format, k: int) -> int:
        """How many consecutive inputs of a row share one scale (K for per-channel formats)."""
        raise InputError(f"format {fmt.kind.value} is not a quantized format")

    def qrange(self, fmt: Format) -> tuple[int, int]:
        """Smallest and largest stored integer."""
        raise InputError(f"format {fmt.kind.value} is not a quantized format")

    def group_params(self, w: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
        """Round-to-nearest parameters of groups w (..., G) -> (scale (...), zero (...)), both fp32;
        the scale already rounded to the storage dtype, the zero an integer."""
        raise InputError(f"format {fmt.kind.value} is not a quantized format")

    def pack(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             fmt: Format) -> dict[str, torch.Tensor]:
        """Integers q (N, K), scales and zeros (N, K // G), all fp32 -> the stored parts."""
        raise InputError(f"format {fmt.kind.value} is not a quantized format")

    # --- export -----------------------------------------------------------------------------------
    def onnx_matmul(self, lowering, x: str, tensor: str, parts: dict[str, torch.Tensor], fmt: Format) -> str:
        """ONNX value x (B, S, K) @ W^T -> (B, S, N), built with `lowering` (optc.export.lower)."""
        from optc.export.onnx_builder import matmul_operand_dense

        w = matmul_operand_dense(lowering.b, tensor, parts, fmt)
        return lowering.b.op1("MatMul", [x, w], base=tensor)

    def export_refusal(self, fmt: Format, flavor: str) -> str | None:
        """Why export `flavor` cannot hold a weight in `fmt` (what follows "tensor X is "), or None."""
        return None


def check_2d(fmt: Format, shape: tuple[int, ...], what: str) -> None:
    """A quantized weight is a matrix: raise an InputError naming `what` otherwise."""
    if len(shape) != 2:
        raise InputError(f"{what}: {fmt.kind.value} needs a 2-D weight, got shape {list(shape)}")


def round_scale(scale: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Clamp at MIN_SCALE and round to the storage dtype (widened back to fp32), so the stored parts
    dequantize to exactly the values the quantizer rounded to."""
    return scale.clamp(min=MIN_SCALE).to(fmt.torch_dtype).float()


class Dense(Scheme):
    """`dense`: one part `weight` (N, K) in the format's dtype; every default above is its behaviour."""
