"""Gemma 2 and Gemma 3 (text): RMSNorm as x * (1 + w) in fp32, four norms per block (before and after
attention and the MLP), GeGLU (tanh GELU), the embedding scaled by sqrt(hidden_size), attention scaled
by query_pre_attn_scalar ** -0.5, tied embeddings, sliding (local) and global layers. Gemma 2 soft-caps
attention scores and the final logits; Gemma 3 has QK-norm instead and two rope tables, the local
layers' own base (`rope_local_base_freq`) unscaled and the global one with its own scaling."""

from __future__ import annotations

from dataclasses import replace

from optc.core.errors import UnsupportedModelError
from optc.core.ir import ModelConfig
from optc.frontend.models.decoder import Layout, base_config, hf_fields, hf_rope, rope_fields

MODEL_TYPES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
_GEMMA = Layout(norm_offset=1.0, sandwich_norms=True, mlp_norm="pre_feedforward_layernorm", embedding_scale=True)
LAYOUTS = {"Gemma2ForCausalLM": _GEMMA, "Gemma3ForCausalLM": replace(_GEMMA, qk_norm=True)}
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def config_from_hf(cfg: dict, arch: str, where: str) -> ModelConfig:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{where}: hidden_activation {act!r} is not supported; supported: "
                                    f"{', '.join(ACTIVATIONS)}")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{where}: use_bidirectional_attention=true (an encoder) is not supported")
    family = dict(hidden_act=ACTIVATIONS[act], query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
                  final_logit_softcap=cfg.get("final_logit_softcapping"))
    if arch == "Gemma2ForCausalLM":
        return base_config(cfg, arch, where, attn_logit_softcap=cfg.get("attn_logit_softcapping"), **family)
    rope = cfg.get("rope_parameters") or {}  # Gemma 3: one table per layer type
    local = rope_fields(rope.get("sliding_attention") or {}, cfg, where)
    if local["rope_scaling"] or local["rotary_dim"]:
        raise UnsupportedModelError(f"{where}: scaled or partial rope on the sliding layers is not supported")
    return base_config({**cfg, "rope_parameters": rope.get("full_attention") or {}}, arch, where,
                       local_rope_theta=local["rope_theta"], **family)


def hf_config(config: ModelConfig) -> dict:
    from transformers import AutoConfig

    c = config
    fields = hf_fields(c) | {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": c.query_pre_attn_scalar,
                             "final_logit_softcapping": c.final_logit_softcap}
    if c.architecture == "Gemma2ForCausalLM":
        return AutoConfig.for_model("gemma2", **fields, attn_logit_softcapping=c.attn_logit_softcap,
                                    rope_parameters=hf_rope(c)).to_dict()
    local = {"rope_type": "default", "rope_theta": c.local_rope_theta}
    return AutoConfig.for_model("gemma3_text", **fields, rope_parameters={"full_attention": hf_rope(c),
                                                                           "sliding_attention": local}).to_dict()
