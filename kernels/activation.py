"""The gated MLP activation on the fused gate-up output: Triton kernel for
optc.core.ops.elementwise.gated_act_ref, SwiGLU (`act="silu"`: Llama, Qwen, Phi) and GeGLU
(`act="gelu_tanh"`: Gemma's tanh-approximated GELU).

`gated_act(x)` takes x: (T, 2 * I) = [gate | up]; `gated_act(gate, up)` takes the two halves as
separate (T, I) views, e.g. two strided column slices of one (T, 2I) tensor (only the last dim must
be contiguous). Numerical policy (matches the reference in x's dtype, as transformers does):
act(gate) is computed in fp32 and rounded to the dtype, then multiplied by up in fp32 and rounded.

gelu_tanh(g) = 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), in torch's own expression
(approximate="tanh"), with tanh(|y|) = (1 - t) / (1 + t), t = e^(-2|y|) (no overflow; Triton has no
tanh the interpreter also runs). The fp32 value is within a few ulps of tanh near -1 of torch's (an
absolute 5e-7 at most), so after the rounding to the dtype it carries torch's bits except where
torch's value sits that close to a rounding boundary (about 1% of fp16 outputs).

Tests compare it with its op's torch reference (optc.core.ops), on the CPU under TRITON_INTERPRET=1;
GeGLU is also compiled for sm_90, not yet run on a GPU (docs/PERF.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optc.kernels._dot import to_dtype

BLOCK_I = 1024
ACTS = ("silu", "gelu_tanh")  # the ACT constexpr is the index


@triton.jit
def _gated_act_kernel(
    # pointers
    gate_ptr, up_ptr, out_ptr,
    # sizes
    inter,
    # strides (rows; columns are contiguous)
    stride_g, stride_u, stride_o,
    # meta: ACT 0 silu, 1 gelu_tanh
    ACT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, gated(g, u, ACT, out_ptr.dtype.element_ty, False), mask=mask)


@triton.jit
def gated(g, u, ACT: tl.constexpr, DTYPE: tl.constexpr, RNE_BF16: tl.constexpr):
    # act(g) * u from fp32 g, u: act(g) in fp32 rounded to DTYPE, times u in fp32, rounded to DTYPE (the
    # fused MoE kernel's gate_up epilogue shares it; RNE_BF16: _dot.to_dtype's)
    if ACT == 0:
        act = g / (1.0 + tl.exp(-g))
    else:  # torch's 0.5 g (1 + tanh(y)); tanh(|y|) = (1 - t) / (1 + t), t = e^(-2|y|) in (0, 1]
        inner = g + 0.044715 * g * g * g  # y / sqrt(2 / pi)
        t = tl.exp2(-2.302208198144325 * tl.abs(inner))  # 2 sqrt(2 / pi) log2 e: e^(-2|y|) as exp2
        tanh = (1.0 - t) / (1.0 + t)
        act = 0.5 * g * (1.0 + tl.where(inner < 0, -tanh, tanh))
    return to_dtype(to_dtype(act, DTYPE, RNE_BF16).to(tl.float32) * u, DTYPE, RNE_BF16)


def gated_act(x: torch.Tensor, up: torch.Tensor | None = None, act: str = "silu") -> torch.Tensor:
    """act(gate) * up; gate, up = x.chunk(2, -1) when `up` is None, else gate = x."""
    assert act in ACTS, f"activation {act!r}: this kernel computes {' and '.join(ACTS)}"
    if up is None:
        assert x.shape[-1] % 2 == 0, f"last dim {x.shape[-1]} of [gate | up] must be even"
        gate, up = x.chunk(2, dim=-1)
    else:
        gate = x
    assert gate.shape == up.shape, f"gate {list(gate.shape)} != up {list(up.shape)}"
    assert gate.dtype == up.dtype, f"gate dtype {gate.dtype} != up dtype {up.dtype}"
    assert gate.dim() == 2, f"expected (T, I) inputs, got {list(gate.shape)}"
    assert gate.stride(-1) == 1 and up.stride(-1) == 1, "gate/up columns must be contiguous"
    num_tokens, inter = gate.shape
    out = torch.empty((num_tokens, inter), dtype=gate.dtype, device=gate.device)
    grid = lambda meta: (num_tokens, triton.cdiv(inter, meta["BLOCK"]))
    _gated_act_kernel[grid](
        gate, up, out, inter, gate.stride(0), up.stride(0), out.stride(0),
        ACT=ACTS.index(act), BLOCK=min(BLOCK_I, triton.next_power_of_2(inter)), num_warps=4,
    )
    return out
