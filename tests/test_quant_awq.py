"""AWQ on one group of linears: scale search, clip search, folding, and error below RTN."""

import pytest
import torch

from optc.core.formats import dequantize, linear_ref
from optc.frontend.quant.awq import (
    fold_into_linear,
    fold_into_norm,
    input_mean,
    scales_for,
    search_clip,
    search_scale,
)
from optc.frontend.quant.rtn import fake_quantize, make_format, quantize_weight

FMT = make_format(4, 64, True, "float16")


def _rms_norm(h, weight):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def _block(seed=0, k=128, n=96, tokens=512):
    """Residual input with outlier channels (one of them ~25,000, like SmolLM2), a norm, gate/up."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, k, generator=g)
    h[:, 3] *= 25_000
    h[:, [10, 77]] *= 40
    gamma = 1 + 0.1 * torch.randn(k, generator=g)
    gamma[3] = 1e-3  # the model learnt to tame the massive channel in the norm, as real models do
    wg, wu = torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, k, generator=g) / k**0.5
    return h, gamma, wg, wu


def _mlp(x, wg, wu):
    return torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)


def test_awq_beats_rtn_with_outlier_channels_after_folding():
    h, gamma, wg, wu = _block()
    x = _rms_norm(h, gamma)
    # the steps of passes/quantize_awq.py for one group: scale search, 1/s folded into the (fp16) norm,
    # s into the weights, then clip search and rounding on the inputs the folded norm computes
    found = search_scale(input_mean(x), [wg, wu], lambda ws: _mlp(x, *ws), FMT)
    assert found.alpha > 0 and found.error < found.rtn_error
    s = found.scales
    x_folded = _rms_norm(h, fold_into_norm(gamma.half().float(), s).half().float())
    parts = [quantize_weight(w * s, FMT, clip=search_clip(x_folded, w * s, FMT)) for w in (wg, wu)]
    y_awq = torch.nn.functional.silu(linear_ref(x_folded, parts[0], FMT)) * linear_ref(x_folded, parts[1], FMT)
    y_rtn = _mlp(x, fake_quantize(wg, FMT), fake_quantize(wu, FMT))
    reference = _mlp(x, wg, wu)
    err_awq = (y_awq - reference).pow(2).mean()
    err_rtn = (y_rtn - reference).pow(2).mean()
    assert err_awq < 0.7 * err_rtn


def test_scale_search_at_alpha_zero_is_rtn():
    h, gamma, wg, wu = _block()
    x = _rms_norm(h, gamma)
    found = search_scale(input_mean(x), [wg], lambda ws: x @ ws[0].T, FMT, n_grid=1)
    assert found.alpha == 0 and torch.equal(found.scales, torch.ones(128))
    rtn = (x @ fake_quantize(wg, FMT).T - x @ wg.T).pow(2).mean()
    assert found.error == pytest.approx(float(rtn), rel=1e-6)


def test_scales_are_normalized_and_finite():
    x_mean = torch.tensor([0.0, 1.0, 4.0, 25_000.0, float("inf")])
    s = scales_for(x_mean, 0.5)
    assert torch.isfinite(s).all()
    finite = scales_for(x_mean[:4], 0.5)
    torch.testing.assert_close(finite.max() * finite.min(), torch.tensor(1.0))
    torch.testing.assert_close(finite[2] / finite[1], torch.tensor(2.0))


def test_clip_search_never_worse_than_no_clip():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 128, generator=g)
    w = torch.randn(40, 128, generator=g)
    w[:, 5] *= 8  # a weight outlier per row: clipping it helps the rest of its group
    clip = search_clip(x, w, FMT)
    max_abs = w.reshape(40, 2, 64).abs().amax(-1)
    assert clip.shape == (40, 2) and (clip <= max_abs).all() and (clip >= 0.5 * max_abs).all()
    assert (clip < max_abs).any()
    w_clip = dequantize(quantize_weight(w, FMT, clip=clip), FMT, torch.float32)
    err_clip = (x @ w_clip.T - x @ w.T).pow(2).mean()
    err_rtn = (x @ fake_quantize(w, FMT).T - x @ w.T).pow(2).mean()
    assert err_clip < err_rtn
    assert torch.equal(search_clip(x, w, FMT, rows_per_chunk=7), clip)  # chunking changes nothing


def test_folding_keeps_the_float_function():
    g = torch.Generator().manual_seed(2)
    s = torch.rand(16, generator=g) + 0.5
    prev = torch.randn(16, 8, generator=g)
    w = torch.randn(4, 16, generator=g)
    x = torch.randn(3, 8, generator=g)
    torch.testing.assert_close((x @ fold_into_linear(prev, s).T) @ (w * s).T, (x @ prev.T) @ w.T)
    torch.testing.assert_close(fold_into_norm(torch.ones(16), s), 1 / s)
    fused = torch.randn(24, 8, generator=g)  # e.g. a qkv linear whose rows 8..24 are the group's input
    folded = fold_into_linear(fused, s, slice(8, 24))
    assert torch.equal(folded[:8], fused[:8])
    torch.testing.assert_close((x @ folded[8:].T) @ (w * s).T, (x @ fused[8:].T) @ w.T)


def test_folding_into_an_offset_norm_keeps_the_float_function():
    # Gemma's norm weighs by (1 + w): folding 1/s must give (1 + w') = (1 + w) / s, not w / s
    from optc.core.ops.norm import rms_norm_ref

    g = torch.Generator().manual_seed(3)
    s, w = torch.rand(16, generator=g) + 0.5, 0.1 * torch.randn(16, generator=g)
    x = torch.randn(5, 16, generator=g)
    folded = fold_into_norm(w, s, offset=1.0)
    torch.testing.assert_close(rms_norm_ref(x, folded, 1e-6, offset=1.0), rms_norm_ref(x, w, 1e-6, offset=1.0) / s)
    assert not torch.allclose(folded, fold_into_norm(w, s))


def test_clip_search_needs_int4():
    with pytest.raises(ValueError, match="clip search is for grouped int4"):
        search_clip(torch.zeros(4, 64), torch.zeros(4, 64), make_format(8))
