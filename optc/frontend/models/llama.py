"""The Llama family: Llama 2/3 (with rope scaling), Mistral (every layer sliding), Qwen2 (q/k/v bias,
sliding layers from `max_window_layers`), SmolLM2; tied or untied embeddings. Llama's layout is the
decoder template's default (optc/frontend/models/decoder.py)."""

from __future__ import annotations

from optc.core.errors import UnsupportedModelError
from optc.core.ir import SLIDING_ATTENTION, ModelConfig
from optc.frontend.models.decoder import Layout, base_config, hf_fields, hf_rope

MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
LAYOUTS = dict.fromkeys(MODEL_TYPES.values(), Layout())


def config_from_hf(cfg: dict, arch: str, where: str) -> ModelConfig:
    """A transformers config dict of a Llama-family `arch` -> ModelConfig; errors name what is not supported."""
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{where}: mlp_bias=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported; supported: silu")
    if arch == "MistralForCausalLM" and cfg.get("sliding_window"):  # Mistral slides every layer
        cfg = {**cfg, "layer_types": [SLIDING_ATTENTION] * cfg["num_hidden_layers"]}
    return base_config(cfg, arch, where, attention_bias=bool(cfg.get("attention_bias", False))
                       or arch == "Qwen2ForCausalLM")


def hf_config(config: ModelConfig) -> dict:
    """The transformers config.json of a model config, for its own architecture (Llama, Mistral, Qwen2)."""
    from transformers import AutoConfig

    c = config
    model_type = {arch: t for t, arch in MODEL_TYPES.items()}[c.architecture]
    fields = hf_fields(c)
    if model_type == "mistral":  # Mistral's config knows one window for every layer
        fields.pop("layer_types", None)
        fields["sliding_window"] = c.sliding_window
    if model_type == "qwen2" and c.layer_types:
        fields["use_sliding_window"] = True
    extra = {"attention_bias": c.attention_bias} if model_type == "llama" else {}
    return AutoConfig.for_model(model_type, **fields, rope_parameters=hf_rope(c), **extra).to_dict()
