"""The per-M kernel table of `target: cuda` linears: a default written at build time, refined by
measurement at the first load on a GPU and cached on disk.

A cuda build may run where there is no GPU, so select_kernels cannot time the candidates there (the
cpu target's optc.kernels.choose does). For a linear with more than one supporting kernel it records
`kernel_candidates` (every one, in table order) and, from `default_by_m`, `kernel`/`kernel_by_m`: rows
up to DECODE_MAX_M on the first decode kernel among the candidates, more rows on the first other one
(e.g. triton.w4a16_decode then triton.w4a16_prefill). That table is what runs when nothing refines it.

At load on a GPU the runtime (runtime/loader.py) calls `refine`: per distinct node shape (op, weight
format and shape, activation dtype, candidates) it times every candidate at each M of M_BUCKETS on
random weights of the node's format and shape (their values do not change these kernels' time), keeps
the fastest per bucket (ties: the earlier candidate) and writes that table into the nodes. Each result
is a JSON file under $OPTC_CACHE/kernel_choice/ (default ~/.cache/optc), named by a hash of the device
name, the shape, the candidates and their versions (a hash of each candidate's launcher and prepare
modules' source, and the torch and Triton versions), so a second load on the same device and code
measures nothing. `measure` is injectable (tests pass a fake timer); OPTC_KERNEL_REFINE=0 keeps the
default table. Not here: which kernels support a node (registry), Triton's own autotuning (each
candidate autotunes its tiles on its first call at a bucket, inside the measurement).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from optc.core.formats import DTYPES, INT4_TILES_PACKING, Format, tile_int4
from optc.core.ir import Graph, Node
from optc.core.ops import Param
from optc.kernels.choose import random_parts
from optc.kernels.registry import KERNELS, KernelSpec

CUDA_M_BUCKETS = (1, 4, 16, 64, 512)  # measured at the bound; the last one holds for any larger M
DECODE_MAX_M = {"triton.w4a16_decode": 16, "torch.int4pack": 16}  # decode kernels' rows in the default table
WARMUP, REPEATS = 3, 20  # timed calls per candidate and bucket (after the warm-up that autotunes)


@dataclass(frozen=True)
class Shape:
    """What a node's timing depends on: its op, weight format and shape, activation dtype, candidates."""

    op: str
    weight: Format
    weight_shape: tuple[int, int]
    dtype: str
    candidates: tuple[str, ...]

    def describe(self) -> str:
        n, k = self.weight_shape
        return f"{self.op} {n}x{k} {self.weight.label} {self.dtype}"


# (candidate, shape, rows) -> seconds per call
Measure = Callable[[KernelSpec, Shape, int], float]


def default_by_m(candidates: list[str]) -> list[list]:
    """The build-time table: [[max_rows, kernel], ...], increasing, the last max_rows None (no bound)."""
    decode = next((c for c in candidates if c in DECODE_MAX_M), None)
    other = next((c for c in candidates if c not in DECODE_MAX_M), None)
    if decode is None or other is None:
        return [[None, candidates[0]]]
    return [[DECODE_MAX_M[decode], decode], [None, other]]


def refine(graph: Graph, device_name: str, measure: Measure | None = None, cache_dir: Path | None = None,
           buckets: tuple[int, ...] = CUDA_M_BUCKETS) -> tuple[Graph, dict[str, dict]]:
    """The graph with every node that records `kernel_candidates` bound to its measured per-M table
    (cached per device), and a report: shape -> {"by_m", "micros", "cached"}."""
    nodes, report, found = [], {}, {}
    for node in graph.nodes:
        shape = node_shape(graph, node)
        if shape is None:
            nodes.append(node)
            continue
        if shape not in found:
            found[shape] = _choose(shape, device_name, measure or time_on_cuda, cache_dir or default_cache_dir(),
                                   buckets)
            report[shape.describe()] = found[shape]
        by_m = found[shape]["by_m"]
        attrs = {k: v for k, v in node.attrs.items() if k not in ("kernel", "kernel_by_m")}
        attrs["kernel"] = by_m[0][1]
        if len(by_m) > 1:
            attrs["kernel_by_m"] = by_m
        nodes.append(Node(node.name, node.op, node.inputs, node.outputs, attrs, node.params))
    return replace(graph, nodes=nodes), report


