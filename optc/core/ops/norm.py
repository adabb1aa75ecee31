"""RMSNorm and the residual add fused with it: torch references and op specs.

Numerical policy (the same as transformers' LlamaRMSNorm): the mean of squares and the rsqrt are
fp32; the normalized value is cast to the input dtype before the weight multiplies it. The Triton
kernels (optc.kernels.norm) follow it.
"""

from __future__ import annotations

import torch

from optc.core.ops.spec import OpSpec, hidden_weight


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: (T, H), weight: (H,)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the sum is rounded to x's dtype first."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


def _rms_norm_call(fn, node, inputs, params, step):
    # rms_norm(x) {eps} [weight] -> normed
    return [fn(inputs[0], params["weight"].dense(), node.attrs["eps"])]


def _add_rms_norm_call(fn, node, inputs, params, step):
    # add_rms_norm(x, residual) {eps} [weight] -> normed, x + residual
    return list(fn(inputs[0], inputs[1], params["weight"].dense(), node.attrs["eps"]))


RMS_NORM = OpSpec(1, 1, ("eps",), ("weight",), hidden_weight, rms_norm_ref, _rms_norm_call)
ADD_RMS_NORM = OpSpec(2, 2, ("eps",), ("weight",), hidden_weight, add_rms_norm_ref, _add_rms_norm_call)
