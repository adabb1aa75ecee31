"""`int4_g`: 4-bit weights in groups of G consecutive inputs, with a scale (and optionally a zero
point) per row and group.

Parts `qweight`: (N, K // 8) int32, `scales`: (N, K // G) in the format's dtype, and when
`zero_point` is set `zeros`: (N, K // G) uint8 holding integer zero points in [0, 15];
w[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G], with z = 8 when symmetric.
Packing `k8_lsb`: the 8 values k = 8j .. 8j + 7 of row n live in qweight[n, j], value k at bits
4 * (k % 8) .. 4 * (k % 8) + 3 (the lowest nibble is the lowest k). Rows stay contiguous along K,
which is what the w4a16 GEMV streams.
Packing `n8_tiles` (optc/core/formats/int4_tiles.py; the CUDA decode kernels' layout, written by
`select_kernels: {int4_packing: n8_tiles}`): one part `qtiles` (N/8, K/G, G + 8) int32, the same codes
in tiles of 8 rows with each group's scale and zero point beside its codes; every method here that is
not about that layout reads it through `untile_int4` (k8_lsb parts, bit for bit).
With `act_order` (only for imported GPTQ desc_act checkpoints) a part `perm`: (K,) int32 says stored
column j is input channel perm[j]: the groups are contiguous in the permuted order,
y = x[..., perm] @ W_stored^T, and dequantize returns W in input order. Siblings with their own
perms cannot be fused by concatenating rows (each row set reads x in its own order).

Round-to-nearest parameters: symmetric s = 2·max|w| / 15 and z = 8 (as GPTQ); with a zero point the
range [min(w, 0), max(w, 0)] over 15 steps, z = round(-min / s).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch

from optc.core.errors import InputError
from optc.core.formats.int4_tiles import (
    INT4_TILES_PACKING,
    TILE_DTYPES,
    TILE_ROWS,
    tile_int4,
    tiles_shape,
    untile_int4,
)
from optc.core.formats.scheme import PartShapes, Ranges, Scheme, check_2d, round_scale

if TYPE_CHECKING:
    from optc.core.formats import Format

INT4_PACKING = "k8_lsb"
INT4_PACKINGS = (INT4_PACKING, INT4_TILES_PACKING)
INT4_GROUP_SIZES = (32, 64, 128)
PORTABLE_GROUP_SIZES = (64, 128)  # what TensorRT's blocked int4 DequantizeLinear takes


class Int4G(Scheme):
    """int4 weight-only, grouped along the input dimension, packed k8_lsb (or n8_tiles for the CUDA decode kernels)."""

    is_quantized = True
    bits = 4
    float_roles = ("scales",)
    supports_act_order = True

    def check_format(self, fmt: Format) -> None:
        if fmt.bits != 4 or fmt.packing not in INT4_PACKINGS:
            raise ValueError(f"int4_g needs bits=4 and a packing in {INT4_PACKINGS}")
        if fmt.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size {fmt.group_size} not in {INT4_GROUP_SIZES}")
        if fmt.packing == INT4_TILES_PACKING and (fmt.dtype not in TILE_DTYPES or fmt.act_order):
            raise ValueError(f"int4_g packed {INT4_TILES_PACKING} needs 16-bit scales ({', '.join(TILE_DTYPES)}) "
                             f"and no act_order")
        super().check_format(fmt)

    def label(self, fmt: Format) -> str:
        label = super().label(fmt)
        return label if fmt.packing == INT4_PACKING else f"{label}/{fmt.packing}"

    def part_shapes(self, fmt: Format, shape: tuple[int, ...]) -> PartShapes:
        n, k = shape
        g = fmt.group_size
        if fmt.packing == INT4_TILES_PACKING:
            return {"qtiles": (tiles_shape(n, k, g), torch.int32)}
        parts = {"qweight": ((n, k // 8), torch.int32), "scales": ((n, k // g), fmt.torch_dtype)}
        if fmt.zero_point:
            parts["zeros"] = ((n, k // g), torch.uint8)
        if fmt.act_order:
            parts["perm"] = ((k,), torch.int32)
        return parts

    def check_shape(self, fmt: Format, shape: tuple[int, ...], what: str) -> None:
        check_2d(fmt, shape, what)
        k = shape[1]
        if k % fmt.group_size or k % 8:
            raise InputError(
                f"{what}: input dimension {k} is not a multiple of group size {fmt.group_size} "
                f"(allowed group sizes dividing {k}: "
                f"{[g for g in INT4_GROUP_SIZES if k % g == 0] or 'none'})"
            )
        if fmt.packing == INT4_TILES_PACKING and shape[0] % TILE_ROWS:
            raise InputError(f"{what}: {shape[0]} output rows are not whole tiles of {TILE_ROWS} "
                             f"(packing {INT4_TILES_PACKING})")

    def part_slices(self, fmt: Format, shape: tuple[int, ...], axis: int, ranges: Ranges) -> dict:
        if axis == 1 and fmt.act_order:  # stored columns are permuted: a slice of inputs is no slice of parts
            raise ValueError("an act_order weight's input dimension is permuted and cannot be sliced")
        return super().part_slices(fmt, shape, axis, ranges)

    def can_concat_rows(self, fmt: Format) -> bool:
        return not fmt.act_order  # n8_tiles: whole tiles of rows, so fused tiles are the siblings' tiles in order

    def split_rows(self, role: str, part: torch.Tensor, sizes: list[int], fmt: Format) -> list[torch.Tensor]:
        if fmt.packing != INT4_TILES_PACKING:
            return super().split_rows(role, part, sizes, fmt)
        if any(s % TILE_ROWS for s in sizes):
            raise ValueError(f"rows {sizes} cut a tile of {TILE_ROWS} rows (packing {INT4_TILES_PACKING})")
        return [p.contiguous() for p in part.split([s // TILE_ROWS for s in sizes], 0)]

    def dequantize(self, parts: dict[str, torch.Tensor], fmt: Format, out_dtype: torch.dtype) -> torch.Tensor:
        # fp32 (q - z) * s, then one cast, so every caller gets the same bits
        parts = k8_parts(parts, fmt)
        scales = parts["scales"].float()
        q = unpack_int4(parts["qweight"]).float()
        n, k = q.shape
        g = fmt.group_size
        z = parts["zeros"].float() if fmt.zero_point else torch.full_like(scales, 8.0)
        w = ((q.view(n, k // g, g) - z[..., None]) * scales[..., None]).reshape(n, k)
        if fmt.act_order:  # stored column j is input channel perm[j]
            w = torch.empty_like(w).index_copy_(1, parts["perm"].long(), w)
        return w.to(out_dtype)

    def format_fields(self, group_size: int | None, zero_point: bool, act_order: bool = False) -> dict:
        if group_size not in INT4_GROUP_SIZES:
            raise InputError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        return {"bits": 4, "group_size": group_size, "zero_point": zero_point, "packing": INT4_PACKING,
                "act_order": act_order}

    def group_width(self, fmt: Format, k: int) -> int:
        return fmt.group_size

    def qrange(self, fmt: Format) -> tuple[int, int]:
        return 0, 15

    def group_params(self, w: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
        w = w.float()
        if not fmt.zero_point:
            scale = round_scale(w.abs().amax(-1) * (2 / 15), fmt)
            return scale, torch.full_like(scale, 8.0)
        lo = w.amin(-1).clamp(max=0)
        hi = w.amax(-1).clamp(min=0)
        scale = round_scale((hi - lo) / 15, fmt)
        return scale, torch.round(-lo / scale).clamp(0, 15)

    def pack(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             fmt: Format) -> dict[str, torch.Tensor]:
        parts = {"qweight": pack_int4(q.to(torch.int64)), "scales": scales.to(fmt.torch_dtype)}
        if fmt.zero_point:
            parts["zeros"] = zeros.to(torch.uint8)
        return tile_int4(parts, fmt) if fmt.packing == INT4_TILES_PACKING else parts

    def export_refusal(self, fmt: Format, flavor: str) -> str | None:
        if flavor != "hf" and fmt.packing == INT4_TILES_PACKING:
            return (f"int4_g packed {INT4_TILES_PACKING} (laid out for the CUDA decode kernels); the ONNX lowering "
                    f"reads k8_lsb: rebuild without `select_kernels: {{int4_packing: {INT4_TILES_PACKING}}}`")
        if flavor == "hf" and fmt.act_order:
            return ("int4_g with act_order (a GPTQ desc_act import: groups of scattered input channels); "
                    "compressed-tensors has no per-channel group index (its `actorder: group` and g_idx were "
                    "removed), so --format hf cannot write it without requantizing: export with --format onnx")
        if flavor != "portable" or (not fmt.zero_point and fmt.group_size in PORTABLE_GROUP_SIZES):
            return None
        return (f"int4_g group_size={fmt.group_size} zero_point={str(fmt.zero_point).lower()}; the portable flavor "
                f"(TensorRT) takes int4 only symmetric in blocks of 64 or 128: rebuild with `zero_point: false` and "
                f"`group_size: 64` or `128` in the quantization pass, or export with --flavor ort")

    def compressed_tensors_args(self, fmt: Format) -> dict | None:
        return {"num_bits": 4, "type": "int", "symmetric": not fmt.zero_point, "group_size": fmt.group_size,
                "strategy": "group", "dynamic": False}

    def to_compressed_tensors(self, parts: dict[str, torch.Tensor], fmt: Format,
                              shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        # compressed-tensors stores signed q - 8 (zero point z - 8) as the nibble q (z): our integers. Its
        # 4-bit packing puts element k of a row at bits 4·(k mod 8) of word k / 8, which is k8_lsb, so
        # weight_packed is qweight itself; zero points are packed the same way down the output rows.
        n, k = shape
        parts = k8_parts(parts, fmt)
        out = {"weight_packed": parts["qweight"], "weight_scale": parts["scales"], "weight_shape": torch.tensor([n, k])}
        if fmt.zero_point:
            zeros = parts["zeros"].T  # (K/G, N)
            pad = -n % 8  # compressed-tensors pads the rows with nibble 0
            zeros = torch.cat([zeros, zeros.new_zeros(zeros.shape[0], pad)], 1) if pad else zeros
            out["weight_zero_point"] = pack_int4(zeros.contiguous()).T.contiguous()  # (ceil(N/8), K/G)
        return out

    def from_compressed_tensors(self, tensors: dict[str, torch.Tensor], fmt: Format,
                                shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        n, _ = shape
        parts = {"qweight": tensors["weight_packed"].contiguous(), "scales": tensors["weight_scale"].contiguous()}
        if fmt.zero_point:
            parts["zeros"] = unpack_int4(tensors["weight_zero_point"].T.contiguous())[:, :n].T.contiguous()
        return tile_int4(parts, fmt) if fmt.packing == INT4_TILES_PACKING else parts


def k8_parts(parts: dict[str, torch.Tensor], fmt: Format) -> dict[str, torch.Tensor]:
    """An int4_g weight's parts in k8_lsb (qweight, scales, zeros if any, perm if any), whatever its packing:
    what every reader other than the n8_tiles kernels reads."""
    return untile_int4(parts["qtiles"], fmt) if fmt.packing == INT4_TILES_PACKING else parts


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
