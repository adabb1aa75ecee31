"""Bind an opened artifact's graph to kernels on a device: the runtime's Model.

The artifact is opened (and checked: schema, sizes, sha256, target, graph against weights) by
`optc.core.artifact.read`; only JSON and safetensors are read, nothing is unpickled. The runtime never
imports the sources or the passes.
"""

from __future__ import annotations

from optc.core.artifact import Artifact
from optc.core.ir import REFERENCE_KERNEL, Graph
from optc.runtime.model import Model


def load_model(artifact: Artifact, device: str = "cpu") -> Model:
    """The artifact's graph bound to the kernels its nodes name, with its weights on `device`."""
    return Model(artifact.graph, artifact.store, device, kv_spec=artifact.manifest.kv_layout,
                 impls=_impls(artifact.graph))


def _impls(graph: Graph) -> dict:
    """Implementations for the non-reference kernels the graph's nodes are bound to."""
    names = {n.kernel for n in graph.nodes} - {REFERENCE_KERNEL}
    if not names:
        return {}
    from optc.kernels.registry import impls  # Triton launchers adapted to the op signature

    return impls(names)
