"""The Llama family: Llama 2/3 (with rope scaling), Mistral, Qwen2 (q/k/v bias), SmolLM2; tied or untied
embeddings.

Its graph template over HF parameter names (`graph_for`, `param_shapes`), the transformers config it
comes from (`config_from_hf`) and goes back to (`hf_llama_config`, `hf_config`), the transformers parameter
names an artifact's tensors hold (`hf_params`: a fused qkv / gate_up splits back into its projections) and
its `nn.Linear` modules (`hf_linear_modules`), and an artifact rebuilt as a transformers `LlamaForCausalLM`
(`hf_model_from_artifact`, the peer of `optc bench --compare-hf`). Reading files is the sources' job
(optc/frontend/sources.py); writing a transformers folder is `optc export --format hf`'s (optc/commands/export/hf.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from optc.core.errors import InputError, UnsupportedModelError
from optc.core.ir import Graph, ModelConfig, Node, TensorInfo
from optc.core.rope import SUPPORTED_ROPE_TYPES
from optc.core.store import TensorStore

MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ARCHITECTURES = tuple(MODEL_TYPES.values())


def graph_for(config: ModelConfig, tensors: dict[str, TensorInfo]) -> Graph:
    """The unoptimized layer graph of a Llama-family decoder over HF parameter names; every node of
    decoder block i has `attrs["layer"] == i` (the embedding, final norm and lm_head have none)."""
    nodes: list[Node] = []
    c = config
    add = lambda name, op, ins, outs, attrs=None, params=None: nodes.append(
        Node(name, op, ins, outs, attrs or {}, params or {})
    )

    def linear(name: str, x: str, n_in: int, n_out: int, bias: bool) -> str:
        params = {"weight": f"{name}.weight", **({"bias": f"{name}.bias"} if bias else {})}
        add(name, "linear", [x], [name], {"in_features": n_in, "out_features": n_out}, params)
        return name

    eps = c.rms_norm_eps
    add("model.embed_tokens", "embedding", ["input_ids"], ["h.0"], params={"weight": "model.embed_tokens.weight"})
    h = "h.0"
    for i in range(c.num_layers):
        first = len(nodes)
        p = f"model.layers.{i}"
        qkv_bias = c.attention_bias or f"{p}.self_attn.q_proj.bias" in tensors
        o_bias = f"{p}.self_attn.o_proj.bias" in tensors
        add(
            f"{p}.input_layernorm",
            "rms_norm",
            [h],
            [f"{p}.attn_in"],
            {"eps": eps},
            {"weight": f"{p}.input_layernorm.weight"},
        )
        q = linear(f"{p}.self_attn.q_proj", f"{p}.attn_in", c.hidden_size, c.num_heads * c.head_dim, qkv_bias)
        k = linear(f"{p}.self_attn.k_proj", f"{p}.attn_in", c.hidden_size, c.num_kv_heads * c.head_dim, qkv_bias)
        v = linear(f"{p}.self_attn.v_proj", f"{p}.attn_in", c.hidden_size, c.num_kv_heads * c.head_dim, qkv_bias)
        heads = {"num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim}
        add(f"{p}.self_attn.rope", "rope", [q, k, "positions"], [f"{p}.q_rot", f"{p}.k_rot"], dict(heads))
        add(
            f"{p}.self_attn.attention",
            "attention",
            [f"{p}.q_rot", f"{p}.k_rot", v],
            [f"{p}.attn"],
            {"layer": i, **heads, "scale": c.head_dim**-0.5},
        )
        o = linear(f"{p}.self_attn.o_proj", f"{p}.attn", c.num_heads * c.head_dim, c.hidden_size, o_bias)
        add(f"{p}.attn_residual", "add", [h, o], [f"{p}.h_attn"])
        add(
            f"{p}.post_attention_layernorm",
            "rms_norm",
            [f"{p}.h_attn"],
            [f"{p}.mlp_in"],
            {"eps": eps},
            {"weight": f"{p}.post_attention_layernorm.weight"},
        )
        g = linear(f"{p}.mlp.gate_proj", f"{p}.mlp_in", c.hidden_size, c.intermediate_size, False)
        u = linear(f"{p}.mlp.up_proj", f"{p}.mlp_in", c.hidden_size, c.intermediate_size, False)
        add(f"{p}.mlp.act", "silu_mul", [g, u], [f"{p}.mlp_act"])
        d = linear(f"{p}.mlp.down_proj", f"{p}.mlp_act", c.intermediate_size, c.hidden_size, False)
        add(f"{p}.mlp_residual", "add", [f"{p}.h_attn", d], [f"h.{i + 1}"])
        for node in nodes[first:]:  # the decoder block a node belongs to (calibration runs block by block)
            node.attrs["layer"] = i
        h = f"h.{i + 1}"
    add("model.norm", "rms_norm", [h], ["final"], {"eps": eps}, {"weight": "model.norm.weight"})
    head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    add("lm_head", "lm_head", ["final"], ["logits"], params={"weight": head})
    return Graph(config=config, nodes=nodes, tensors=tensors)


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF parameter names of a model of `config` and their shapes (what `graph_for` reads)."""
    c = config
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = shapes[f"{p}.post_attention_layernorm.weight"] = (c.hidden_size,)
        for name, n, k in (
            ("self_attn.q_proj", c.num_heads * c.head_dim, c.hidden_size),
            ("self_attn.k_proj", c.num_kv_heads * c.head_dim, c.hidden_size),
            ("self_attn.v_proj", c.num_kv_heads * c.head_dim, c.hidden_size),
            ("self_attn.o_proj", c.hidden_size, c.num_heads * c.head_dim),
            ("mlp.gate_proj", c.intermediate_size, c.hidden_size),
            ("mlp.up_proj", c.intermediate_size, c.hidden_size),
            ("mlp.down_proj", c.hidden_size, c.intermediate_size),
        ):
            shapes[f"{p}.{name}.weight"] = (n, k)
    return shapes


