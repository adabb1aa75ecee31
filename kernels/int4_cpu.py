"""int4_g and int4_gf linears on the CPU through torch's packed int4 matmul (`aten._weight_int4pack_mm_for_cpu`).

`prepare_int4pack` repacks a node's int4_g weight once, when the loaded model first runs the node:
the k8_lsb nibbles unpacked to (N, K) int32 and handed to `aten._convert_weight_to_int4pack_for_cpu`,
and the scales and zero points turned into the kernel's (K / G, N, 2) table in the activation dtype.
The kernel computes w = (q - 8) * s + b per group, so our w = (q - z) * s has b = (8 - z) * s (b = 0
when symmetric); int4_gf's w = s * u + m (a GGUF Q4_1 / Q4_K block) has b = 8 * s + m, and its symmetric
w = s * (u - 8) (Q4_0) b = 0. The launcher `int4pack_linear` has linear_ref's signature and reads those prepared
parts; the artifact keeps the format's own parts, which the reference reads. `int4pack_logits` is the
lm_head's: its prepared weight keeps the stored parts beside the packed ones, for the fp32 recompute of
each row's best logits (optc.core.ops.linear.exact_top_logits).

Where it pays: with bfloat16 activations it is faster than dequantizing per call; with float32 activations torch's
int4 CPU matmul is far slower than the reference at M >= 64, so the table offers it for bfloat16 only. Its one
rounding that the reference does not have is b in bfloat16 (the reference rounds (q - z) * s once, in fp32): tests
bound the difference.
"""

from __future__ import annotations

import torch

from optc.core.formats import Format, FormatKind, unpack_int4
from optc.core.ops import Param
from optc.core.ops.linear import exact_top_logits
from optc.kernels.cpu_ext.ops import top_k

INNER_K_TILES = 2  # the packing's K tile count: any of 1, 2, 4, 8 gives the same product on the CPU
N_MULTIPLE = 16  # the packing needs whole tiles of 16 output rows


def prepare_int4pack(params: dict[str, Param]) -> dict[str, Param]:
    """A linear node's params -> the same with the weight as {"int4pack", "scales_and_zeros"} parts."""
    w = params["weight"]
    fmt, parts = w.format, w.parts
    q = unpack_int4(parts["qweight"]).to(torch.int32)  # (N, K)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), INNER_K_TILES)
    return {**params, "weight": Param({"int4pack": packed, "scales_and_zeros": scales_and_zeros(parts, fmt)}, fmt)}


def scales_and_zeros(parts: dict[str, torch.Tensor], fmt: Format) -> torch.Tensor:
    """The packed int4 matmuls' (K / G, N, 2) table of (s, b) per group, w = (q - 8) * s + b, in the
    activation dtype: b = (8 - z) * s (0 when symmetric); int4_gf's float minimum m: b = 8 * s + m. torch's
    CPU and CUDA kernels read the same table."""
    s = parts["scales"].float()  # (N, K / G)
    if fmt.kind is FormatKind.INT4_GF:
        b = 8 * s + parts["mins"].float() if fmt.zero_point else torch.zeros_like(s)
    else:
        b = (8 - (parts["zeros"].float() if fmt.zero_point else torch.full_like(s, 8.0))) * s
    return torch.stack([s, b], -1).transpose(0, 1).contiguous().to(fmt.torch_dtype)


def int4pack_linear(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_ref for an int4_g weight prepared by `prepare_int4pack`: x (..., K) -> (..., N) in x's dtype."""
    table = parts["scales_and_zeros"]
    assert x.dtype == table.dtype, f"x is {x.dtype}, the prepared scales {table.dtype}"
    return packed_linear(torch.ops.aten._weight_int4pack_mm_for_cpu, x, parts, fmt, bias)


def packed_linear(mm, x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) -> (..., N) through a packed int4 matmul `mm(x2d, packed, group_size, table)` (CPU or CUDA)."""
    table = parts["scales_and_zeros"]
    n, k = table.shape[1], table.shape[0] * fmt.group_size
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, the weight {k}"
    y = mm(x.reshape(-1, k).contiguous(), parts["int4pack"], fmt.group_size, table)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], n)


STORED = ("qweight", "scales", "zeros", "mins")  # the int4_g / int4_gf parts a prepared lm_head keeps (no act_order)


def prepare_int4pack_logits(params: dict[str, Param]) -> dict[str, Param]:
    """An lm_head node's params -> the weight's stored parts plus `prepare_int4pack`'s."""
    w = params["weight"]
    return {**params, "weight": Param({**w.parts, **prepare_int4pack(params)["weight"].parts}, w.format)}


def int4pack_logits(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format) -> torch.Tensor:
    """logits_ref for an int4_g lm_head prepared by `prepare_int4pack_logits`: x (M, K) -> (M, V) float32."""
    stored = {r: parts[r] for r in STORED if r in parts}
    return exact_top_logits(int4pack_linear(x, parts, fmt).float(), x, stored, fmt, top_k)
