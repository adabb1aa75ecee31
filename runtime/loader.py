"""Bind an opened artifact's graph to kernels on a device: the runtime's Model.

The artifact is opened (and checked: schema, sizes, sha256, target, graph against weights) by
`optc.core.artifact.read`; only JSON and safetensors are read, nothing is unpickled. The runtime never
imports the sources or the passes.
"""

from __future__ import annotations

from optc.core.artifact import Artifact
from optc.core.ir import REFERENCE_KERNEL, Graph
from optc.core.ops.sharding import shard
from optc.runtime.model import Model


def load_model(artifact: Artifact, device: str = "cpu", rank: int = 0, world_size: int = 1,
               group: object = None, use_references: bool = False) -> Model:
    """The artifact's graph bound to the kernels its nodes name (every op's torch reference with
    `use_references`: what evaluation scores), with its weights on `device`; with a `group`, tensor-parallel
    rank `rank` of `world_size`'s graph and weight slices (optc/core/ops/sharding.py; ShardError when
    the model does not split that many ways), its collectives over `group`."""
    graph, store = (artifact.graph, artifact.store) if group is None else shard(
        artifact.graph, artifact.store, rank, world_size)
    impls = {} if use_references else _impls(graph)
    return Model(graph, store, device, kv_spec=artifact.manifest.kv_layout, impls=impls, group=group,
                 use_references=use_references)


def _impls(graph: Graph) -> dict:
    """Implementations for the non-reference kernels the graph's nodes are bound to."""
    names = {n.kernel for n in graph.nodes} - {REFERENCE_KERNEL}
    if not names:
        return {}
    from optc.kernels.registry import impls  # Triton launchers adapted to the op signature

    return impls(names)
