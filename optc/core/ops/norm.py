"""RMSNorm and the residual add fused with it: torch references and op specs.

Numerical policy. A plain norm (Llama, Qwen, Phi) follows transformers' LlamaRMSNorm: the mean of
squares and the rsqrt are fp32, the normalized value is cast to the input dtype, then the weight
multiplies it. An offset norm (attr `offset`, Gemma's `1 + w`) follows Gemma's RMSNorm: the weight is
`offset + w` and the product is fp32, cast once at the end. The Triton kernels (optc.kernels.norm)
follow the same policy.

A per-head norm (attr `head_dim`: Qwen3's and Gemma 3's q/k norms) normalizes each head of a
(T, H * head_dim) value on its own, with one (head_dim,) weight shared by the heads; the adapter
reshapes, so an implementation sees rows of head_dim either way.
"""

from __future__ import annotations

import torch

from optc.core.ops.spec import OpSpec


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    # x: (T, H), weight: (H,)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (offset + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the sum is rounded to x's dtype first."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps, offset), summed


def norm_kwargs(node) -> dict:
    """The optional arguments a norm node passes its implementation (none for a plain norm, so a kernel
    that implements only the plain norm keeps its signature)."""
    offset = node.attrs.get("offset", 0.0)
    return {"offset": offset} if offset else {}


def _rms_norm_call(fn, node, inputs, params, step):
    # rms_norm(x) {eps, offset?, head_dim?} [weight] -> normed
    x, d = inputs[0], node.attrs.get("head_dim")
    rows = x if d is None else x.reshape(-1, d)  # per head: (T * H, D)
    out = fn(rows, params["weight"].dense(), node.attrs["eps"], **norm_kwargs(node))
    return [out if d is None else out.view(x.shape)]


def _add_rms_norm_call(fn, node, inputs, params, step):
    # add_rms_norm(x, residual) {eps, offset?} [weight] -> normed, x + residual
    return list(fn(inputs[0], inputs[1], params["weight"].dense(), node.attrs["eps"], **norm_kwargs(node)))


def _norm_weight(node, cfg) -> dict:
    return {"weight": (node.attrs.get("head_dim") or cfg.hidden_size,)}


RMS_NORM = OpSpec(1, 1, ("eps",), ("weight",), _norm_weight, rms_norm_ref, _rms_norm_call)
ADD_RMS_NORM = OpSpec(2, 2, ("eps",), ("weight",), _norm_weight, add_rms_norm_ref, _add_rms_norm_call)
