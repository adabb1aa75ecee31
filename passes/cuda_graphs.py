"""Plan the CUDA-graph batch-size buckets of decode steps and record them in the manifest.

The pass changes no node: the runtime captures one graph per bucket when it loads the artifact on
a CUDA device, and this pass only writes the plan (`manifest.json` -> `cuda_graphs: {batch_sizes}`)
and says in its stats how many KV nodes stay on a torch reference that syncs with the host (the
runtime refuses to capture such a graph and runs eager; `select_kernels` before this pass fixes
it). On `target: cpu` it is a no-op: CUDA graphs do not exist there, so no section is recorded
(the manifest keeps `cuda_graphs: null`) and the stats say why. `changed` is always False, since
the graph is never rewritten; a second run records the same section.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from optc.core.ir import Graph
from optc.core.ops import host_syncing_nodes
from optc.core.settings import CUDA_GRAPH_BATCH_SIZES
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult


class CudaGraphs(Pass):
    """Plan the CUDA-graph batch-size buckets of decode steps and record them in the manifest."""

    @dataclass(frozen=True)
    class Options:
        batch_sizes: tuple[int, ...] = field(default=CUDA_GRAPH_BATCH_SIZES, metadata={
            "min": 1, "help": "decode batch sizes to capture a graph for (sorted and deduplicated)"})

        def __post_init__(self) -> None:
            sizes = tuple(self.batch_sizes)
            if not sizes:
                raise ValueError("cuda_graphs: batch_sizes is empty; give at least one size >= 1")
            bad = [b for b in sizes if isinstance(b, bool) or not isinstance(b, int) or b < 1]
            if bad:
                raise ValueError(f"cuda_graphs: batch_sizes must be ints >= 1, got {bad}")
            object.__setattr__(self, "batch_sizes", tuple(sorted(set(sizes))))

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        if ctx.target != "cuda":
            stats = {"target": ctx.target, "batch_sizes": [], "note": "no-op: CUDA graphs need target cuda"}
            return PassResult(graph, store, changed=False, stats=stats)
        sizes = list(self.options.batch_sizes)
        # attention(q, k, v) {kernel: torch} -> eager at runtime (the reference syncs on seq_lens)
        eager_only = [n.name for n in host_syncing_nodes(graph)]
        # moe runs eager on CUDA: its reference syncs, and triton.fused_moe (off by default) is unrun on a GPU
        moe = [n.name for n in graph.nodes if n.op == "moe"]
        mla = [n.name for n in graph.nodes if n.op == "mla_attention"]  # no CUDA MLA kernel: the reference syncs
        if mla:
            ctx.progress(f"cuda_graphs: {len(mla)} mla_attention node(s) (first: {mla[0]}) have no CUDA kernel and "
                         "run on their reference, which reads the batch's lengths on the host: the runtime runs eager")
        if moe:
            ctx.progress(f"cuda_graphs: {len(moe)} moe node(s) (first: {moe[0]}) have no CUDA kernel and run on "
                         "their reference, which reads the expert counts on the host: the runtime runs eager")
        elif eager_only:
            ctx.progress(f"cuda_graphs: {len(eager_only)} KV node(s) run on torch references that sync "
                         f"(first: {eager_only[0]}); the runtime will not capture graphs "
                         "(add select_kernels before cuda_graphs)")
        stats = {"target": ctx.target, "batch_sizes": sizes, "num_buckets": len(sizes),
                 "num_eager_only_nodes": len(eager_only)}
        return PassResult(graph, store, changed=False, stats=stats,
                          manifest={"cuda_graphs": {"batch_sizes": sizes}})
