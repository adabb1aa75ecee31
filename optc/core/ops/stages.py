"""Pipeline stages: the artifact's graph cut into P consecutive runs of layers, one per pipeline stage,
balanced by weight bytes. Derived at load, as tensor-parallel shards are (optc/core/ops/sharding.py,
which then splits each stage's graph over its T ranks); the artifact stays one artifact.

A node belongs to the layer its `layer` attr names; a node without one belongs to the layer of the
node before it (the final norm and the lm_head to the last layer), or to the first layer when none
came before (the embedding). Stage s holds layers [first, stop): the cut minimizes the largest
stage's weight bytes (a tensor two stages use, such as a tied embedding, counts in both: each
holds a copy). Its graph reads the graph's inputs (ids and positions: every stage builds the step's
batch) and the values earlier stages produce that it or a later stage reads (`receives`: the
residual stream, one (T, hidden) value or two where a fused add+norm carries the residual
apart); it ends with the values later stages read (`sends`), the last stage with the logits. Each
stage's KV cache holds only its layers (its nodes' `layer` attrs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import torch

from optc.core.errors import InputError
from optc.core.ir import GRAPH_INPUTS, Graph


class StageError(InputError):
    """A model that cannot be cut into the asked number of pipeline stages; the message says why."""


@dataclass(frozen=True)
class Stage:
    index: int
    layers: tuple[int, int]  # [first, stop): the layers (and their KV caches) this stage holds
    weight_bytes: int  # stored bytes of the tensors its nodes use
    receives: tuple[str, ...]  # values it takes from the stage before (none for stage 0)
    sends: tuple[str, ...]  # values it hands to the stage after (the graph's outputs for the last)


def plan_stages(graph: Graph, size: int) -> list[Stage]:
    """The graph cut into `size` stages of consecutive layers, balanced by weight bytes; StageError
    when it has fewer layers than stages or its nodes do not run layer after layer."""
    if size < 1:
        raise StageError(f"pipeline_parallel_size must be >= 1, got {size}")
    num_layers = graph.config.num_layers
    if size > num_layers:
        raise StageError(f"cannot cut {num_layers} layers into {size} pipeline stages: a stage holds at least "
                         f"one layer (pipeline-parallel sizes that work for this model: 1..{num_layers})")
    layer_of = _layers(graph)
    layer_bytes = [0] * num_layers
    for layer in range(num_layers):
        used = {t for n, at in zip(graph.nodes, layer_of, strict=True) if at == layer for t in n.params.values()}
        layer_bytes[layer] = sum(_tensor_bytes(graph, t) for t in used)
    cuts = _balanced_cuts(tuple(layer_bytes), size)
    bounds = list(zip((0, *cuts), (*cuts, num_layers), strict=True))
    stage_of = [next(s for s, (a, b) in enumerate(bounds) if a <= layer < b) for layer in layer_of]
    produced_in = {v: stage_of[i] for i, n in enumerate(graph.nodes) for v in n.outputs}
    last_read = {v: size - 1 for v in graph.outputs}
    for i, n in enumerate(graph.nodes):
        for v in n.inputs:
            if v in produced_in:
                last_read[v] = max(last_read.get(v, 0), stage_of[i])
    order = list(produced_in)  # values in the order the nodes produce them
    stages = []
    for s, (first, stop) in enumerate(bounds):
        used = {t for n, st in zip(graph.nodes, stage_of, strict=True) if st == s for t in n.params.values()}
        crossing = lambda boundary: tuple(v for v in order if produced_in[v] < boundary <= last_read[v])
        sends = graph.outputs if s == size - 1 else crossing(s + 1)
        stages.append(Stage(s, (first, stop), sum(_tensor_bytes(graph, t) for t in used), crossing(s), sends))
    return stages


def stage_graph(graph: Graph, stages: list[Stage], index: int) -> Graph:
    """Stage `index`'s graph: its nodes, the graph's inputs and the values it receives as inputs, the values
    it sends as outputs. One stage: the graph as it is."""
    if len(stages) == 1:
        return graph
    stage = stages[index]
    layer_of = _layers(graph)
    first, stop = stage.layers
    nodes = [n for n, layer in zip(graph.nodes, layer_of, strict=True) if first <= layer < stop]
    return replace(graph, nodes=nodes, inputs=(*GRAPH_INPUTS, *stage.receives), outputs=stage.sends)


# -- helpers ----------------------------------------------------------------------------------------


def _layers(graph: Graph) -> list[int]:
    """Each node's layer: its `layer` attr, else the previous node's (the first layer before any)."""
    out, layer = [], 0
    for n in graph.nodes:
        if "layer" in n.attrs:
            if n.attrs["layer"] < layer:
                raise StageError(f"node {n.name} of layer {n.attrs['layer']} comes after layer {layer}'s nodes: "
                                 "the graph does not run layer after layer, so it cannot be cut into stages")
            layer = n.attrs["layer"]
        out.append(layer)
    return out


def _tensor_bytes(graph: Graph, name: str) -> int:
    info = graph.tensors[name]
    parts = info.format.part_shapes(info.shape).values()
    return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in parts)


def _balanced_cuts(layer_bytes: tuple[int, ...], size: int) -> tuple[int, ...]:
    """The first layers of stages 1 .. size-1 that minimize the largest stage's bytes (earlier cuts on ties)."""
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    @cache
    def best(start: int, parts: int) -> tuple[int, tuple[int, ...]]:
        """(largest stage bytes, cuts) of layers [start, L) in `parts` stages."""
        if parts == 1:
            return prefix[-1] - prefix[start], ()
        options = []
        for cut in range(start + 1, len(layer_bytes) - parts + 2):
            rest, cuts = best(cut, parts - 1)
            options.append((max(prefix[cut] - prefix[start], rest), (cut, *cuts)))
        return min(options)

    return best(0, size)[1]
