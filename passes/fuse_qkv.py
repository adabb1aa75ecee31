"""Fuse the q, k and v projections of each attention into one linear with split outputs."""

from __future__ import annotations

from dataclasses import dataclass

from optc.ir import Graph
from optc.passes._linears import can_fuse, fuse
from optc.passmanager import PassContext, PassResult
from optc.store import TensorStore


class FuseQKV:
    """Fuse the q, k and v projections of each attention into one linear with split outputs."""

    name = "fuse_qkv"

    @dataclass(frozen=True)
    class Options:
        pass

    def __init__(self, options: Options | None = None):
        self.options = options or self.Options()

    def requires(self, graph: Graph) -> None:
        pass

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        producer = graph.producers()
        consumers = graph.consumers()
        groups = []
        for node in graph.nodes:
            # rope(linear_q(x), linear_k(x)) feeding attention(_, _, linear_v(x)) -> linear_qkv(x) {split}
            if node.op == "rope":
                attn = next((c for c in consumers.get(node.outputs[0], []) if c.op == "attention"), None)
                if attn is None:
                    continue
                v = attn.inputs[2]
            elif node.op == "rope_kv_store":
                v = node.inputs[2]
            else:
                continue
            group = [producer.get(node.inputs[0]), producer.get(node.inputs[1]), producer.get(v)]
            if can_fuse(graph, group):
                groups.append(group)
        if not groups:
            return PassResult(graph, store, changed=False, stats={"fused": 0})
        graph, store = fuse(graph, store, groups, "qkv_proj")
        return PassResult(graph, store, changed=True, stats={"fused": len(groups)})

    def ensures(self, graph: Graph) -> None:
        pass
