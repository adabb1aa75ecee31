"""int4_g linear on CUDA through torch's packed int4 matmul (`aten._weight_int4pack_mm`, "tinygemm", the
kernel gpt-fast and torchao use for batch-1 int4 decode): a candidate beside the Triton w4a16 kernel,
off unless a recipe enables it (`select_kernels: {enable: [torch.int4pack]}`), so that GPU sessions can
measure it against w4a16 on the same artifact (benchmarks/kernels.py rows `tinygemm.*`).

`prepare_int4pack_cuda` repacks a node's weight once, on the device, when the loaded model first runs
the node: the k8_lsb nibbles unpacked to (N, K), re-packed two per byte with the even-indexed value in
the high nibble (the (N, K / 2) uint8 layout `aten._convert_weight_to_int4pack` reads), tiled for the
tensor cores with as many inner K tiles as K allows (8, 4 or 2 tiles of 16), and the scales and zero
points turned into the (K / G, N, 2) table the CPU kernel reads too (`int4_cpu.scales_and_zeros`).
The kernel takes bfloat16 activations only, N a multiple of 8, K of 32, groups of 32 to 256.
"""

from __future__ import annotations

import torch

from optc.core.formats import Format, k8_parts, unpack_int4
from optc.core.ops import Param
from optc.kernels.int4_cpu import packed_linear, scales_and_zeros


def inner_k_tiles(k: int) -> int:
    """The most 16-wide K tiles (8, 4 or 2) the packing can put side by side: K must be a multiple of 16x that."""
    return next(t for t in (8, 4, 2) if k % (16 * t) == 0)


def nibbles_high_first(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values in [0, 16) -> (N, K / 2) uint8, value 2i in the high nibble of byte i and 2i + 1 in the low."""
    q = q.to(torch.uint8)
    return ((q[:, 0::2] << 4) | q[:, 1::2]).contiguous()


def prepare_int4pack_cuda(params: dict[str, Param]) -> dict[str, Param]:
    """A linear node's params (on a CUDA device) -> the same with the weight as {"int4pack", "scales_and_zeros"}."""
    w = params["weight"]
    fmt, parts = w.format, k8_parts(w.parts, w.format)  # an n8_tiles weight's k8_lsb parts
    q = unpack_int4(parts["qweight"])  # (N, K)
    packed = torch.ops.aten._convert_weight_to_int4pack(nibbles_high_first(q), inner_k_tiles(q.shape[1]))
    return {**params, "weight": Param({"int4pack": packed, "scales_and_zeros": scales_and_zeros(parts, fmt)}, fmt)}


def int4pack_cuda_linear(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_ref for an int4_g weight prepared by `prepare_int4pack_cuda`: x (..., K) bf16 -> (..., N) bf16."""
    assert x.dtype == torch.bfloat16, f"the CUDA int4 pack matmul takes bfloat16 activations, got {x.dtype}"
    return packed_linear(torch.ops.aten._weight_int4pack_mm, x, parts, fmt, bias)
