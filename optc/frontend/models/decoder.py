"""The decoder every supported family is: one graph template over transformers' parameter names, and
the config fields every family reads the same way.

A family differs from Llama by data: its `Layout` (where its norms sit and how they weigh, q/k norms,
a scaled embedding, projections fused in the checkpoint) and its `ModelConfig` (activation, attention
scale and soft-caps, per-layer sliding windows, rope tables, partial rotary). `graph_for` turns both into
op attributes (optc/core/ops): a norm's `offset` and `head_dim`, `gated_act`'s `act`, an attention's
`scale`, `softcap` and `window`, a rope's `rope_table` and `rotary_dim`, the embedding's `scale` and the
lm_head's `softcap`.

    h = embedding(ids) {scale?}
    per layer i:  x = rms_norm(h)                                          input_layernorm
                  q, k, v = linear(x) ...                                  (one qkv_proj when fused)
                  q, k = rms_norm(q), rms_norm(k) {head_dim}               q_norm, k_norm (qk_norm)
                  q, k = rope(q, k) ;  a = attention(q, k, v) ;  o = linear(a)
                   or q = linear(rms_norm(linear(x))) or linear(x)         MLA (DeepSeek-V2): q_a, q_b or q_proj
                      kv = linear(x) ;  a = mla_attention(q, kv) ;  o = linear(a)   [kv_a_layernorm, kv_b_proj]
                  o = rms_norm(o)                                          post_attention_layernorm (sandwich)
                  h = add(h, o) ;  x = rms_norm(h)                         the MLP's input norm
                  m = linear(gated_act(linear(x), linear(x))) ...          (one gate_up_proj when fused)
                   or m = moe(x) [gate, experts.gate_up_proj, experts.down_proj]   (a MoE model's layer)
                      m = add(m, shared MLP(x))                            shared_experts (DeepSeek-V2)
                  m = rms_norm(m)                                          post_feedforward_layernorm (sandwich)
                  h = add(h, m)
    logits = lm_head(rms_norm(h)) {softcap?}
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optc.core.errors import UnsupportedModelError
from optc.core.ir import FULL_ATTENTION, SLIDING_ATTENTION, Graph, ModelConfig, Node, TensorInfo
from optc.core.rope import LOCAL, SUPPORTED_ROPE_TYPES
from optc.core.store import Entry, TensorStore


@dataclass(frozen=True)
class Layout:
    """Where a family's decoder block differs from Llama's, over transformers' names."""

    norm_offset: float = 0.0  # norms weigh by (offset + w), in fp32 (Gemma: 1)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma)
    mlp_norm: str = "post_attention_layernorm"  # the norm before the MLP (Gemma: pre_feedforward_layernorm)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3, Gemma 3)
    embedding_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    fused_qkv: bool = False  # the checkpoint holds self_attn.qkv_proj (Phi-3)
    fused_gate_up: bool = False  # the checkpoint holds mlp.gate_up_proj (Phi-3)
    round_route_weights: bool = False  # moe: routing weights rounded to the activation dtype (Qwen3-MoE)
    float_router: bool = False  # moe: router logits from fp32 x and weight (DeepSeek-V2's TopkRouter)
    # moe: how a saved checkpoint names each expert (transformers 5 stacks them on load and unstacks them on
    # save): `{layer}.{block}.experts.{e}.{gate|up|down}.weight`, the router `{layer}.{block}.gate.weight`
    checkpoint_experts: tuple[str, str, str, str] = ("mlp", "gate_proj", "up_proj", "down_proj")


MLA_NORM_EPS = 1e-6  # DeepSeek-V2's q_a_layernorm and kv_a_layernorm: transformers' default eps, not rms_norm_eps


