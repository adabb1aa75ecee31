"""SmoothQuant's smoothing factors (Xiao et al. 2022), pure torch, fp32.

A linear group (the linears reading one value x (T, K)) computes x @ Wᵀ = (x / s) @ (W · diag s)ᵀ for
any per-input-channel s > 0. Activation outliers live in a few input channels across tokens, while
weights are smooth; dividing x by s and multiplying the weight columns by s moves the difficulty
from activations (quantized per token, at run time) to weights (quantized per output channel,
offline). With a = max_t |x_tj| over the calibration tokens and w = max |W_:j| over every linear of
the group (eq. 4 of the paper):

    s_j = a_j^α / w_j^(1 − α)

α = 0.5 splits the range evenly; larger α moves more into the weights. As the reference
implementation, both maxima are clamped at 1e-5 before the powers and s at 1e-5 after. A channel
that never fires (a_j = 0) or whose weight columns are all zero keeps s_j = 1: nothing to migrate.
The caller folds 1/s into the op that produced x (`optc.frontend.quant.awq.fold_into_norm` /
`fold_into_linear`) and s into the group's weight columns.
"""

from __future__ import annotations

import torch

MIN_MAX = 1e-5  # the reference implementation's clamp of both maxima and of the factors


def channel_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| per channel over every row of x (..., K): (K,) fp32."""
    return x.reshape(-1, x.shape[-1]).float().abs().amax(0)


def smooth_factors(act_max: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """s (K,) fp32 from the activations' and the weights' per-channel maxima (module docstring)."""
    a, w = act_max.float(), weight_max.float()
    s = (a.clamp(min=MIN_MAX).pow(alpha) / w.clamp(min=MIN_MAX).pow(1 - alpha)).clamp(min=MIN_MAX)
    keep = (a > 0) & (w > 0) & torch.isfinite(s)
    return torch.where(keep, s, torch.ones_like(s))
