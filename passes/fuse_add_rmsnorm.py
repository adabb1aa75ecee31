"""Fuse each residual add with the RMSNorm that reads its sum into one add_rms_norm."""

from __future__ import annotations

from optc.core.ir import Graph, Node
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult


class FuseAddRmsnorm(Pass):
    """Fuse each residual add with the RMSNorm that reads its sum into one add_rms_norm."""

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        producer = graph.producers()
        pairs: dict[str, Node] = {}  # add name -> the rms_norm fused into it
        for node in graph.nodes:
            # rms_norm(add(x, r), w) -> add_rms_norm(x, r, w), which also returns the sum x + r
            if node.op != "rms_norm" or node.attrs.get("head_dim"):  # a per-head norm reads no residual sum
                continue
            add = producer.get(node.inputs[0])
            if add is None or add.op != "add" or add.name in pairs:
                continue
            pairs[add.name] = node
        if not pairs:
            return PassResult(graph, store, changed=False, stats={"fused": 0})
        graph = graph.copy()
        fused_norms = {n.name for n in pairs.values()}
        nodes = []
        for node in graph.nodes:
            if node.name in fused_norms:
                continue
            norm = pairs.get(node.name)
            if norm is None:
                nodes.append(node)
                continue
            # at the add's position: x and r are defined, and defining the norm earlier is always safe.
            # It belongs to the norm's decoder block (layer i + 1 for layer i's mlp residual, none for the
            # final norm), not the add's: its normed output feeds only that block's linears, and AWQ folds
            # their scales into this norm's weight, which it does only for a norm inside their block.
            kept = {a: norm.attrs[a] for a in ("eps", "offset", "layer") if a in norm.attrs}
            nodes.append(Node(norm.name, "add_rms_norm", list(node.inputs), [norm.outputs[0], node.outputs[0]],
                              kept, dict(norm.params)))
        graph.nodes = nodes
        return PassResult(graph, store, changed=True, stats={"fused": len(pairs)})

    def ensures(self, graph: Graph) -> None:
        for node in graph.nodes:
            if node.op == "add_rms_norm" and (len(node.inputs), len(node.outputs)) != (2, 2):
                raise AssertionError(f"{node.name}: add_rms_norm takes (x, r) and returns (normed, sum)")