def graph_for(config: ModelConfig, tensors: dict[str, TensorInfo], layout: Layout) -> Graph:
    """The unoptimized layer graph over HF parameter names; every node of decoder block i has
    `attrs["layer"] == i` (the embedding, final norm and lm_head have none)."""
    c, nodes = config, []

    def add(name: str, op: str, ins: list[str], outs: list[str], attrs: dict | None = None,
            params: dict | None = None) -> None:
        nodes.append(Node(name, op, ins, outs, attrs or {}, params or {}))

    def norm(name: str, x: str, out: str, **attrs) -> str:
        offset = {"offset": layout.norm_offset} if layout.norm_offset else {}
        add(name, "rms_norm", [x], [out], {"eps": c.rms_norm_eps, **offset, **attrs}, {"weight": f"{name}.weight"})
        return out

    def linear(name: str, x: str, n_in: int, outs: list[tuple[str, int]], bias: bool) -> list[str]:
        params = {"weight": f"{name}.weight", **({"bias": f"{name}.bias"} if bias else {})}
        attrs = {"in_features": n_in, "out_features": sum(n for _, n in outs)}
        if len(outs) > 1:  # a projection the checkpoint fuses: its outputs keep the projections' names
            attrs["split"] = [n for _, n in outs]
        add(name, "linear", [x], [o for o, _ in outs], attrs, params)
        return [o for o, _ in outs]

    embed = {"scale": c.hidden_size**0.5} if layout.embedding_scale else {}
    add("model.embed_tokens", "embedding", ["input_ids"], ["h.0"], embed, {"weight": "model.embed_tokens.weight"})
    h = "h.0"
    q_size = c.num_heads * c.head_dim
    for i in range(c.num_layers):
        first, p = len(nodes), f"model.layers.{i}"
        a = f"{p}.self_attn"
        x = norm(f"{p}.input_layernorm", h, f"{p}.attn_in")
        if c.is_mla:
            attn_out, attn_width = _mla(c, a, p, x, tensors, norm, linear, add), c.num_heads * c.v_head_dim
        else:
            attn_out, attn_width = _attention(c, layout, i, a, p, x, tensors, norm, linear, add), q_size
        o_bias = f"{a}.o_proj.bias" in tensors
        (o,) = linear(f"{a}.o_proj", attn_out, attn_width, [(f"{a}.o_proj", c.hidden_size)], o_bias)
        if layout.sandwich_norms:
            o = norm(f"{p}.post_attention_layernorm", o, f"{p}.attn_normed")
        add(f"{p}.attn_residual", "add", [h, o], [f"{p}.h_attn"])
        x = norm(f"{p}.{layout.mlp_norm}", f"{p}.h_attn", f"{p}.mlp_in")
        m = f"{p}.mlp"
        if c.is_moe(i):
            d = f"{p}.mlp_out"
            add(m, "moe", [x], [d], {"num_experts": c.num_experts, "intermediate_size": c.moe_intermediate_size,
                                     "top_k": c.num_experts_per_tok, "scoring": "softmax",
                                     "renormalize": c.norm_topk_prob, "act": c.hidden_act,
                                     **_routing_attrs(c, layout)},
                {"router": f"{m}.gate.weight", "gate_up": f"{m}.experts.gate_up_proj",
                 "down": f"{m}.experts.down_proj"})
            if c.shared_expert_intermediate_size:  # DeepSeek-V2: a dense MLP every token runs, added
                n, s = c.shared_expert_intermediate_size, f"{m}.shared_experts"
                g, u = (linear(name, x, c.hidden_size, [(name, n)], False)[0]
                        for name in (f"{s}.gate_proj", f"{s}.up_proj"))
                add(f"{s}.act", "gated_act", [g, u], [f"{p}.shared_act"], {"act": c.hidden_act})
                (sd,) = linear(f"{s}.down_proj", f"{p}.shared_act", n, [(f"{s}.down_proj", c.hidden_size)], False)
                add(f"{s}.add", "add", [d, sd], [f"{p}.mlp_sum"])
                d = f"{p}.mlp_sum"
        else:
            halves = [(f"{m}.gate_proj", c.intermediate_size), (f"{m}.up_proj", c.intermediate_size)]
            if layout.fused_gate_up:
                g, u = linear(f"{m}.gate_up_proj", x, c.hidden_size, halves, False)
            else:
                g, u = (linear(name, x, c.hidden_size, [(name, n)], False)[0] for name, n in halves)
            add(f"{m}.act", "gated_act", [g, u], [f"{p}.mlp_act"], {"act": c.hidden_act})
            (d,) = linear(f"{m}.down_proj", f"{p}.mlp_act", c.intermediate_size,
                          [(f"{m}.down_proj", c.hidden_size)], False)
        if layout.sandwich_norms:
            d = norm(f"{p}.post_feedforward_layernorm", d, f"{p}.mlp_normed")
        add(f"{p}.mlp_residual", "add", [f"{p}.h_attn", d], [f"h.{i + 1}"])
        for node in nodes[first:]:  # the decoder block a node belongs to (calibration runs block by block)
            node.attrs["layer"] = i
        h = f"h.{i + 1}"
    norm("model.norm", h, "final")
    head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    add("lm_head", "lm_head", ["final"], ["logits"], {"softcap": c.final_logit_softcap} if c.final_logit_softcap
        else {}, {"weight": head})
    return Graph(config=config, nodes=nodes, tensors=tensors)


