"""Mixtral: the Mistral block (every layer sliding when `sliding_window` is set) whose MLP is a `moe` block
of `num_local_experts` experts, softmax over all experts then the top `num_experts_per_tok`, renormalized
(transformers' MixtralTopKRouter), the weights multiplied in fp32."""

from __future__ import annotations

from optc.core.errors import UnsupportedModelError
from optc.core.ir import SLIDING_ATTENTION, ModelConfig
from optc.frontend.models.decoder import Layout, base_config, hf_fields, hf_rope

MODEL_TYPES = {"mixtral": "MixtralForCausalLM"}
LAYOUTS = {"MixtralForCausalLM": Layout(checkpoint_experts=("block_sparse_moe", "w1", "w3", "w2"))}


def config_from_hf(cfg: dict, arch: str, where: str) -> ModelConfig:
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported; supported: silu")
    if cfg.get("sliding_window"):
        cfg = {**cfg, "layer_types": [SLIDING_ATTENTION] * cfg["num_hidden_layers"]}
    return base_config(cfg, arch, where, num_experts=cfg["num_local_experts"],
                       num_experts_per_tok=cfg["num_experts_per_tok"],
                       moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)


def hf_config(config: ModelConfig) -> dict:
    from transformers import AutoConfig

    c = config
    fields = hf_fields(c)
    fields.pop("layer_types", None)  # Mixtral's config knows one window for every layer
    fields["sliding_window"] = c.sliding_window
    return AutoConfig.for_model("mixtral", **fields, rope_parameters=hf_rope(c), num_local_experts=c.num_experts,
                                num_experts_per_tok=c.num_experts_per_tok).to_dict()
