"""Qwen3: the Llama block with a per-head RMSNorm on q and k before rope (QK-norm), no q/k/v bias,
head_dim not tied to hidden_size / heads, sliding layers from `max_window_layers` when enabled."""

from __future__ import annotations

from optc.core.errors import UnsupportedModelError
from optc.core.ir import ModelConfig
from optc.frontend.models.decoder import Layout, base_config, hf_fields, hf_rope

MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM"}
LAYOUTS = {"Qwen3ForCausalLM": Layout(qk_norm=True)}


def config_from_hf(cfg: dict, arch: str, where: str) -> ModelConfig:
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported; supported: silu")
    return base_config(cfg, arch, where)


def hf_config(config: ModelConfig) -> dict:
    from transformers import AutoConfig

    fields = hf_fields(config) | {"attention_bias": config.attention_bias}
    if config.layer_types:
        fields["use_sliding_window"] = True
    return AutoConfig.for_model("qwen3", **fields, rope_parameters=hf_rope(config)).to_dict()