def config_from_hf(cfg: dict, arch: str, where: str) -> ModelConfig:
    """A transformers config.json dict of a Llama-family `arch` -> ModelConfig; errors name what is not supported."""
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{where}: mlp_bias=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported; supported: silu")
    rope = dict(cfg.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = rope or cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    if scaling and scaling.get("rope_type", scaling.get("type")) not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{where}: rope scaling {scaling} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    heads = cfg["num_attention_heads"]
    max_pos = cfg.get("max_position_embeddings", 4096)
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        max_pos = min(max_pos, cfg["sliding_window"])  # full attention equals sliding attention up to the window
    eos = cfg.get("eos_token_id")
    return ModelConfig(
        architecture=arch,
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)) or arch == "Qwen2ForCausalLM",
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
    )


def hf_llama_config(config: ModelConfig, **extra):
    """The transformers LlamaConfig of a model config (the inverse of config_from_hf, for Llama graphs)."""
    from transformers import LlamaConfig

    c = config
    return LlamaConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=c.attention_bias, **({"rope_scaling": c.rope_scaling} if c.rope_scaling else {}), **extra,
    )


def hf_config(config: ModelConfig) -> dict:
    """The transformers config.json of a model config, for its own architecture (Llama, Mistral, Qwen2)."""
    from transformers import AutoConfig

    c = config
    model_type = {arch: t for t, arch in MODEL_TYPES.items()}[c.architecture]
    eos = list(c.eos_token_ids)
    cfg = AutoConfig.for_model(
        model_type, architectures=[c.architecture], hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
        eos_token_id=(eos[0] if len(eos) == 1 else eos) if eos else None, dtype=c.dtype,
        **({"attention_bias": c.attention_bias} if model_type == "llama" else {}),
        **({"rope_scaling": c.rope_scaling} if c.rope_scaling else {}),
    )
    return cfg.to_dict()


def hf_params(graph: Graph) -> list[tuple[str, list[str], list[int] | None]]:
    """(artifact tensor, the transformers parameter names it holds, their row counts) once per tensor, in
    node order. A tensor holds one parameter of its own name (sizes None), or it is a fused linear's
    (qkv, gate_up: the node's outputs keep the projection names) and holds one per output, in row order.
    A tied lm_head reads the embedding's tensor, so it adds no name (transformers ties it on load)."""
    out: dict[str, tuple[str, list[str], list[int] | None]] = {}
    for node in graph.nodes:
        for role, tensor in node.params.items():
            if tensor in out:
                continue
            split = node.attrs.get("split") if node.op == "linear" else None
            names = [f"{o}.{role}" for o in node.outputs] if split else [tensor]
            out[tensor] = (tensor, names, list(split) if split else None)
    return list(out.values())


def hf_linear_modules(graph: Graph) -> list[str]:
    """The `nn.Linear` modules of the transformers model: every projection (a fused linear's outputs are
    their names) and lm_head."""
    return [o for n in graph.nodes if n.op == "linear" for o in n.outputs] + ["lm_head"]


def hf_model_from_artifact(path: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """A LlamaForCausalLM holding a dense artifact's own weights (for `random:` sources)."""
    from transformers import LlamaForCausalLM

    from optc.core.artifact import read

    graph = read(path, verify=False).graph
    formats = [graph.tensors[t].format for t in graph.used_tensors()]
    quantized = sorted({f.kind.value for f in formats if f.is_quantized})
    if quantized:
        raise InputError(f"--compare-hf: {path} holds {', '.join(quantized)} weights and its source has no "
                         "transformers checkpoint; transformers can only be rebuilt from a dense artifact "
                         "(compare with the dense build)")
    store = TensorStore.from_safetensors(sorted(path.glob("weights-*.safetensors")))
    state: dict[str, torch.Tensor] = {}
    for tensor, names, sizes in hf_params(graph):
        weight = store.get(tensor).to(device, dtype)
        state.update(zip(names, weight.split(sizes, 0) if sizes else [weight], strict=True))
    config = hf_llama_config(graph.config, dtype=dtype)
    with torch.device("meta"):  # no random init: the weights are assigned below
        model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if graph.config.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise InputError(f"--compare-hf: {path} does not map onto LlamaForCausalLM (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config).to(device)  # a non-persistent buffer
    return model.eval()
