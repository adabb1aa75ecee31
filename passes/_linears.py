"""Shared by fuse_qkv and fuse_gate_up: merge sibling linears (same input, same weight format) into
one linear with `split` sizes whose outputs keep the original value names, so consumers are untouched.

Parts are concatenated along the output dimension by the format's scheme (`concat_rows`), for the
formats whose scheme allows it (`can_fuse`): int8 scales are per output channel and int4 groups run
along the input dimension; int4 weights with their own input permutation (act_order) do not fuse.
"""

from __future__ import annotations

from optc.core.formats import part_name
from optc.core.ir import Graph, Node, TensorInfo
from optc.core.store import Entry, TensorStore


def can_fuse(graph: Graph, nodes: list[Node | None]) -> bool:
    if any(n is None or n.op != "linear" or len(n.outputs) != 1 or "split" in n.attrs for n in nodes):
        return False
    if len({n.inputs[0] for n in nodes}) != 1 or len({n.kernel for n in nodes}) != 1:
        return False
    formats = {graph.tensors[n.params["weight"]].format for n in nodes}
    has_bias = {"bias" in n.params for n in nodes}
    if len(formats) != 1 or len(has_bias) != 1:
        return False
    fmt = formats.pop()
    if not fmt.scheme.can_concat_rows(fmt):
        return False
    if has_bias == {True} and len({graph.tensors[n.params["bias"]].format for n in nodes}) != 1:
        return False
    return True


def fuse(graph: Graph, store: TensorStore, groups: list[list[Node]], fused_name: str) -> tuple[Graph, TensorStore]:
    """Return a new graph and store in which each group of sibling linears is one split linear."""
    graph = graph.copy()
    by_name = {n.name: n for n in graph.nodes}
    replace: dict[str, Node] = {}
    drop: set[str] = set()
    entries: dict[str, Entry] = {}
    for group in groups:
        group = [by_name[n.name] for n in group]
        name = f"{group[0].name.rsplit('.', 1)[0]}.{fused_name}"
        sizes = [n.attrs["out_features"] for n in group]
        params = {}
        for role in group[0].params:
            tensor = f"{name}.{role}"
            srcs = [n.params[role] for n in group]
            info = graph.tensors[srcs[0]]
            fmt = info.format
            shape = (sum(graph.tensors[s].shape[0] for s in srcs), *info.shape[1:])
            graph.tensors[tensor] = TensorInfo(shape, fmt)
            for prole, (pshape, _) in fmt.part_shapes(shape).items():
                keys = [part_name(s, prole, fmt) for s in srcs]
                first = store.entry(keys[0])
                load = lambda keys=keys, r=prole, f=fmt: f.scheme.concat_rows(r, [store.get(k) for k in keys], f)
                entries[part_name(tensor, prole, fmt)] = Entry(tuple(pshape), first.dtype, load)
            params[role] = tensor
        attrs = {**group[0].attrs, "out_features": sum(sizes), "split": sizes}
        replace[group[0].name] = Node(
            name, "linear", list(group[0].inputs), [n.outputs[0] for n in group], attrs, params
        )
        drop.update(n.name for n in group[1:])
    graph.nodes = [replace.get(n.name, n) for n in graph.nodes if n.name not in drop]
    used = set(graph.used_tensors())
    stale = [t for t in graph.tensors if t not in used]
    removed = [
        part_name(t, r, graph.tensors[t].format)
        for t in stale
        for r in graph.tensors[t].format.part_shapes(graph.tensors[t].shape)
    ]
    for t in stale:
        del graph.tensors[t]
    return graph, store.with_entries(entries, remove=removed)
