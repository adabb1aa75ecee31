"""Fuse the gate and up projections of each MLP into one linear with split outputs."""

from __future__ import annotations

from optc.core.ir import Graph
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.passes._linears import can_fuse, fuse


class FuseGateUp(Pass):
    """Fuse the gate and up projections of each MLP into one linear with split outputs."""

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        producer = graph.producers()
        groups = []
        for node in graph.nodes:
            # gated_act(linear_gate(x), linear_up(x)) -> gated_act(linear_gate_up(x) {split})
            if node.op != "gated_act":
                continue
            group = [producer.get(node.inputs[0]), producer.get(node.inputs[1])]
            if can_fuse(graph, group):
                groups.append(group)
        if not groups:
            return PassResult(graph, store, changed=False, stats={"fused": 0})
        graph, store = fuse(graph, store, groups, "gate_up_proj")
        return PassResult(graph, store, changed=True, stats={"fused": len(groups)})
