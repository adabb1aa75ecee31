"""Model families: which module knows an architecture, and what every family shares through it.

A family module (one file: `llama.py`, `qwen3.py`, `gemma.py`, `phi3.py`, `mixtral.py`, `qwen3_moe.py`,
`deepseek_v2.py`)
names its transformers model types and architectures (`MODEL_TYPES`), lays out its decoder block
(`LAYOUTS`: a `Layout` per architecture, the data optc/frontend/models/decoder.py's one graph template
reads), reads a transformers config into a `ModelConfig` (`config_from_hf`) and writes one back
(`hf_config`). Everything else is shared here: the graph over a checkpoint's names (`graph_for`,
`param_shapes`), the transformers parameter names an artifact's tensors hold (`hf_params`) and its
`nn.Linear` modules (`hf_linear_modules`), and a dense artifact rebuilt as the family's transformers model
(`hf_model_from_artifact`, the peer of `optc bench --compare-hf`). A new family is one more module and
one more entry in `_MODULES`. The sources (optc/frontend/sources.py) read files; this package maps
architectures to what their weights mean.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from optc.core.errors import InputError, UnsupportedModelError
from optc.core.ir import Graph, ModelConfig, TensorInfo
from optc.core.store import TensorStore
from optc.frontend.models import decoder, deepseek_v2, gemma, llama, mixtral, phi3, qwen3, qwen3_moe

__all__ = ["FAMILIES", "MODEL_TYPES", "UnsupportedModelError", "architecture_of", "config_from_hf", "family",
           "from_checkpoint",
           "graph_for", "hf_config", "hf_linear_modules", "hf_model_from_artifact", "hf_params", "param_shapes"]

_MODULES = (llama, qwen3, gemma, phi3, mixtral, qwen3_moe, deepseek_v2)
FAMILIES: dict[str, ModuleType] = {arch: m for m in _MODULES for arch in m.MODEL_TYPES.values()}
MODEL_TYPES: dict[str, str] = {t: arch for m in _MODULES for t, arch in m.MODEL_TYPES.items()}  # model_type -> arch


def architecture_of(cfg: dict, where: str) -> str:
    """The supported architecture a transformers config names (its `architectures`, else its `model_type`)."""
    model_type = cfg.get("model_type")
    arch = (cfg.get("architectures") or [MODEL_TYPES.get(model_type, model_type)])[0]
    if arch not in FAMILIES:
        multimodal = " (a multimodal model: optc reads text-only decoders)" if "ConditionalGeneration" in str(arch) \
            or model_type == "gemma3" else ""
        raise UnsupportedModelError(f"{where}: architecture {arch!r} is not supported{multimodal}; "
                                    f"supported: {', '.join(FAMILIES)}")
    return arch


def family(architecture: str) -> ModuleType:
    """The module of a supported architecture (a graph's `config.architecture`)."""
    if architecture not in FAMILIES:
        raise UnsupportedModelError(f"architecture {architecture!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[architecture]


def config_from_hf(cfg: dict, where: str) -> ModelConfig:
    """A transformers config.json dict -> ModelConfig, by the family of its architecture. The dict goes
    through transformers' own config class first, so defaults and legacy keys (a Gemma 3 config's
    `sliding_window_pattern`, a Qwen config's `use_sliding_window`) mean what transformers makes of them."""
    arch = architecture_of(cfg, where)
    model_type = next(t for t, a in family(arch).MODEL_TYPES.items() if a == arch)
    try:
        from transformers import AutoConfig

        normalized = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"})
    except Exception as e:  # noqa: BLE001 - transformers' config classes raise several types for a bad config
        raise UnsupportedModelError(f"{where}: transformers refuses this {model_type} config: "
                                    f"{' '.join(str(e).split())}") from None
    eos = cfg.get("eos_token_id")  # a generation_config's eos ids, merged by the source, win over the class's
    return family(arch).config_from_hf({**normalized.to_dict(), "eos_token_id": eos}, arch, where)


def graph_for(config: ModelConfig, tensors: dict[str, TensorInfo]) -> Graph:
    """The unoptimized graph of `config`'s family over a checkpoint's tensor table."""
    return decoder.graph_for(config, tensors, family(config.architecture).LAYOUTS[config.architecture])


def from_checkpoint(config: ModelConfig, store: TensorStore) -> TensorStore:
    """A transformers checkpoint's store under the names the graph reads (a MoE checkpoint's per-expert
    weights stacked: `decoder.stack_checkpoint_experts`)."""
    return decoder.stack_checkpoint_experts(config, family(config.architecture).LAYOUTS[config.architecture], store)


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The transformers parameter names of a model of `config` and their shapes."""
    return decoder.param_shapes(config, family(config.architecture).LAYOUTS[config.architecture])


def hf_config(config: ModelConfig) -> dict:
    """The transformers config.json of a model config, for its own architecture."""
    return family(config.architecture).hf_config(config)


def hf_params(graph: Graph) -> list[tuple[str, list[str], list[int] | None]]:
    """(artifact tensor, the transformers parameter names it holds, their row counts) once per tensor, in
    node order. A tensor the family's checkpoint names (Phi-3's qkv_proj too) holds itself (sizes None);
    a linear fused by a pass (qkv, gate_up: the node's outputs keep the projection names) holds one
    parameter per output, in row order. A tied lm_head reads the embedding's tensor, so it adds no name
    (transformers ties it on load)."""
    names = param_shapes(graph.config).keys()
    out: dict[str, tuple[str, list[str], list[int] | None]] = {}
    for node in graph.nodes:
        for role, tensor in node.params.items():
            split = node.attrs.get("split") if node.op == "linear" and f"{node.name}.weight" not in names else None
            if tensor not in out:
                out[tensor] = (tensor, [f"{o}.{role}" for o in node.outputs], list(split)) if split else \
                    (tensor, [tensor], None)
    return list(out.values())


def hf_linear_modules(graph: Graph) -> list[str]:
    """The `nn.Linear` modules of the transformers model: every projection (a pass's fused linear: its
    outputs' names; a linear the checkpoint fuses: its own) and lm_head."""
    names = param_shapes(graph.config).keys()
    out = []
    for n in graph.nodes:
        if n.op == "linear":
            out += [n.name] if f"{n.name}.weight" in names else list(n.outputs)
    return out + ["lm_head"]


def hf_model_from_artifact(path: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """The family's transformers model holding a dense artifact's own weights (for `random:` sources)."""
    from transformers import AutoConfig, AutoModelForCausalLM

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
    cfg = hf_config(graph.config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.dtype = dtype
    with torch.device("meta"):  # no random init: the weights are assigned below
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if graph.config.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise InputError(f"--compare-hf: {path} does not map onto {type(model).__name__} (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    model.tie_weights()
    _fill_meta_buffers(model, config, device)
    return model.eval()


def _fill_meta_buffers(model: Any, config: Any, device: torch.device) -> None:
    """Recompute the non-persistent buffers a meta-device model has no values for: the rotary tables
    (a fresh rotary module) and a scaled embedding's scale (Gemma); any other is an error naming it."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, type(module)(config).to(device))
        elif hasattr(module, "scalar_embed_scale") and module.embed_scale.is_meta:
            module.embed_scale = torch.tensor(module.scalar_embed_scale, device=device)
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise RuntimeError(f"--compare-hf: no values for the buffers {left[:3]} of {type(model).__name__}")
