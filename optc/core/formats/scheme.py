"""`Scheme`: what optc does with a weight stored in one format kind, in one object.

A format (`optc.core.formats.Format`) is data: a kind and its fields. The kind's scheme is the behaviour
every consumer needs, so that no call site branches on the kind:

- storage: which fields a format of this kind may have (`check_format`), the parts a logical weight
  of a given shape is stored as (`part_shapes`), which shapes it can hold (`check_shape`), which
  parts carry the format's float dtype (`float_roles`, what `cast` converts), and how the parts of
  sibling linears are concatenated into the fused linear's (`can_concat_rows`, `concat_rows`);
- compute: the reference `dequantize` and `linear`; a format whose `activations` is `dynamic`
  quantizes x per token inside `linear` (W8A8), otherwise `linear` dequantizes W in x's dtype;
- quantizers: the storage fields for quantization options (`format_fields`), the group width along
  K, the integer range, the round-to-nearest parameters of a group (`group_params`), rounding values
  to the stored grid for given parameters (`round_values`: integers for the int kinds, e4m3 values
  for fp8) and packing them into parts (`pack`): what RTN, AWQ and GPTQ share, so they round the same
  way;
- export: the export targets that cannot hold a format (`export_refusal`; the ONNX lowering of each
  kind is export's own, optc.commands.export.matmuls), and the Hugging Face checkpoint form of a weight:
  the compressed-tensors quantization arguments of the format (`compressed_tensors_args`) and the
  module tensors its parts are written as and read back from (`to_compressed_tensors`,
  `from_compressed_tensors`); a fused weight is cut back into its siblings by `split_rows`;
- the CUDA capability its reference path needs beyond the runtime's floor (`min_capability`);
- the options a format of the kind may carry (`supports_act_order`, `supports_per_tensor`,
  `activation_modes`) and its short name in `optc inspect` (`label`).

The schemes are registered by kind in `optc.core.formats.SCHEMES`; this module imports nothing of
optc, so `optc.core.formats` can import the schemes while it defines `Format`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from optc.core.errors import InputError

MIN_SCALE = 1e-5  # as AutoAWQ: a group of zeros still gets a usable, non-zero scale

if TYPE_CHECKING:
    from optc.core.formats import Format

PartShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]
Ranges = tuple[tuple[int, int], ...]  # [start, stop) slices along one axis, in order


class Activations(StrEnum):
    """What a linear does with its input x before the matmul."""

    NONE = "none"  # weight-only (W8A16, W4A16): x stays in the model dtype
    DYNAMIC = "dynamic"  # W8A8: each token (row of x) quantized with its own scale at run time


class Scheme:
    """The behaviour of one format kind; subclasses override what differs from a dense weight."""

    is_quantized: ClassVar[bool] = False
    bits: ClassVar[int | None] = None  # the `bits` of quantization options this scheme serves
    float_roles: ClassVar[tuple[str, ...]] = ("weight",)
    min_capability: ClassVar[tuple[int, int] | None] = None  # None: the runtime's floor is enough
    supports_act_order: ClassVar[bool] = False  # a `perm` part (imported GPTQ desc_act)
    supports_per_tensor: ClassVar[bool] = False  # one scale for the whole weight
    activation_modes: ClassVar[tuple[Activations, ...]] = (Activations.NONE,)

    # --- storage ----------------------------------------------------------------------------------
    def check_format(self, fmt: Format) -> None:
        """Raise a ValueError when `fmt`'s fields do not fit this kind."""
        kind = fmt.kind.value
        if fmt.act_order and not self.supports_act_order:
            raise ValueError(f"act_order (a perm part) exists only for int4_g, not {kind}")
        if fmt.per_tensor and not self.supports_per_tensor:
            raise ValueError(f"per_tensor scales exist only for fp8_e4m3, not {kind}")
        if fmt.activations not in self.activation_modes:
            raise ValueError(f"{kind} takes activations {', '.join(self.activation_modes)}, "
                             f"not {fmt.activations.value}")

    def label(self, fmt: Format) -> str:
        """The format in a word for `optc inspect`: the kind, then what sets it apart."""
        tags = [f"g{fmt.group_size}"] if fmt.group_size else []
        tags += ["per-tensor"] if fmt.per_tensor else []
        tags += [f"act-{fmt.activations.value}"] if fmt.activations is not Activations.NONE else []
        return "/".join([fmt.kind.value, *tags])

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

    def split_rows(self, role: str, part: torch.Tensor, sizes: list[int], fmt: Format) -> list[torch.Tensor]:
        """The inverse of `concat_rows`: one part of a fused weight -> the siblings' parts of `role`."""
        return [p.contiguous() for p in part.split(sizes, 0)]

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

    def round_values(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: Format) -> torch.Tensor:
        """The stored values (fp32) nearest to w for a scale and zero that broadcast against w:
        clamp(round(w / s) + z, qrange) for the integer kinds; dequantized, (q - z) · s."""
        qmin, qmax = self.qrange(fmt)
        return torch.div(w.float(), scale).round_().add_(zero).clamp_(qmin, qmax)  # one temporary, not four

    def pack(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             fmt: Format) -> dict[str, torch.Tensor]:
        """Stored values q (N, K) from `round_values`, scales and zeros (N, K // G), all fp32 -> the
        stored parts."""
        raise InputError(f"format {fmt.kind.value} is not a quantized format")

    # --- export -----------------------------------------------------------------------------------
    def export_refusal(self, fmt: Format, flavor: str) -> str | None:
        """Why export target `flavor` (an ONNX flavor, or `hf`) cannot hold a weight in `fmt` (what follows
        "tensor X is "), or None."""
        return None

    def compressed_tensors_args(self, fmt: Format) -> dict | None:
        """The compressed-tensors `QuantizationArgs` (as config.json holds them) of a weight in `fmt`, written
        `pack-quantized`; None for a weight written as a plain `weight` tensor."""
        return None

    def to_compressed_tensors(self, parts: dict[str, torch.Tensor], fmt: Format,
                              shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """The stored parts of one weight of logical `shape` -> its module's checkpoint tensors, by parameter
        name (`weight` here; `weight_packed`, `weight_scale`, ... for a quantized scheme). Works on meta
        tensors, so the shapes a checkpoint must have come from the same code."""
        return {"weight": parts["weight"]}

    def from_compressed_tensors(self, tensors: dict[str, torch.Tensor], fmt: Format,
                                shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """The inverse of `to_compressed_tensors`: a module's checkpoint tensors -> the stored parts, exactly."""
        return {"weight": tensors["weight"]}


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
