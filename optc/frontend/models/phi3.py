"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): the Llama block with q/k/v fused into one `qkv_proj` and
gate/up into one `gate_up_proj` in the checkpoint, partial rotary (`partial_rotary_factor`), LongRoPE
(short and long factors; optc/core/rope.py says how a paged cache applies them) and, where configured,
a sliding window on every layer."""

from __future__ import annotations

from optc.core.errors import UnsupportedModelError
from optc.core.ir import SLIDING_ATTENTION, ModelConfig
from optc.frontend.models.decoder import Layout, base_config, hf_fields, hf_rope

MODEL_TYPES = {"phi3": "Phi3ForCausalLM"}
LAYOUTS = {"Phi3ForCausalLM": Layout(fused_qkv=True, fused_gate_up=True)}


def config_from_hf(cfg: dict, arch: str, where: str) -> ModelConfig:
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported; supported: silu")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type")) == "longrope":
        rope.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        rope["rope_type"] = "longrope"
        rope.pop("type", None)
    cfg = {**cfg, "rope_parameters": rope}
    if cfg.get("sliding_window"):
        cfg["layer_types"] = [SLIDING_ATTENTION] * cfg["num_hidden_layers"]
    return base_config(cfg, arch, where)


def hf_config(config: ModelConfig) -> dict:
    from transformers import AutoConfig

    fields = hf_fields(config)
    fields.pop("layer_types", None)  # Phi-3's config knows one window for every layer
    fields["sliding_window"] = config.sliding_window
    rope = hf_rope(config)
    if "original_max_position_embeddings" in rope:
        fields["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    return AutoConfig.for_model("phi3", **fields, rope_parameters=rope).to_dict()
