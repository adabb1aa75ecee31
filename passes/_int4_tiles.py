"""select_kernels' `int4_packing: n8_tiles` (target cuda): store int4_g linear weights in the packing the
CUDA decode kernels read (optc/core/formats/int4_tiles.py), so the layout is the compiler's and the artifact
records it (each tensor's format in graph.json; the counts and what stayed k8_lsb, and why, in the pass stats).

A weight is laid out when every node that reads it is a linear reading it as `weight` (an lm_head or an
embedding indexes the rows of the k8_lsb parts) and the packing can hold it (16-bit scales, whole tiles
of 8 rows, no act_order: `tiles_refusal`); the others keep k8_lsb and their kernels. The new part is a
lazy store entry over the old ones (nothing is materialized until the artifact is written).
"""

from __future__ import annotations

from optc.core.formats import (
    INT4_PACKING,
    INT4_TILES_PACKING,
    FormatKind,
    part_name,
    tile_int4,
    tiles_format,
    tiles_refusal,
)
from optc.core.ir import Graph, TensorInfo
from optc.core.store import Entry, TensorStore


def lay_out_tiles(graph: Graph, store: TensorStore | None) -> tuple[Graph, TensorStore | None, dict]:
    """(graph, store, stats) with every eligible k8_lsb int4_g linear weight packed n8_tiles."""
    readers: dict[str, set[tuple[str, str]]] = {}
    for n in graph.nodes:
        for role, tensor in n.params.items():
            readers.setdefault(tensor, set()).add((n.op, role))
    new = graph.copy()
    entries: dict[str, Entry] = {}
    removed: list[str] = []
    kept: dict[str, str] = {}
    for name, info in graph.tensors.items():
        fmt = info.format
        if fmt.kind is not FormatKind.INT4_G or fmt.packing != INT4_PACKING or name not in readers:
            continue
        if readers[name] != {("linear", "weight")}:
            kept[name] = f"read by {', '.join(sorted(op for op, _ in readers[name]))}, not only as a linear's weight"
            continue
        refusal = tiles_refusal(fmt, info.shape)
        if refusal is not None:
            kept[name] = refusal
            continue
        tiled = tiles_format(fmt)
        keys = {role: part_name(name, role, fmt) for role in fmt.part_shapes(info.shape)}
        (role, (shape, dtype)), = tiled.part_shapes(info.shape).items()
        if store is not None:
            load = lambda keys=keys, f=tiled: tile_int4({r: store.get(k) for r, k in keys.items()}, f)["qtiles"]
            entries[part_name(name, role, tiled)] = Entry(shape, dtype, load)
            removed += keys.values()
        new.tensors[name] = TensorInfo(info.shape, tiled)
    stats = {"int4_packing": INT4_TILES_PACKING,
             "laid_out": sum(new.tensors[n].format != info.format for n, info in graph.tensors.items())}
    if kept:
        stats["kept_k8_lsb"] = kept
    out_store = store.with_entries(entries, remove=removed) if store is not None else None
    return new, out_store, stats

