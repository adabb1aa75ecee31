"""LoRA adapters in peft's format, read and checked against a graph.

An adapter is a folder with `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `target_modules`) and
`adapter_model.safetensors` (per module `base_model.model.<module>.lora_A.weight` (r, K) and `.lora_B.weight`
(N, r)). `load_adapter` reads it, checks every tensor against the graph's linears and returns the per-module
factors in float32 with the scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) folded into B. A module is a
graph linear's output value: a linear fused by fuse_qkv / fuse_gate_up keeps its projections' names as its outputs
and `split` sizes, so an adapter written for q_proj lands in q's rows of the fused qkv linear (`LinearTarget`).

It does not run anything: the runtime's slots (runtime/lora.py) and the merge pass (passes/merge_lora.py) use it.
Every refusal is an `AdapterError` naming the file and, where one is at fault, the tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from optc.core.errors import InputError
from optc.core.ir import Graph

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
DEFAULT_MAX_RANK = 64
# projections an adapter may target (peft's target_modules names: the last part of a module's name)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterError(InputError):
    """An adapter that cannot be used on this graph; the message names the file and tensor."""


@dataclass(frozen=True)
class LinearTarget:
    """Where a module's output lies: rows [offset, offset + rows) of linear node `node`'s output, whose input has
    `in_features`; `index` is its place among the node's `split` outputs (0 unfused)."""

    node: str
    offset: int
    rows: int
    in_features: int
    index: int


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter's float32 factors per module: `a` (r, K) and `b` (N, r) with the scaling folded into b."""

    name: str
    path: Path
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (a, b)
    sha256: str  # of adapter_model.safetensors

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.factors.values())


def linear_targets(graph: Graph) -> dict[str, LinearTarget]:
    """Every linear output of the graph by module name (a fused linear: one per split output)."""
    out = {}
    for node in graph.nodes:
        if node.op != "linear":
            continue
        sizes = node.attrs.get("split") or [node.attrs["out_features"]]
        offset = 0
        for index, (value, rows) in enumerate(zip(node.outputs, sizes, strict=True)):
            out[value] = LinearTarget(node.name, offset, rows, node.attrs["in_features"], index)
            offset += rows
    return out


def load_adapter(path: str | Path, graph: Graph, name: str | None = None,
                 max_rank: int = DEFAULT_MAX_RANK) -> LoraAdapter:
    """The adapter in folder `path`, checked against `graph`'s linears (shapes, rank <= max_rank, targets)."""
    from safetensors import safe_open

    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    config = _read_config(config_file)
    rank, alpha = config["r"], config.get("lora_alpha", config["r"])
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{config_file}: r must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{config_file}: rank {rank} is above the maximum rank {max_rank} (--max-lora-rank)")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    if not weights_file.is_file():
        raise AdapterError(f"{weights_file}: no such file (peft's save_pretrained writes it)")
    targets = linear_targets(graph)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_file), "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            module, part = _split_key(weights_file, key)
            pairs.setdefault(module, {})[part] = f.get_tensor(key)
    if not pairs:
        raise AdapterError(f"{weights_file}: holds no lora_A / lora_B tensors")
    factors = {}
    for module, parts in pairs.items():
        factors[module] = _check_pair(weights_file, module, parts, targets, rank, scaling)
    sha = hashlib.sha256(weights_file.read_bytes()).hexdigest()
    modules = config.get("target_modules") or ()
    modules = (modules,) if isinstance(modules, str) else tuple(modules)
    return LoraAdapter(name or path.name, path, rank, scaling, modules, factors, sha)


def adapter_rank(path: str | Path) -> int:
    """The rank `r` of the adapter in folder `path` (its config checked as `load_adapter` checks it)."""
    return _read_config(Path(path) / CONFIG_FILE)["r"]


def parse_named_adapter(value: str, option: str = "--lora") -> tuple[str, Path]:
    """NAME=DIR (a command-line --lora) -> (NAME, DIR)."""
    name, sep, folder = value.partition("=")
    if not sep or not name or not folder:
        raise InputError(f"{option} takes NAME=DIR (a peft adapter folder), got {value!r}")
    return name, Path(folder)


def _read_config(config_file: Path) -> dict:
    if not config_file.is_file():
        raise AdapterError(f"{config_file}: no such file (a peft adapter folder holds {CONFIG_FILE} and "
                           f"{WEIGHTS_FILE})")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"{config_file}: not readable JSON ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{config_file}: peft_type {config['peft_type']!r} is not LORA")
    if "r" not in config:
        raise AdapterError(f"{config_file}: has no rank `r`")
    for key in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise AdapterError(f"{config_file}: {key} is not supported (plain LoRA on {', '.join(TARGETS)} only)")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{config_file}: bias {config['bias']!r} is not supported (only 'none')")
    return config


def _split_key(weights_file: Path, key: str) -> tuple[str, str]:
    # base_model.model.<module>.lora_A.weight -> (<module>, "a")
    stem = key.removeprefix(PEFT_PREFIX)
    for suffix, part in ((".lora_A.weight", "a"), (".lora_B.weight", "b")):
        if stem.endswith(suffix):
            return stem.removesuffix(suffix), part
    raise AdapterError(f"{weights_file}: tensor {key!r} is not a LoRA factor (lora_A.weight / lora_B.weight)")


def _check_pair(weights_file: Path, module: str, parts: dict[str, torch.Tensor], targets: dict[str, LinearTarget],
                rank: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    key = f"{PEFT_PREFIX}{module}"
    if set(parts) != {"a", "b"}:
        missing = "lora_B" if "a" in parts else "lora_A"
        raise AdapterError(f"{weights_file}: {key} has no {missing}.weight")
    target = targets.get(module)
    if target is None or module.rsplit(".", 1)[-1] not in TARGETS:
        raise AdapterError(f"{weights_file}: {key} targets {module!r}, which is not one of this model's "
                           f"projections ({', '.join(TARGETS)})")
    a, b = parts["a"], parts["b"]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise AdapterError(f"{weights_file}: {key}.lora_A.weight {tuple(a.shape)} and lora_B.weight "
                           f"{tuple(b.shape)} are not (r, in) and (out, r)")
    if a.shape[0] != rank:
        raise AdapterError(f"{weights_file}: {key}.lora_A.weight has rank {a.shape[0]}, the config's r is {rank}")
    if a.shape[1] != target.in_features or b.shape[0] != target.rows:
        raise AdapterError(f"{weights_file}: {key} is ({b.shape[0]} x {a.shape[1]}), this model's {module} is "
                           f"({target.rows} x {target.in_features}): an adapter of another base model")
    return a.float().contiguous(), (b.float() * scaling).contiguous()
