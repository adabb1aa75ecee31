"""int4_g packing `n8_tiles`: an int4_g weight laid out for the CUDA decode kernels
(kernels/w4a16_tiles.py), with its scales and zero points in the same stream as its codes.

Rows go in tiles of TILE_ROWS = 8. For tile t and group g, one contiguous chunk of G + 8 int32 words:
words [0, G) hold the tile's 8 rows' codes of group g, row r's G/8 words at r·G/8 (each word exactly
the k8_lsb word qweight[8t + r, g·G/8 + j]); words [G, G + 8) hold one word per row: the scale's
float16 / bfloat16 bit pattern in bits 0-15 and the zero point in bits 16-23 (8 for a symmetric
format), zero above. The one part `qtiles` is (N/8, K/G, G + 8) int32, so a program that owns 8 rows
(or a multiple) reads one contiguous run of memory over all of K, codes and their scales together, in
16-byte pieces (G/8 words per row segment, G + 8 words per chunk: multiples of 4 for G >= 32).

The packing holds 16-bit scales only (the kernels dequantize in the activation dtype), needs N a
multiple of 8 and no `act_order`. It is a permutation of k8_lsb's words plus the scale and zero
bits: `tile_int4` and `untile_int4` are exact inverses, and every reader that is not one of its
kernels (the reference, exports, repacking kernels) reads `untile_int4`'s k8_lsb parts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from optc.core.formats import Format

INT4_TILES_PACKING = "n8_tiles"
TILE_ROWS = 8
TILE_DTYPES = ("float16", "bfloat16")  # scales stored as 16-bit patterns
SYMMETRIC_ZERO = 8


def tiles_refusal(fmt: Format, shape: tuple[int, ...]) -> str | None:
    """Why a k8_lsb int4_g weight of `shape` cannot be laid out `n8_tiles` (None: it can)."""
    if fmt.dtype not in TILE_DTYPES:
        return f"its scales are {fmt.dtype} (the packing stores 16-bit scales: {', '.join(TILE_DTYPES)})"
    if fmt.act_order:
        return "it has act_order (a perm the tiled kernels do not apply)"
    if len(shape) != 2 or shape[0] % TILE_ROWS:
        return f"its shape {list(shape)} is not a matrix of whole tiles of {TILE_ROWS} rows"
    return None


def tiles_format(fmt: Format) -> Format:
    return replace(fmt, packing=INT4_TILES_PACKING)


def tiles_shape(n: int, k: int, group: int) -> tuple[int, int, int]:
    """The shape of `qtiles` for an (N, K) weight in groups of `group`."""
    return n // TILE_ROWS, k // group, group + TILE_ROWS


def tile_int4(parts: dict[str, torch.Tensor], fmt: Format) -> dict[str, torch.Tensor]:
    """k8_lsb parts (qweight (N, K/8) int32, scales (N, K/G) 16-bit, zeros (N, K/G) uint8 if the format
    has a zero point) -> {"qtiles": (N/8, K/G, G + 8) int32}."""
    qweight, scales = parts["qweight"], parts["scales"]
    n, words = qweight.shape
    g = fmt.group_size
    assert scales.dtype in (torch.float16, torch.bfloat16), f"n8_tiles stores 16-bit scales, got {scales.dtype}"
    assert n % TILE_ROWS == 0, f"N={n} is not a multiple of {TILE_ROWS}"
    t, groups = n // TILE_ROWS, words * 8 // g
    # codes: (N, K/8) -> (N/8, 8, K/G, G/8) -> (N/8, K/G, 8, G/8) -> (N/8, K/G, G)
    codes = qweight.reshape(t, TILE_ROWS, groups, g // 8).permute(0, 2, 1, 3).reshape(t, groups, g)
    zeros = parts["zeros"].to(torch.int32) if fmt.zero_point else torch.full_like(scales, SYMMETRIC_ZERO,
                                                                                   dtype=torch.int32)
    meta = (scales.view(torch.int16).to(torch.int32) & 0xFFFF) | (zeros << 16)  # (N, K/G)
    meta = meta.reshape(t, TILE_ROWS, groups).permute(0, 2, 1)  # (N/8, K/G, 8)
    return {"qtiles": torch.cat([codes, meta], dim=2).contiguous()}


def untile_int4(qtiles: torch.Tensor, fmt: Format) -> dict[str, torch.Tensor]:
    """The inverse of `tile_int4`: {"qtiles"} -> k8_lsb parts, bit for bit."""
    t, groups, chunk = qtiles.shape
    g = fmt.group_size
    assert chunk == g + TILE_ROWS, f"qtiles chunks of {chunk} words do not fit group size {g}"
    n = t * TILE_ROWS
    codes = qtiles[..., :g].reshape(t, groups, TILE_ROWS, g // 8).permute(0, 2, 1, 3).reshape(n, groups * g // 8)
    meta = qtiles[..., g:].permute(0, 2, 1).reshape(n, groups)  # (N, K/G)
    low = meta & 0xFFFF
    bits = (low - ((low & 0x8000) << 1)).to(torch.int16)  # the 16-bit pattern, as a signed int16
    parts = {"qweight": codes.contiguous(), "scales": bits.view(fmt.torch_dtype)}
    if fmt.zero_point:
        parts["zeros"] = ((meta >> 16) & 0xFF).to(torch.uint8)
    return parts