def _routing_attrs(c: ModelConfig, layout: Layout) -> dict:
    """A moe node's optional routing attrs (optc/core/ops/moe.py) from its family's config and layout."""
    attrs = {"round_weights": True} if layout.round_route_weights else {}
    if c.routed_scaling_factor != 1.0:
        attrs["routed_scale"] = c.routed_scaling_factor
    if c.num_expert_groups > 1:
        attrs |= {"num_groups": c.num_expert_groups, "topk_groups": c.topk_groups}
    return attrs | ({"float_router": True} if layout.float_router else {})


def _attention(c: ModelConfig, layout: Layout, i: int, a: str, p: str, x: str, tensors: dict, norm, linear,
               add) -> str:
    """Layer i's q, k, v projections, q/k norms, rope and paged attention; returns the attention's output."""
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    bias = c.attention_bias or f"{a}.q_proj.bias" in tensors or f"{a}.qkv_proj.bias" in tensors
    projections = [(f"{a}.q_proj", q_size), (f"{a}.k_proj", kv_size), (f"{a}.v_proj", kv_size)]
    if layout.fused_qkv:
        q, k, v = linear(f"{a}.qkv_proj", x, c.hidden_size, projections, bias)
    else:
        q, k, v = (linear(name, x, c.hidden_size, [(name, n)], bias)[0] for name, n in projections)
    if layout.qk_norm:
        q = norm(f"{a}.q_norm", q, f"{p}.q_normed", head_dim=c.head_dim)
        k = norm(f"{a}.k_norm", k, f"{p}.k_normed", head_dim=c.head_dim)
    heads = {"num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim}
    rope = dict(heads)
    if c.local_rope_theta is not None and c.layer_type(i) == SLIDING_ATTENTION:
        rope["rope_table"] = LOCAL
    if c.rotary_dim is not None and c.rotary_dim != c.head_dim:
        rope["rotary_dim"] = c.rotary_dim
    add(f"{a}.rope", "rope", [q, k, "positions"], [f"{p}.q_rot", f"{p}.k_rot"], rope)
    attn = {"layer": i, **heads, "scale": c.attention_scale}
    if c.attn_logit_softcap:
        attn["softcap"] = c.attn_logit_softcap
    if c.window(i) is not None:
        attn["window"] = c.window(i)
    add(f"{a}.attention", "attention", [f"{p}.q_rot", f"{p}.k_rot", v], [f"{p}.attn"], attn)
    return f"{p}.attn"


def _mla(c: ModelConfig, a: str, p: str, x: str, tensors: dict, norm, linear, add) -> str:
    """Layer's Multi-head Latent Attention (transformers' DeepseekV2Attention): the q path (q_proj, or q_a_proj,
    q_a_layernorm and q_b_proj), the joint down-projection kv_a_proj_with_mqa, and one mla_attention node (the
    latent's norm, rope, the latent cache and kv_b_proj's up-projections, optc/core/ops/mla.py)."""
    q_width = c.num_heads * (c.qk_nope_head_dim + c.head_dim)
    if c.q_lora_rank:
        q_a = f"{a}.q_a_proj"
        (q,) = linear(q_a, x, c.hidden_size, [(q_a, c.q_lora_rank)], c.attention_bias or f"{q_a}.bias" in tensors)
        # one row of q_lora_rank (the norm's `head_dim`: its weight's width, not the hidden size)
        q = norm(f"{a}.q_a_layernorm", q, f"{p}.q_a_normed", eps=MLA_NORM_EPS, head_dim=c.q_lora_rank)
        (q,) = linear(f"{a}.q_b_proj", q, c.q_lora_rank, [(f"{a}.q_b_proj", q_width)], False)
    else:
        (q,) = linear(f"{a}.q_proj", x, c.hidden_size, [(f"{a}.q_proj", q_width)], False)
    kv_a = f"{a}.kv_a_proj_with_mqa"
    (kv,) = linear(kv_a, x, c.hidden_size, [(kv_a, c.latent_dim)], c.attention_bias or f"{kv_a}.bias" in tensors)
    attrs = {"num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
             "kv_lora_rank": c.kv_lora_rank, "qk_nope_head_dim": c.qk_nope_head_dim, "v_head_dim": c.v_head_dim,
             "scale": c.attention_scale, "eps": MLA_NORM_EPS}
    add(f"{a}.attention", "mla_attention", [q, kv, "positions"], [f"{p}.attn"], attrs,
        {"kv_norm": f"{a}.kv_a_layernorm.weight", "kv_b": f"{a}.kv_b_proj.weight"})
    return f"{p}.attn"

def param_shapes(config: ModelConfig, layout: Layout) -> dict[str, tuple[int, ...]]:
    """The HF parameter names of a model of `config` laid out as `layout`, and their shapes (what
    `graph_for` reads; biases are read where the checkpoint has them)."""
    c = config
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    norms = ["input_layernorm", layout.mlp_norm]
    if layout.sandwich_norms:
        norms += ["post_attention_layernorm", "post_feedforward_layernorm"]
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.{n}.weight": (c.hidden_size,) for n in norms})
        a, m = f"{p}.self_attn", f"{p}.mlp"
        if c.is_mla:
            shapes.update(_mla_shapes(c, a))
        elif layout.fused_qkv:
            shapes[f"{a}.qkv_proj.weight"] = (q_size + 2 * kv_size, c.hidden_size)
        else:
            shapes[f"{a}.q_proj.weight"] = (q_size, c.hidden_size)
            shapes[f"{a}.k_proj.weight"] = shapes[f"{a}.v_proj.weight"] = (kv_size, c.hidden_size)
        if layout.qk_norm:
            shapes[f"{a}.q_norm.weight"] = shapes[f"{a}.k_norm.weight"] = (c.head_dim,)
        shapes[f"{a}.o_proj.weight"] = (c.hidden_size, c.num_heads * c.v_head_dim if c.is_mla else q_size)
        if c.is_moe(i):
            e, n = c.num_experts, c.moe_intermediate_size
            shapes[f"{m}.gate.weight"] = (e, c.hidden_size)
            shapes[f"{m}.experts.gate_up_proj"] = (e, 2 * n, c.hidden_size)
            shapes[f"{m}.experts.down_proj"] = (e, c.hidden_size, n)
            if c.shared_expert_intermediate_size:
                n, s = c.shared_expert_intermediate_size, f"{m}.shared_experts"
                shapes[f"{s}.gate_proj.weight"] = shapes[f"{s}.up_proj.weight"] = (n, c.hidden_size)
                shapes[f"{s}.down_proj.weight"] = (c.hidden_size, n)
            continue
        if layout.fused_gate_up:
            shapes[f"{m}.gate_up_proj.weight"] = (2 * c.intermediate_size, c.hidden_size)
        else:
            shapes[f"{m}.gate_proj.weight"] = shapes[f"{m}.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[f"{m}.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    return shapes


def _mla_shapes(c: ModelConfig, a: str) -> dict[str, tuple[int, ...]]:
    """An MLA layer's attention parameters (transformers' DeepseekV2Attention), but o_proj."""
    q_width = c.num_heads * (c.qk_nope_head_dim + c.head_dim)
    shapes = {f"{a}.kv_a_proj_with_mqa.weight": (c.latent_dim, c.hidden_size),
              f"{a}.kv_a_layernorm.weight": (c.kv_lora_rank,),
              f"{a}.kv_b_proj.weight": (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)}
    if c.q_lora_rank:
        return shapes | {f"{a}.q_a_proj.weight": (c.q_lora_rank, c.hidden_size),
                         f"{a}.q_a_layernorm.weight": (c.q_lora_rank,),
                         f"{a}.q_b_proj.weight": (q_width, c.q_lora_rank)}
    return shapes | {f"{a}.q_proj.weight": (q_width, c.hidden_size)}


def base_config(cfg: dict, arch: str, where: str, rope_types: tuple[str, ...] = SUPPORTED_ROPE_TYPES,
                **family) -> ModelConfig:
    """The ModelConfig fields every family reads alike from a transformers config dict (as its config
    class writes it: `rope_parameters`, `layer_types`), plus the family's own `family` fields; `rope_types`:
    the rope scaling types the family accepts."""
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    layer_types = tuple(cfg.get("layer_types") or ())
    window = cfg.get("sliding_window") if SLIDING_ATTENTION in layer_types else None
    if layer_types and set(layer_types) == {FULL_ATTENTION}:
        layer_types = ()
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise UnsupportedModelError(f"{where}: layer types {unknown} are not supported; supported: "
                                    f"{FULL_ATTENTION}, {SLIDING_ATTENTION}")
    fields = dict(
        architecture=arch,
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        layer_types=layer_types,
        sliding_window=window,
    )
    return ModelConfig(**{**fields, **rope_fields(cfg.get("rope_parameters") or {}, cfg, where, rope_types), **family})


def rope_fields(rope: dict, cfg: dict, where: str, rope_types: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> dict:
    """rope_theta, rope_scaling and rotary_dim from one table's transformers `rope_parameters` (theta,
    type and scaling keys, partial_rotary_factor); errors name a scaling type optc does not compute."""
    rope = dict(rope)
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    factor = rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    scaling = rope or cfg.get("rope_scaling")
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind not in rope_types:
        raise UnsupportedModelError(f"{where}: rope scaling {scaling} is not supported; supported: "
                                    f"{', '.join(rope_types)}")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary = int(head_dim * factor)
    return {"rope_theta": theta, "rope_scaling": None if kind == "default" else scaling,
            "rotary_dim": None if rotary == head_dim else rotary}


def hf_fields(config: ModelConfig) -> dict:
    """The transformers config kwargs every family writes alike (the inverse of `base_config`)."""
    c, eos = config, list(config.eos_token_ids)
    out = dict(
        architectures=[c.architecture], hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=(eos[0] if len(eos) == 1 else eos) if eos else None, dtype=c.dtype,
        pad_token_id=None,  # the tokenizer knows its padding token; a family default may lie outside the vocabulary
    )
    if c.layer_types:
        out |= {"layer_types": list(c.layer_types), "sliding_window": c.sliding_window}
    return out


def hf_rope(config: ModelConfig) -> dict:
    """One rope table's transformers `rope_parameters` (the inverse of `rope_fields`)."""
    rope = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    if config.rotary_dim is not None:
        rope["partial_rotary_factor"] = config.rotary_dim / config.head_dim
    return rope


def stack_checkpoint_experts(config: ModelConfig, layout: Layout, store: TensorStore) -> TensorStore:
    """A checkpoint store whose per-expert weights (as saved: `layout.checkpoint_experts`) become the stacked
    tensors the graph reads, lazily: gate_up (E, 2I, H) = each expert's [gate | up], down (E, H, I). A
    store that holds them stacked already, or a dense model's, is returned as it is."""
    block, gate, up, down = layout.checkpoint_experts
    entries, removed = {}, []
    for i in (i for i in range(config.num_layers) if config.is_moe(i)):
        p = f"model.layers.{i}"
        expert = f"{p}.{block}.experts.{{}}.{{}}.weight"
        if expert.format(0, gate) not in store:
            continue
        names = {proj: [expert.format(e, proj) for e in range(config.num_experts)] for proj in (gate, up, down)}
        missing = [n for ns in names.values() for n in ns if n not in store]
        if missing:
            raise UnsupportedModelError(f"layer {i} has {config.num_experts} experts but the checkpoint lacks "
                                        f"{missing[:3]}")
        first, d = store.entry(names[gate][0]), store.entry(names[down][0])
        e = config.num_experts
        entries[f"{p}.mlp.experts.gate_up_proj"] = Entry(
            (e, 2 * first.shape[0], first.shape[1]), first.dtype,
            lambda g=names[gate], u=names[up]: torch.stack([torch.cat([store.get(a), store.get(b)])
                                                            for a, b in zip(g, u, strict=True)]))
        entries[f"{p}.mlp.experts.down_proj"] = Entry(
            (e, *d.shape), d.dtype, lambda n=names[down]: torch.stack([store.get(x) for x in n]))
        if block != "mlp":
            entries[f"{p}.mlp.gate.weight"] = store.entry(f"{p}.{block}.gate.weight")
            removed.append(f"{p}.{block}.gate.weight")
        removed += [n for ns in names.values() for n in ns]
    return store.with_entries(entries, remove=removed) if entries else store
