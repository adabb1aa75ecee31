"""Import compressed-tensors checkpoints (`quant_method: compressed-tensors`, written by llm-compressor
or `optc export --format hf`) into optc parts, exactly.

A quantized linear `X` is the module with an `X.weight_scale`; its config group is the first in
`config_groups` whose targets name it (`Linear` names every linear, `re:` prefixes a regex, anything
else is a module name). Its arguments pick an optc format through `quantized_format`, and the format's
scheme must give the same arguments back (`compressed_tensors_args`): a scheme that cannot be held
exactly (int4 per channel, int8 groups or zero points, activation quantization, fp8, a storage format
other than `pack-quantized`) is refused with the module's name. The parts come from the scheme's
`from_compressed_tensors`, converted lazily when the artifact writer reads them; the shapes a module's
tensors must have are the scheme's own `to_compressed_tensors` run on meta tensors. Every other
floating-point tensor passes through unchanged. Nothing is requantized.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from optc.core.errors import InputError
from optc.core.formats import DTYPES, Format, part_name, quantized_format
from optc.core.ir import TensorInfo
from optc.core.store import Entry, TensorStore

CT_FORMAT = "pack-quantized"
ARG_KEYS = ("num_bits", "type", "symmetric", "group_size", "strategy", "dynamic")  # what a format pins down
SCALE = ".weight_scale"


def import_compressed_tensors(
    path: Path, cfg: dict, files: list[Path], error: type[Exception]
) -> tuple[TensorStore, dict[str, TensorInfo], dict | None]:
    """A HF folder whose quantization_config is compressed-tensors -> (store, quantized, quantization record),
    as `optc.frontend.quant.checkpoints.import_quantized`; errors are raised as `error` (its CheckpointError)."""
    qc = cfg["quantization_config"]
    _refuse_unsupported(qc, error)
    raw = TensorStore.from_safetensors(files)
    modules = [k[: -len(SCALE)] for k in raw.names() if k.endswith(SCALE)]
    table: dict[str, TensorInfo] = {}
    entries: dict[str, Entry] = {}
    taken: set[str] = set()
    for module in modules:
        group = _group_of(module, qc, error)
        fmt, shape = _format_of(module, group, qc, raw, error)
        expected = _expected(fmt, shape)
        present = {k.removeprefix(f"{module}."): raw.entry(k) for k in raw.names() if k.rpartition(".")[0] == module
                   and k.rpartition(".")[2].startswith("weight")}
        if set(present) != set(expected):
            raise error(f"{module}: tensors {sorted(present)}, expected {sorted(expected)} for {fmt.kind.value}")
        for suffix, (shape_, dtype) in expected.items():
            e = present[suffix]
            if (tuple(e.shape), e.dtype) != (shape_, dtype):
                raise error(f"{module}.{suffix}: {list(e.shape)} {e.dtype}, expected {list(shape_)} {dtype}")
        name = f"{module}.weight"
        table[name] = TensorInfo(shape, fmt)
        taken.update(f"{module}.{s}" for s in present)
        load = lambda present=present, fmt=fmt, shape=shape: fmt.scheme.from_compressed_tensors(
            {s: e.load() for s, e in present.items()}, fmt, shape)
        for role, (pshape, pdtype) in fmt.part_shapes(shape).items():
            entries[part_name(name, role, fmt)] = Entry(tuple(pshape), pdtype,
                                                        lambda load=load, role=role: load()[role])
    dense = raw.with_entries(remove=taken)
    floats = tuple(DTYPES.values())
    dense = dense.keep([t for t in dense.names() if dense.entry(t).dtype in floats])
    record = None
    if modules:
        record = {"method": "compressed-tensors", "imported": True, "format": CT_FORMAT, "linears": len(modules),
                  "config_groups": {g: v.get("weights") for g, v in sorted(qc.get("config_groups", {}).items())}}
    return dense.with_entries(entries), table, record


def _refuse_unsupported(qc: dict, error: type[Exception]) -> None:
    """Whole-model features optc cannot hold: a quantized KV cache, sparsity, transforms (rotations)."""
    if qc.get("kv_cache_scheme"):
        raise error("compressed-tensors kv_cache_scheme (a quantized KV cache) is not supported")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise error(f"compressed-tensors sparsity format {sparsity.get('format')!r} is not supported")
    if qc.get("transform_config", {}).get("config_groups"):
        raise error("compressed-tensors transform_config (weight rotations applied at run time) is not supported")


def _group_of(module: str, qc: dict, error: type[Exception]) -> dict:
    """The first config group whose targets name `module` (not in `ignore`)."""
    def named(patterns) -> bool:
        return any(p == "Linear" or p == module or (p.startswith("re:") and re.match(p[3:], module))
                   for p in patterns or [])

    if named([p for p in qc.get("ignore") or [] if p != "Linear"]):
        raise error(f"{module}: has quantized tensors but the config's `ignore` names it")
    for group in (qc.get("config_groups") or {}).values():
        if named(group.get("targets")):
            return group
    raise error(f"{module}: has quantized tensors but no config group targets it")


def _format_of(module: str, group: dict, qc: dict, raw: TensorStore,
               error: type[Exception]) -> tuple[Format, tuple[int, int]]:
    """The optc format of a module in `group` and its logical (N, K) shape; errors name what has no format."""
    fmt_name = group.get("format") or qc.get("format")  # a `mixed-precision` model names it per group
    args = dict(group.get("weights") or {})
    if fmt_name != CT_FORMAT:
        raise error(f"{module}: compressed-tensors format {fmt_name!r} is not supported; supported: {CT_FORMAT!r}")
    if group.get("input_activations") or group.get("output_activations"):
        raise error(f"{module}: activation quantization is not supported (weight-only {CT_FORMAT} only)")
    if args.get("actorder") not in (None, "weight", "static"):  # `weight`: calibration order only, no g_idx
        raise error(f"{module}: actorder {args.get('actorder')!r} is not supported")
    scale = raw.entry(f"{module}{SCALE}")
    dtypes = {v: k for k, v in DTYPES.items()}
    if scale.dtype not in dtypes:
        raise error(f"{module}{SCALE}: dtype {scale.dtype} is not supported; supported: {list(DTYPES)}")
    group_size = args.get("group_size")
    strategy = args.get("strategy") or ("group" if (group_size or 0) > 0 else "channel" if group_size == -1 else None)
    theirs = {"num_bits": args.get("num_bits"), "type": args.get("type", "int"),
              "symmetric": args.get("symmetric", True), "group_size": group_size if strategy == "group" else None,
              "strategy": strategy, "dynamic": args.get("dynamic", False)}
    supported = "supported: int4 groups of 32/64/128 (symmetric or not) and int8 per channel, symmetric"
    try:
        fmt = quantized_format(int(theirs["num_bits"] or 0), dtypes[scale.dtype], theirs["group_size"],
                               zero_point=not theirs["symmetric"])
    except (InputError, ValueError):
        fmt = None
    ours = fmt.scheme.compressed_tensors_args(fmt) if fmt is not None else None
    if ours is None or {k: ours.get(k) for k in ARG_KEYS} != theirs:
        raise error(f"{module}: compressed-tensors weights {json.dumps(theirs)} have no optc format; {supported}")
    shape_key = f"{module}.weight_shape"
    if shape_key not in raw:
        raise error(f"{module}: no weight_shape tensor")
    n, k = (int(v) for v in raw.get(shape_key).tolist())
    try:
        fmt.check_shape((n, k), f"{module}.weight")
    except InputError as e:
        raise error(str(e)) from None
    return fmt, (n, k)


def _expected(fmt: Format, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The checkpoint tensors of one module in `fmt`: suffix -> (shape, dtype), from the scheme's own writer."""
    meta = {r: torch.empty(s, dtype=d, device="meta") for r, (s, d) in fmt.part_shapes(shape).items()}
    return {s: (tuple(t.shape), t.dtype) for s, t in fmt.scheme.to_compressed_tensors(meta, fmt, shape).items()}
