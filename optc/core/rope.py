"""Rotary tables from a model config: default, linear and llama3 rope scaling (as transformers).

`cos_sin_table(config, num_positions)` -> (P, head_dim) fp32 [cos | sin]. Other scaling types are
refused with the list of supported ones.
"""

from __future__ import annotations

import math

import torch

from optc.core.ir import ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_type(config: ModelConfig) -> str:
    rs = config.rope_scaling or {}
    return rs.get("rope_type", rs.get("type", "default"))


def inv_freq(config: ModelConfig) -> torch.Tensor:
    d = config.head_dim
    freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
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
    raise ValueError(f"rope scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def cos_sin_table(config: ModelConfig, num_positions: int) -> torch.Tensor:
    freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq(config))
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
