"""Fuse the q, k and v projections of each attention into one linear with split outputs (through the
per-head q/k norms of QK-norm families: the norms read the fused linear's split outputs)."""

from __future__ import annotations

from optc.core.ir import Graph
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.passes._linears import can_fuse, fuse


class FuseQKV(Pass):
    """Fuse the q, k and v projections of each attention into one linear with split outputs."""

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        producer = graph.producers()
        consumers = graph.consumers()
        groups = []
        for node in graph.nodes:
            # rope(linear_q(x), linear_k(x)) feeding attention(_, _, linear_v(x)) -> linear_qkv(x) {split};
            # q and k may pass a per-head norm first (QK-norm: rope(rms_norm(linear_q(x)) {head_dim}, ...))
            if node.op == "rope":
                attn = next((c for c in consumers.get(node.outputs[0], []) if c.op == "attention"), None)
                if attn is None:
                    continue
                v = attn.inputs[2]
            elif node.op == "rope_kv_store":
                v = node.inputs[2]
            else:
                continue
            group = [_projection(producer, node.inputs[0]), _projection(producer, node.inputs[1]), producer.get(v)]
            if can_fuse(graph, group):
                groups.append(group)
        if not groups:
            return PassResult(graph, store, changed=False, stats={"fused": 0})
        graph, store = fuse(graph, store, groups, "qkv_proj")
        return PassResult(graph, store, changed=True, stats={"fused": len(groups)})


def _projection(producer: dict, value: str):
    """The node producing q or k before its per-head norm, if it has one."""
    node = producer.get(value)
    if node is not None and node.op == "rms_norm" and node.attrs.get("head_dim"):
        return producer.get(node.inputs[0])
    return node
