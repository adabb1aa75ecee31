"""`optc export --format hf`: an artifact as a Hugging Face model folder that transformers, vLLM and
SGLang load: quantized weights in the compressed-tensors `pack-quantized` format, dense ones as a
plain checkpoint.

The folder holds `config.json` (the model family's transformers config; with a `quantization_config`
when a linear is quantized), `model.safetensors` (or `model-0000i-of-0000n.safetensors` shards and
`model.safetensors.index.json` past `max_shard_bytes`) and `generation_config.json`; the exporter
(optc/commands/export/__init__.py) puts the tokenizer files beside them.
Fused linears (qkv, gate_up) are cut back into the projections the family names (`hf_params`). A MoE
model's experts are written stacked, under transformers 5's names (`mlp.experts.gate_up_proj`, loaded as
they are); quantized experts are refused (compressed-tensors has no stacked-expert form).

What each weight becomes is its format's scheme's business (`compressed_tensors_args`,
`to_compressed_tensors`; docs/FORMATS.md has the mapping); a format the scheme refuses for `hf`
(`export_refusal`) stops the export before anything is written. This module writes files; the
package `compressed-tensors` is needed to load them with transformers, not to write them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from optc.core.errors import UserError
from optc.core.formats import DTYPES, Format, dequantize, part_name
from optc.core.ir import Graph
from optc.core.store import TensorStore
from optc.frontend import models

CT_FORMAT = "pack-quantized"
CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default ("5GB")


class HfExportError(UserError, ValueError):
    """An artifact holding a weight format that has no faithful compressed-tensors form."""


def check_hf(graph: Graph) -> None:
    """Refuse, in one line naming the first such tensor, weights whose format has no faithful compressed-tensors
    form (the scheme's `export_refusal(fmt, "hf")`), before anything is written."""
    refusals = [f"tensor {t} is the {fmt.kind.value} experts of moe node {n.name}, which compressed-tensors cannot "
                "hold (export the dense build)" for n in graph.nodes if n.op == "moe"
                for t in (n.params["gate_up"], n.params["down"]) if (fmt := graph.tensors[t].format).is_quantized]
    for name in graph.used_tensors():
        fmt = graph.tensors[name].format
        refusal = fmt.scheme.export_refusal(fmt, "hf")
        if refusal is not None:
            refusals.append(f"tensor {name} is {refusal}")
    if refusals:
        more = f" (and {len(refusals) - 1} more)" if len(refusals) > 1 else ""
        raise HfExportError(f"--format hf: {refusals[0]}{more}")


def quantization_config(graph: Graph) -> dict | None:
    """config.json's compressed-tensors `quantization_config` of `graph`, or None when every linear is dense.

    One config group per distinct set of quantization arguments: targets ["Linear"] when there is one,
    the module names otherwise; the linears left dense (lm_head at least) are listed in `ignore`.
    """
    schemes = _linear_schemes(graph)
    groups: dict[str, list[str]] = {}
    for module, args in schemes.items():
        if args is not None:
            groups.setdefault(json.dumps(args, sort_keys=True), []).append(module)
    if not groups:
        return None
    one = len(groups) == 1
    config_groups = {
        f"group_{i}": {"targets": ["Linear"] if one else modules, "weights": json.loads(args),
                       "input_activations": None, "output_activations": None, "format": CT_FORMAT}
        for i, (args, modules) in enumerate(groups.items())
    }
    return {
        "quant_method": "compressed-tensors", "format": CT_FORMAT, "quantization_status": "compressed",
        "config_groups": config_groups, "ignore": [m for m, a in schemes.items() if a is None],
        "kv_cache_scheme": None, "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {},
    }


def write_hf(graph: Graph, store: TensorStore, out: Path, max_shard_bytes: int = MAX_SHARD_BYTES,
             progress: Callable[[str], None] = lambda m: None) -> None:
    """Write config.json, the weights and (unless the tokenizer files already put one there)
    generation_config.json of `graph` and `store` into the existing folder `out`."""
    from safetensors.torch import save_file

    config = models.hf_config(graph.config)
    qc = quantization_config(graph)
    if qc is not None:
        config["quantization_config"] = qc
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if not (out / GENERATION_FILE).is_file():  # sources without one (random:) get the config's token ids
        c = graph.config
        gen = {"bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids) or None}
        (out / GENERATION_FILE).write_text(json.dumps({k: v for k, v in gen.items() if v is not None}, indent=2) + "\n")

    params = models.hf_params(graph)
    sizes = [_nbytes(_module_tensors(graph, None, p)) for p in params]
    shards = _shards(sizes, max_shard_bytes)
    files = ([f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
             if len(shards) > 1 else ["model.safetensors"])
    weight_map: dict[str, str] = {}
    for file, shard in zip(files, shards, strict=True):
        progress(f"writing {file}")
        tensors: dict[str, torch.Tensor] = {}
        for i in shard:
            tensors.update(_module_tensors(graph, store, params[i]))
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _linear_schemes(graph: Graph) -> dict[str, dict | None]:
    """Every transformers `nn.Linear` module -> the compressed-tensors args of its weight (None: written dense)."""
    out = _stored_schemes(graph)
    if _lm_head_written_dense(out):
        out["lm_head"] = None
    return out


def _stored_schemes(graph: Graph) -> dict[str, dict | None]:
    """Every transformers `nn.Linear` module -> the compressed-tensors args of its stored format (None: dense)."""
    fmt_of = {n: graph.tensors[t].format for t, names, _ in models.hf_params(graph) for n in names}
    out = {}
    for module in models.hf_linear_modules(graph):
        fmt = fmt_of.get(f"{module}.weight")  # a tied lm_head has no weight of its own: the dense embedding
        out[module] = None if fmt is None else fmt.scheme.compressed_tensors_args(fmt)
    return out


def _lm_head_written_dense(schemes: dict[str, dict | None]) -> bool:
    """Whether a quantized lm_head is written dequantized, in the model dtype: when its arguments differ from
    the projections'. transformers (5.x) decompresses a compressed-tensors checkpoint with one scheme for every
    dense layer, so a second config group for the lm_head (an int8 lm_head beside int4 projections, as the
    SmolLM2 AWQ recipe builds) fails to load; the dequantized weights are the values optc's reference uses."""
    head = schemes.get("lm_head")
    others = [a for m, a in schemes.items() if m != "lm_head" and a is not None]
    return head is not None and any(a != head for a in others)


def _module_tensors(graph: Graph, store: TensorStore | None,
                    param: tuple[str, list[str], list[int] | None]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one artifact tensor (of each projection, for a fused one), by full name.
    Without a store the parts are meta tensors: the same names, shapes and dtypes, no data."""
    tensor, names, sizes = param
    info = graph.tensors[tensor]
    fmt: Format = info.format
    if names == ["lm_head.weight"] and fmt.is_quantized and _lm_head_written_dense(_stored_schemes(graph)):
        dtype = DTYPES[graph.config.dtype]
        if store is None:
            return {"lm_head.weight": torch.empty(tuple(info.shape), dtype=dtype, device="meta")}
        parts = {role: store.get(part_name(tensor, role, fmt)) for role in fmt.part_shapes(info.shape)}
        return {"lm_head.weight": dequantize(parts, fmt, dtype)}
    parts = {role: (store.get(part_name(tensor, role, fmt)) if store is not None
                    else torch.empty(shape, dtype=dtype, device="meta"))
             for role, (shape, dtype) in fmt.part_shapes(info.shape).items()}
    if sizes is None:
        pieces, shapes = [parts], [tuple(info.shape)]
    else:
        cut = {role: fmt.scheme.split_rows(role, p, sizes, fmt) for role, p in parts.items()}
        pieces = [{role: cut[role][i] for role in parts} for i in range(len(sizes))]
        shapes = [(rows, *info.shape[1:]) for rows in sizes]
    out = {}
    for name, piece, shape in zip(names, pieces, shapes, strict=True):
        module, _, role = name.rpartition(".")
        if role == "weight":  # a weight is what a format quantizes; bias and norm weights are plain tensors
            ct = fmt.scheme.to_compressed_tensors(piece, fmt, shape)
            out.update({f"{module}.{k}": v for k, v in ct.items()})
        else:
            out[name] = fmt.scheme.to_compressed_tensors(piece, fmt, shape)["weight"]
    return out


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _shards(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive indices grouped so each group's total stays within `limit` (a larger item is alone)."""
    shards: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
        if shards[-1] and total + size > limit:
            shards.append([])
            total = 0
        shards[-1].append(i)
        total += size
    return shards
