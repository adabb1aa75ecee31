"""Model families: which module knows an architecture.

A family module (one file, e.g. `llama.py`) turns a transformers config.json into a `ModelConfig`
(`config_from_hf`), names the HF parameters of a model of that config (`param_shapes`), builds its
unoptimized graph over those names (`graph_for`), and goes back to transformers (`hf_model_from_artifact`).
A second family is one more module and one more line in `FAMILIES`. The sources (optc/frontend/sources.py)
read files; this package only maps architectures to their module.
"""

from __future__ import annotations

from types import ModuleType

from optc.core.errors import UnsupportedModelError
from optc.frontend.models import llama

__all__ = ["FAMILIES", "MODEL_TYPES", "UnsupportedModelError", "architecture_of", "config_from_hf", "family"]

FAMILIES: dict[str, ModuleType] = {arch: llama for arch in llama.ARCHITECTURES}
MODEL_TYPES: dict[str, str] = dict(llama.MODEL_TYPES)  # config.json model_type -> architecture


def architecture_of(cfg: dict, where: str) -> str:
    """The supported architecture a transformers config names (its `architectures`, else its `model_type`)."""
    model_type = cfg.get("model_type")
    arch = (cfg.get("architectures") or [MODEL_TYPES.get(model_type, model_type)])[0]
    if arch not in FAMILIES:
        raise UnsupportedModelError(f"{where}: architecture {arch!r} is not supported; "
                                    f"supported: {', '.join(FAMILIES)}")
    return arch


def family(architecture: str) -> ModuleType:
    """The module of a supported architecture (a graph's `config.architecture`)."""
    if architecture not in FAMILIES:
        raise UnsupportedModelError(f"architecture {architecture!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[architecture]


def config_from_hf(cfg: dict, where: str):
    """A transformers config.json dict -> optc.core.ir.ModelConfig, by the family of its architecture."""
    arch = architecture_of(cfg, where)
    return FAMILIES[arch].config_from_hf(cfg, arch, where)
