"""Qwen3-MoE: the Qwen3 block (QK-norm) whose MLP is a `moe` block (softmax over all experts, the top
`num_experts_per_tok`, renormalized when `norm_topk_prob`, the weights rounded to the activation dtype:
transformers' Qwen3MoeTopKRouter), except the layers `mlp_only_layers` and `decoder_sparse_step` keep
dense (`ModelConfig.dense_layers`, an MLP of `intermediate_size`)."""

from __future__ import annotations

from optc.core.errors import UnsupportedModelError
from optc.core.ir import SLIDING_ATTENTION, ModelConfig
from optc.frontend.models.decoder import Layout, base_config, hf_fields, hf_rope

MODEL_TYPES = {"qwen3_moe": "Qwen3MoeForCausalLM"}
LAYOUTS = {"Qwen3MoeForCausalLM": Layout(qk_norm=True, round_route_weights=True)}


def config_from_hf(cfg: dict, arch: str, where: str) -> ModelConfig:
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported; supported: silu")
    layers, step = cfg["num_hidden_layers"], cfg.get("decoder_sparse_step", 1)
    num_experts = cfg.get("num_local_experts", cfg.get("num_experts", 0))
    if not num_experts or step < 1:
        raise UnsupportedModelError(f"{where}: num_experts {num_experts} and decoder_sparse_step {step}: a "
                                    "Qwen3-MoE model needs num_experts >= 1 and decoder_sparse_step >= 1")
    only = set(cfg.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    if cfg.get("sliding_window"):  # transformers keeps it only when use_sliding_window: then every layer slides
        cfg = {**cfg, "layer_types": [SLIDING_ATTENTION] * layers}
    return base_config(cfg, arch, where, num_experts=num_experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                       moe_intermediate_size=cfg["moe_intermediate_size"],
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense,
                       attention_bias=bool(cfg.get("attention_bias", False)))


def hf_config(config: ModelConfig) -> dict:
    from transformers import AutoConfig

    c = config
    fields = hf_fields(c) | {"attention_bias": c.attention_bias}
    fields.pop("layer_types", None)
    fields |= {"use_sliding_window": bool(c.layer_types), "sliding_window": c.sliding_window}
    return AutoConfig.for_model("qwen3_moe", **fields, rope_parameters=hf_rope(c), num_experts=c.num_experts,
                                num_experts_per_tok=c.num_experts_per_tok,
                                moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                                decoder_sparse_step=1, mlp_only_layers=list(c.dense_layers)).to_dict()
