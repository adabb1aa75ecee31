"""Bind every node to the first kernel for the recipe's target that supports it, else the torch reference."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from optc.core.ir import REFERENCE_KERNEL, Graph, Node
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.kernels.registry import KERNELS, KernelQuery, select


class SelectKernels(Pass):
    """Bind every node to the first kernel for the recipe's target that supports it, else the torch reference."""

    @dataclass(frozen=True)
    class Options:
        disable: tuple[str, ...] = field(default=(), metadata={
            "choices": tuple(KERNELS), "help": "kernels not to use (ablations); their nodes get torch"})
        enable: tuple[str, ...] = field(default=(), metadata={
            "choices": tuple(k.name for k in KERNELS.values() if not k.by_default),
            "help": "kernels that are off unless named here"})

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        chosen = [self._choose(graph, n, ctx.target) for n in graph.nodes]
        stats = {"target": ctx.target, "kernels": dict(sorted(Counter(chosen).items()))}
        if all(n.attrs.get("kernel") == k for n, k in zip(graph.nodes, chosen, strict=True)):
            return PassResult(graph, store, changed=False, stats=stats)
        graph = graph.copy()
        graph.nodes = [Node(n.name, n.op, n.inputs, n.outputs, {**n.attrs, "kernel": k}, n.params)
                       for n, k in zip(graph.nodes, chosen, strict=True)]
        return PassResult(graph, store, changed=True, stats=stats)

    def ensures(self, graph: Graph) -> None:
        for n in graph.nodes:
            kernel = n.attrs.get("kernel", "")  # recorded on every node, the reference's name too
            if kernel != REFERENCE_KERNEL and (kernel not in KERNELS or KERNELS[kernel].op != n.op):
                raise AssertionError(f"{n.name} ({n.op}) is bound to {kernel!r}")

    def _choose(self, graph: Graph, node: Node, target: str) -> str:
        spec = select(_query(graph, node), target, self.options.enable)
        return spec.name if spec is not None and spec.name not in self.options.disable else REFERENCE_KERNEL


def _query(graph: Graph, node: Node) -> KernelQuery:
    """What the registry's predicates look at, read off the node, its params and the model config."""
    c, a = graph.config, node.attrs
    weight = graph.tensors.get(node.params.get("weight", ""))
    return KernelQuery(
        op=node.op, dtype=c.dtype,
        weight=weight.format if weight else None, weight_shape=tuple(weight.shape) if weight else (),
        hidden_size=c.hidden_size,
        num_heads=a.get("num_heads", 0), num_kv_heads=a.get("num_kv_heads", 0), head_dim=a.get("head_dim", 0),
        kv_dtype=a.get("kv_dtype"), kv_block_size=a.get("kv_block_size"),
    )
