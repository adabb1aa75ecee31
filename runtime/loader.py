"""Bind an opened artifact's graph to kernels on a device: the runtime's Model.

The artifact is opened (and checked: schema, sizes, sha256, target, graph against weights) by
`optc.core.artifact.read`; only JSON and safetensors are read, nothing is unpickled. A weights file that is
truncated, rewritten or replaced after `read` checked it and before the weights are read is an ArtifactError
naming it (`check_unchanged`), not a crash or another model's weights. On a GPU, the per-M kernel tables
the build left to measure are measured first (`_refine_kernel_choice`). The runtime never imports the
sources or the passes.
"""

from __future__ import annotations

import os

from optc.core.artifact import Artifact, check_unchanged
from optc.core.ir import REFERENCE_KERNEL, Graph
from optc.core.ops.sharding import shard
from optc.core.ops.stages import plan_stages, stage_graph
from optc.runtime.model import Model


def load_model(artifact: Artifact, device: str = "cpu", rank: int = 0, world_size: int = 1,
               group: object = None, use_references: bool = False, stage: int = 0, num_stages: int = 1) -> Model:
    """The artifact's graph bound to the kernels its nodes name (every op's torch reference with
    `use_references`: what evaluation scores), with its weights on `device`; with a `group`, tensor-parallel
    rank `rank` of `world_size`'s graph and weight slices (optc/core/ops/sharding.py; ShardError when
    the model does not split that many ways), its collectives over `group`, of pipeline stage `stage` of
    `num_stages` (optc/core/ops/stages.py: its layers only; StageError when the model has fewer layers)."""
    graph = stage_graph(artifact.graph, plan_stages(artifact.graph, num_stages), stage)
    graph, store = (graph, artifact.store) if group is None else shard(graph, artifact.store, rank, world_size)
    if not use_references and str(device).startswith("cuda"):
        graph = _refine_kernel_choice(graph, device)
    impls = {} if use_references else _impls(graph)
    try:
        model = Model(graph, store, device, kv_spec=artifact.manifest.kv_layout, impls=impls, group=group,
                      use_references=use_references)
    except Exception as e:  # a weights file truncated or replaced while it was read is named; anything else raises
        check_unchanged(artifact, e)
        raise
    check_unchanged(artifact)  # a file replaced whole reads without error, as another model's weights
    return model


def _refine_kernel_choice(graph: Graph, device: str) -> Graph:
    """The graph with the per-M tables of its nodes with several candidate kernels measured on this GPU
    (optc.kernels.choose_cuda; cached per device, so only a first load measures); OPTC_KERNEL_REFINE=0
    keeps the build's default tables."""
    if os.environ.get("OPTC_KERNEL_REFINE", "1") == "0" or not any("kernel_candidates" in n.attrs for n in graph.nodes):
        return graph
    import torch

    from optc.kernels.choose_cuda import refine

    with torch.cuda.device(torch.device(device)):
        return refine(graph, torch.cuda.get_device_name())[0]


def _impls(graph: Graph) -> dict:
    """Implementations for the non-reference kernels the graph's nodes are bound to, their C++ extensions
    compiled now (about a minute, once per machine) rather than in the first request's step."""
    names = {n.kernel for n in graph.nodes} - {REFERENCE_KERNEL}
    if not names:
        return {}
    from optc.kernels.registry import compile_extensions, impls  # Triton launchers adapted to the op signature

    compile_extensions(names | {k for n in graph.nodes for _, k in n.attrs.get("kernel_by_m") or ()})
    return impls(names)
