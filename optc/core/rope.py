"""Rotary tables from a model config: default, linear, llama3, longrope and yarn scaling (as transformers).

`cos_sin_tables(config, num_positions)` -> {table name: (P, rotary_dim) fp32 [cos | sin]}: the
`GLOBAL` table every rope node reads unless its `rope_table` attr names `LOCAL`, the sliding layers'
own table (Gemma 3's local base, unscaled). rotary_dim is the config's (partial rotary) or head_dim.

LongRoPE (Phi-3): transformers' rotary module uses the long factors for a forward call whose longest
position reaches `original_max_position_embeddings`, the short ones otherwise. A paged cache keeps each
token's rotated key, so the table here picks per position: rows below the original length use the short
factors, rows from it on the long ones, which is what the rotary module gives a model stepped over its
KV cache. transformers' `generate` goes further for Phi-3: when a sequence first grows past the original
length it drops its cache and recomputes every position with the long factors; optc keeps the keys it
has (as vLLM does), so past that length its tokens may differ from `generate`'s. Both tables are
multiplied by the attention factor, as transformers does.
YaRN (DeepSeek-V2): frequencies blended between interpolated and extrapolated by a linear ramp over the
correction range, the table times the attention factor (`yarn_attention_factor`); DeepSeek's MLA also scales
its softmax by yarn_mscale(factor, mscale_all_dim)^2 (`ModelConfig.attention_scale`).
Other scaling types are refused with the list of supported ones.
"""

from __future__ import annotations

import math

import torch

from optc.core.ir import ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")  # every family's
YARN = "yarn"  # computed here, accepted only by the families whose parity test holds it (DeepSeek-V2)
GLOBAL = "global"
LOCAL = "local"


def rope_type(config: ModelConfig) -> str:
    rs = config.rope_scaling or {}
    return rs.get("rope_type", rs.get("type", "default"))


def rotary_dim(config: ModelConfig) -> int:
    return config.rotary_dim or config.head_dim


def base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def inv_freq(config: ModelConfig) -> torch.Tensor:
    """The global table's frequencies (for longrope: the short factors')."""
    freq = base_inv_freq(config.rope_theta, rotary_dim(config))
    kind, rs = rope_type(config), config.rope_scaling or {}
    if kind == "default":
        return freq
    if kind == "linear":
        return freq / rs["factor"]
    if kind == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "longrope":
        return freq / torch.tensor(rs["short_factor"], dtype=torch.float32)
    if kind == YARN:
        return _yarn_inv_freq(config, freq)
    raise ValueError(f"rope scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def cos_sin_tables(config: ModelConfig, num_positions: int) -> dict[str, torch.Tensor]:
    """Every table the config's rope nodes read, by name."""
    tables = {GLOBAL: _global_table(config, num_positions)}
    if config.local_rope_theta is not None:
        tables[LOCAL] = _table(torch.arange(num_positions, dtype=torch.float32),
                               base_inv_freq(config.local_rope_theta, rotary_dim(config)))
    return tables


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `scale` times the original (1 at or below it)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(config: ModelConfig) -> float:
    """The factor a yarn table's cos and sin are multiplied by (transformers' `attention_factor`)."""
    rs = config.rope_scaling or {}
    factor = _yarn_factor(config)
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return yarn_mscale(factor, rs["mscale"]) / yarn_mscale(factor, rs["mscale_all_dim"])
    return yarn_mscale(factor)


def _yarn_factor(config: ModelConfig) -> float:
    rs = config.rope_scaling
    return rs.get("factor") or config.max_position_embeddings / rs["original_max_position_embeddings"]


def _yarn_inv_freq(config: ModelConfig, freq: torch.Tensor) -> torch.Tensor:
    """transformers' _compute_yarn_parameters: the extrapolated frequencies (`freq`) inside the high-frequency
    end of the correction range, the interpolated ones (freq / factor) beyond its low end, a linear ramp between."""
    rs, dim, base = config.rope_scaling, rotary_dim(config), config.rope_theta
    original = rs["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rs.get("beta_fast") or 32), correction_dim(rs.get("beta_slow") or 1)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return freq / _yarn_factor(config) * (1 - extrapolation) + freq * extrapolation


def _global_table(config: ModelConfig, num_positions: int) -> torch.Tensor:
    positions = torch.arange(num_positions, dtype=torch.float32)
    if rope_type(config) == YARN:
        return _table(positions, inv_freq(config)) * yarn_attention_factor(config)
    if rope_type(config) != "longrope":
        return _table(positions, inv_freq(config))
    rs = config.rope_scaling
    original = rs["original_max_position_embeddings"]
    factor = rs.get("factor") or config.max_position_embeddings / original
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = base_inv_freq(config.rope_theta, rotary_dim(config)) / torch.tensor(rs["long_factor"], dtype=torch.float32)
    short_rows = _table(positions[:original], inv_freq(config))
    long_rows = _table(positions[original:], long)
    return torch.cat((short_rows, long_rows)) * attention_factor


def _table(positions: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    freqs = torch.outer(positions, freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
