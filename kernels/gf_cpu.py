"""CPU linears and lm_heads for the GGUF kinds (int4_gf, int8_gf; int4_gf's int4 matmul is int4_cpu's).

`int8gf_int4x2_linear`: an int8_gf weight (codes q, float32 scale s and minimum m per group of 32) as two
int4 weights on torch's packed int4 matmul (`aten._weight_int4pack_mm_for_cpu`, w = (u - 8) * scale + bias per
group). With u = q + 128 = 16 h + l (h, l in [0, 15]):
    w = s * q + m = 16 s * (h - 8) + s * (l - 8) + (8 s + m)
so y = mm(x, h, (16 s, 0)) + mm(x, l, (s, 8 s + m)): the codes are split exactly and the int4 kernel reads as
many bytes as the int8 weight has. Its roundings beyond the reference's: the table in the activation dtype
(bfloat16: s, 16 s and 8 s + m to 8 bits), each product's output in that dtype, and their sum
(tests/test_gguf_keep.py bounds them). torch's int4 kernel takes groups of 32 or more: Q6_K's groups of 16
are not offered. Measured on SmolLM2's 49152 x 576 lm_head at M = 1 (2 threads, AVX-512): 3.5 ms against
8.6 ms for the bf16 matmul; at M = 8 it loses (13.9 against 11.5 ms), and select_kernels measures per M.

`widened_linear`: the weight dequantized once into the activation dtype when the node first runs (twice the
bytes of bf16's int8 codes, held beside them), then a dense matmul: the reference's exact product (the
reference dequantizes into x's dtype on every call), at dense speed; the choice at prefill sizes and for
groups of 16. The `*_logits` launchers are the lm_head's: the same matmul, then logits_ref's fp32 recompute of
each row's best logits from the stored parts (optc.core.ops.linear.exact_top_logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optc.core.formats import Format, dequantize
from optc.core.ops import Param
from optc.core.ops.linear import exact_top_logits
from optc.kernels.cpu_ext.ops import top_k

INNER_K_TILES = 2  # as int4_cpu: the packing's K tile count
STORED = ("qweight", "scales", "mins")  # the GGUF kinds' parts, kept beside a prepared lm_head's for the recompute


def prepare_int8gf_int4x2(params: dict[str, Param]) -> dict[str, Param]:
    """A node's params -> the weight as {"high", "low"} int4 packs and their (K / G, N, 2) tables."""
    w = params["weight"]
    fmt, parts = w.format, w.parts
    u = parts["qweight"].to(torch.int32) + 128  # (N, K) in [0, 255]
    s = parts["scales"]  # (N, K / G) float32
    m = parts["mins"] if fmt.zero_point else torch.zeros_like(s)

    def pack(codes: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), INNER_K_TILES)

    def table(scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # (N, K / G) x 2 -> (K / G, N, 2)
        return torch.stack([scale, bias], -1).transpose(0, 1).contiguous().to(fmt.torch_dtype)

    prepared = {"high": pack(u >> 4), "low": pack(u & 15), "high_table": table(16 * s, torch.zeros_like(s)),
                "low_table": table(s, 8 * s + m)}
    return {**params, "weight": Param({**{r: parts[r] for r in STORED if r in parts}, **prepared}, fmt)}


def int8gf_int4x2_linear(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_ref for an int8_gf weight prepared by `prepare_int8gf_int4x2`: x (..., K) -> (..., N) in x's dtype."""
    hi, lo = parts["high_table"], parts["low_table"]
    assert x.dtype == hi.dtype, f"x is {x.dtype}, the prepared tables {hi.dtype}"
    n, k = hi.shape[1], hi.shape[0] * fmt.group_size
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, the weight {k}"
    x2 = x.reshape(-1, k).contiguous()
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    y = mm(x2, parts["high"], fmt.group_size, hi) + mm(x2, parts["low"], fmt.group_size, lo)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], n)


def int8gf_int4x2_logits(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format) -> torch.Tensor:
    """logits_ref for an int8_gf lm_head prepared by `prepare_int8gf_int4x2`: x (M, K) -> (M, V) float32."""
    stored = {r: parts[r] for r in STORED if r in parts}
    return exact_top_logits(int8gf_int4x2_linear(x, parts, fmt).float(), x, stored, fmt, top_k)


def prepare_widened(params: dict[str, Param]) -> dict[str, Param]:
    """A node's params -> the stored parts plus `dense`: the weight dequantized into the activation dtype."""
    w = params["weight"]
    dense = dequantize(w.parts, w.format)  # the format's dtype: the activations' (the cast pass sets it)
    return {**params, "weight": Param({**w.parts, "dense": dense}, w.format)}


def widened_linear(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_ref for a GGUF-kind weight prepared by `prepare_widened`: x (..., K) -> (..., N) in x's dtype."""
    w = parts["dense"]
    assert x.dtype == w.dtype, f"x is {x.dtype}, the widened weight {w.dtype}"
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def widened_logits(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format) -> torch.Tensor:
    """logits_ref for a GGUF-kind lm_head prepared by `prepare_widened`: x (M, K) -> (M, V) float32."""
    stored = {r: parts[r] for r in STORED if r in parts}
    return exact_top_logits(widened_linear(x, parts, fmt).float(), x, stored, fmt, top_k)
