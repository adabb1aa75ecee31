"""AWQ (Lin et al. 2023) for one group of linears that share an input, pure torch, fp32.

1. Scale search: s = mean|x|^α per input channel over α = i / n_grid, i = 0 .. n_grid - 1 (AutoAWQ's
   grid; α = 0 is plain RTN, so the chosen scales never do worse than RTN on the searched
   output), normalized s / sqrt(max(s)·min(s)) as AutoAWQ does. For each α the group's weights
   become Q(W·diag(s))·diag(s)⁻¹ and the caller's `forward` computes the block output; the α
   with the least mean squared output error wins (the first on an exact tie). Every α's error is kept
   (`ScaleSearch.losses`, recorded per group in the pass stats): a CPU and a GPU build agree when
   their curves do, whichever α a near-tie lets each pick (tests/test_build_device.py).
2. The caller folds 1/s into the op before the group (`fold_into_norm`, `fold_into_linear`) and
   s into the group's weights; the group's input becomes x/s.
3. Clip search per linear (AutoAWQ's `_search_best_clip`): for each output row and group, the
   max |w| shrunk by (1 - i/n_grid), i < max_shrink·n_grid, minimizing the group's partial output
   error on (a strided subsample of) the scaled inputs.
4. Round-to-nearest with those clip values (`rtn.quantize_weight(..., clip=...)`).
The pass (passes/quantize_awq.py) runs these steps for every group of a block: first 1 and 2 for each
group in order, then 3 and 4 on the inputs the block computes with every group's scales folded in.

Everything is computed in fp32 whatever the model dtype: SmolLM2's residual channels reach
~25,000, so fp16 statistics or products overflow. Non-finite scales are replaced by 1.
This module takes tensors and callables, not IR objects; which linears form a group and what the
block's forward is comes from the pass (passes/quantize_awq.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from optc.core.formats import Format
from optc.frontend.quant.rtn import fake_quantize

Forward = Callable[[list[torch.Tensor]], torch.Tensor]  # the group's weights (fp32) -> block output


@dataclass(frozen=True)
class ScaleSearch:
    scales: torch.Tensor  # (K,) fp32, multiply the group's weight columns, divide its input
    alpha: float
    error: float  # block output MSE with the chosen scales
    rtn_error: float  # block output MSE of plain RTN (α = 0)
    losses: tuple[float, ...] = ()  # block output MSE at each α = i / n_grid


def input_mean(x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """mean |x| per channel over all rows of x (..., K), fp32, in chunks of rows."""
    x = x.reshape(-1, x.shape[-1])
    total = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device)
    for i in range(0, x.shape[0], chunk):
        total += x[i:i + chunk].float().abs().sum(0)
    return total / x.shape[0]


def search_scale(x_mean: torch.Tensor, weights: Sequence[torch.Tensor], forward: Forward, fmt: Format,
                 n_grid: int = 20) -> ScaleSearch:
    """Per-input-channel scales minimizing the block output error (see module docstring)."""
    ws = [w.float() for w in weights]
    x_mean = x_mean.float()
    reference = forward(ws).float()
    best: tuple[float, float, torch.Tensor] | None = None
    losses = []
    for i in range(n_grid):
        alpha = i / n_grid
        s = scales_for(x_mean, alpha)
        out = forward([fake_quantize(w * s, fmt) / s for w in ws]).float()
        losses.append(float((out - reference).pow(2).mean()))
        if best is None or losses[-1] < best[0]:
            best = (losses[-1], alpha, s)
    assert best is not None, "n_grid must be positive"
    return ScaleSearch(best[2], best[1], best[0], losses[0], tuple(losses))


def scales_for(x_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^α, clamped at 1e-4, normalized by sqrt(max·min); non-finite entries -> 1."""
    s = x_mean.float().pow(alpha).clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def search_clip(x: torch.Tensor, w: torch.Tensor, fmt: Format, n_grid: int = 20, max_shrink: float = 0.5,
                num_tokens: int = 512, rows_per_chunk: int = 256) -> torch.Tensor:
    """Per (row, group) clip value max|w|·(1 - i/n_grid) minimizing that group's output error.

    x (..., K) are the linear's inputs (already divided by the AWQ scales), w (N, K).
    -> (N, K // G) fp32.
    """
    if fmt.group_size is None:
        raise ValueError(f"clip search is for grouped int4 formats, not {fmt.kind.value}")
    n, k = w.shape
    g = fmt.group_size
    x = x.reshape(-1, k)
    x = x[::max(1, x.shape[0] // num_tokens)].float()
    xg = x.reshape(-1, k // g, g).transpose(0, 1)  # (K/G, T, G)
    best = []
    for r0 in range(0, n, rows_per_chunk):
        wc = w[r0:r0 + rows_per_chunk].float()
        rows = wc.shape[0]
        wg = wc.reshape(rows, k // g, g)
        max_abs = wg.abs().amax(-1)  # (rows, K/G)
        reference = _group_out(xg, wg)
        best_err = torch.full_like(max_abs, float("inf"))
        best_clip = max_abs.clone()
        for i in range(int(max_shrink * n_grid)):
            clip = max_abs * (1 - i / n_grid)
            q = fake_quantize(wc, fmt, clip=clip).reshape(rows, k // g, g)
            err = (_group_out(xg, q) - reference).pow(2).mean(1).T  # (rows, K/G)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_clip = torch.where(better, clip, best_clip)
        best.append(best_clip)
    return torch.cat(best)


def fold_into_norm(norm_weight: torch.Tensor, scales: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm weight (K,) -> weight / s, in the norm weight's dtype (division in fp32). A norm that weighs by
    offset + w (Gemma's 1 + w) gets w' with offset + w' = (offset + w) / s."""
    return ((offset + norm_weight.float()) / scales - offset).to(norm_weight.dtype)


def fold_into_linear(prev_weight: torch.Tensor, scales: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
    """Weight (N, K_in) of the linear producing the group's input -> its `rows` (default: all; K of them)
    divided by s, in the weight's dtype (division in fp32). `rows` picks the group's input out of a fused
    linear's outputs (the v rows of a qkv linear, the up rows of a gate-up linear)."""
    out = prev_weight.float().clone()
    rows = slice(None) if rows is None else rows
    out[rows] = out[rows] / scales[:, None]
    return out.to(prev_weight.dtype)


def _group_out(xg: torch.Tensor, wg: torch.Tensor) -> torch.Tensor:
    """Per-group partial products: xg (K/G, T, G), wg (N, K/G, G) -> (K/G, T, N)."""
    return torch.bmm(xg, wg.permute(1, 2, 0))