def cached_choices(graph: Graph, cache_dir: Path | None = None) -> dict[str, dict[str, list]]:
    """Per node shape of `graph`, the tables refined on any device found in the cache: shape -> {device: by_m}
    (what `optc inspect` shows without a GPU)."""
    folder = cache_dir or default_cache_dir()
    wanted = {s.describe(): s for s in (node_shape(graph, n) for n in graph.nodes) if s is not None}
    out: dict[str, dict[str, list]] = {}
    for path in sorted(folder.glob("*.json")) if wanted and folder.is_dir() else ():
        entry = json.loads(path.read_text())
        shape = wanted.get(entry.get("shape", ""))
        if shape is not None and entry.get("key") == _key(shape, entry["device"]):
            out.setdefault(entry["shape"], {})[entry["device"]] = entry["by_m"]
    return out


def node_shape(graph: Graph, node: Node) -> Shape | None:
    """The node's Shape when it records two or more candidates over one (N, K) weight, else None."""
    candidates = node.attrs.get("kernel_candidates")
    weight = graph.tensors.get(node.params.get("weight", ""))
    if not candidates or len(candidates) < 2 or weight is None or len(weight.shape) != 2:
        return None
    return Shape(node.op, weight.format, tuple(weight.shape), graph.config.dtype, tuple(candidates))


def default_cache_dir() -> Path:
    """$OPTC_CACHE/kernel_choice (OPTC_CACHE defaults to ~/.cache/optc, as the frontend's cache_root)."""
    return Path(os.environ.get("OPTC_CACHE", Path.home() / ".cache" / "optc")) / "kernel_choice"


def time_on_cuda(spec: KernelSpec, shape: Shape, m: int) -> float:
    """Seconds per call of `spec` on the current CUDA device at M = m (median of REPEATS event-timed calls,
    after WARMUP calls, the first of which autotunes and prepares)."""
    fmt = shape.weight
    parts = {r: t.cuda() for r, t in _random_parts(fmt, shape.weight_shape).items()}
    params = {"weight": Param(parts, fmt)}
    if spec.prepare is not None:
        params = _load(spec.prepare)(params)
    fn = _load(spec.launcher)
    x = torch.randn(m, shape.weight_shape[1], device="cuda").to(DTYPES[shape.dtype])
    weight = params["weight"]
    for _ in range(WARMUP):
        fn(x, weight.parts, weight.format)
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x, weight.parts, weight.format)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return sorted(times)[len(times) // 2]


def _choose(shape: Shape, device_name: str, measure: Measure, cache_dir: Path, buckets: tuple[int, ...]) -> dict:
    key = _key(shape, device_name)
    path = cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    if path.is_file():
        entry = json.loads(path.read_text())
        if entry.get("key") == key and entry.get("buckets") == list(buckets):
            return {"by_m": entry["by_m"], "micros": entry["micros"], "cached": True}
    micros = {m: {c: round(measure(KERNELS[c], shape, m) * 1e6, 2) for c in shape.candidates} for m in buckets}
    winners = [min(shape.candidates, key=lambda c, t=micros[m]: (t[c], shape.candidates.index(c))) for m in buckets]
    by_m: list[list] = []
    for i, w in enumerate(winners):
        bound = None if i == len(buckets) - 1 else buckets[i]
        if by_m and by_m[-1][1] == w:
            by_m[-1][0] = bound
        else:
            by_m.append([bound, w])
    entry = {"key": key, "device": device_name, "shape": shape.describe(), "buckets": list(buckets),
             "by_m": by_m, "micros": {str(m): t for m, t in micros.items()}}
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(entry, indent=1))
    tmp.replace(path)  # atomic: a concurrent loader reads the old file or the new one
    return {"by_m": by_m, "micros": entry["micros"], "cached": False}


def _key(shape: Shape, device_name: str) -> str:
    import triton

    versions = {c: _version(KERNELS[c]) for c in shape.candidates}
    return json.dumps({"device": device_name, "op": shape.op, "weight": shape.weight.to_json(),
                       "shape": list(shape.weight_shape), "dtype": shape.dtype, "candidates": versions,
                       "torch": torch.__version__, "triton": triton.__version__}, sort_keys=True)


def _version(spec: KernelSpec) -> str:
    """A hash of the source of the modules `spec` runs (launcher and prepare): any edit measures again."""
    modules = sorted({p.split(":")[0] for p in (spec.launcher, spec.prepare) if p})
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(importlib.import_module(f"optc.kernels.{module}").__file__).read_bytes())
    return digest.hexdigest()[:16]


def _random_parts(fmt: Format, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    # valid codes, scales and zeros (an n8_tiles weight: k8_lsb's, laid out)
    if fmt.packing != INT4_TILES_PACKING:
        return random_parts(fmt, shape)
    return tile_int4(random_parts(replace(fmt, packing="k8_lsb"), shape), fmt)


def _load(path: str) -> Callable:
    module, function = path.split(":")
    return getattr(importlib.import_module(f"optc.kernels.{module}"), function)
