"""DeepSeek-V2: Multi-head Latent Attention (an `mla_attention` node over a latent KV cache, the q path with or
without `q_lora_rank`) and a MoE MLP per transformers' DeepseekV2Moe: the router in fp32, softmax scores, top-k
`greedy` or `group_limited_greedy` (`n_group` groups, the best `topk_group` of them), the weights times
`routed_scaling_factor`, never renormalized (transformers ignores `norm_topk_prob`), plus `n_shared_experts`
shared experts (one dense MLP of n_shared_experts * moe_intermediate_size) added to the routed output. The
first `first_k_dense_replace` layers keep a dense MLP of `intermediate_size`.

Refused by name: norm_topk_prob=true and moe_layer_freq != 1 (transformers' DeepseekV2 ignores both, the
original code does not: optc will not pick one), rope scaling other than default, linear, llama3, longrope
and yarn (DeepSeek-V2's own: the table times its attention factor, the softmax scale times mscale_all_dim's
mscale squared), hidden_act other than silu."""

from __future__ import annotations

from optc.core.errors import UnsupportedModelError
from optc.core.ir import ModelConfig
from optc.core.rope import SUPPORTED_ROPE_TYPES, YARN
from optc.frontend.models.decoder import Layout, base_config, hf_fields, hf_rope

MODEL_TYPES = {"deepseek_v2": "DeepseekV2ForCausalLM"}
LAYOUTS = {"DeepseekV2ForCausalLM": Layout(float_router=True)}
TOPK_METHODS = ("greedy", "group_limited_greedy")


def config_from_hf(cfg: dict, arch: str, where: str) -> ModelConfig:
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported; supported: silu")
    method = cfg.get("topk_method") or "greedy"
    if method not in TOPK_METHODS:
        raise UnsupportedModelError(f"{where}: topk_method {method!r} is not supported; supported: "
                                    f"{', '.join(TOPK_METHODS)}")
    if cfg.get("norm_topk_prob"):
        raise UnsupportedModelError(f"{where}: norm_topk_prob=true is not supported: transformers' DeepseekV2 "
                                    "ignores it (the original code renormalizes), so optc refuses to choose")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise UnsupportedModelError(f"{where}: moe_layer_freq {cfg['moe_layer_freq']} is not supported: "
                                    "transformers' DeepseekV2 makes every layer from first_k_dense_replace on MoE")
    groups = (cfg.get("n_group") or 1) if method == "group_limited_greedy" else 1
    experts = cfg["n_routed_experts"]
    layers = cfg["num_hidden_layers"]
    family = dict(
        num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["moe_intermediate_size"], norm_topk_prob=False,
        dense_layers=tuple(range(min(cfg.get("first_k_dense_replace") or 0, layers))),
        shared_expert_intermediate_size=(cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"],
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        num_expert_groups=groups, topk_groups=(cfg.get("topk_group") or 1) if groups > 1 else 1,
        kv_lora_rank=cfg["kv_lora_rank"], q_lora_rank=cfg.get("q_lora_rank") or 0,
        qk_nope_head_dim=cfg["qk_nope_head_dim"], v_head_dim=cfg["v_head_dim"],
        attention_bias=bool(cfg.get("attention_bias", False)),
    )
    # transformers' config sets head_dim to qk_rope_head_dim: the rope table's width, as optc's head_dim
    return base_config({**cfg, "head_dim": cfg["qk_rope_head_dim"]}, arch, where, (*SUPPORTED_ROPE_TYPES, YARN),
                       **family)


def hf_config(config: ModelConfig) -> dict:
    from transformers import AutoConfig

    c = config
    fields = hf_fields(c)
    fields.pop("head_dim")
    groups = c.num_expert_groups > 1
    return AutoConfig.for_model(
        "deepseek_v2", **fields, rope_parameters=hf_rope(c), attention_bias=c.attention_bias,
        n_routed_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size, n_shared_experts=c.shared_expert_intermediate_size
        // c.moe_intermediate_size, routed_scaling_factor=c.routed_scaling_factor,
        topk_method="group_limited_greedy" if groups else "greedy", n_group=c.num_expert_groups if groups else None,
        topk_group=c.topk_groups if groups else None, norm_topk_prob=False,
        first_k_dense_replace=len(c.dense_layers), kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank or None,
        qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.head_dim, v_head_dim=c.v_head_dim).to_dict()
