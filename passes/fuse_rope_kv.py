"""Fuse each rope with its attention's KV-cache store into one rope_kv_store."""

from __future__ import annotations

from optc.core.ir import Graph, Node
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult


class FuseRopeKv(Pass):
    """Fuse each rope with its attention's KV-cache store into one rope_kv_store."""

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        producer, consumers = graph.producers(), graph.consumers()
        fused: dict[str, Node] = {}  # attention name -> the rope fused into its KV store
        for node in graph.nodes:
            # attention(rope(q, k, pos), v) -> attention(rope_kv_store(q, k, v, pos)) {kv_stored}
            if node.op != "attention" or node.attrs.get("kv_stored"):
                continue
            rope = producer.get(node.inputs[0])
            if rope is None or rope.op != "rope" or producer.get(node.inputs[1]) is not rope:
                continue
            if rope.outputs != node.inputs[:2] or any(
                    [c.name for c in consumers.get(v, [])] != [node.name] or v in graph.outputs
                    for v in rope.outputs):
                continue  # rotated q or k is read elsewhere: the fused node only returns q
            fused[node.name] = rope
        if not fused:
            return PassResult(graph, store, changed=False, stats={"fused": 0})
        graph = graph.copy()
        ropes = {r.name for r in fused.values()}
        nodes = []
        for node in graph.nodes:
            if node.name in ropes:
                continue
            rope = fused.get(node.name)
            if rope is not None:  # just before the attention, where q, k, v and positions are defined
                q, k, pos = rope.inputs
                name = f"{rope.name.rsplit('.', 1)[0]}.rope_kv_store" if "." in rope.name else f"{rope.name}_kv_store"
                keep = ("layer", "num_heads", "num_kv_heads", "head_dim", "kv_block_size", "kv_dtype")
                attrs = {a: node.attrs[a] for a in keep if a in node.attrs}
                attrs |= {a: rope.attrs[a] for a in ("rope_table", "rotary_dim") if a in rope.attrs}
                nodes.append(Node(name, "rope_kv_store", [q, k, node.inputs[2], pos], [rope.outputs[0]], attrs))
                node = Node(node.name, node.op, [rope.outputs[0]], list(node.outputs),
                            {**node.attrs, "kv_stored": True}, dict(node.params))
            nodes.append(node)
        graph.nodes = nodes
        return PassResult(graph, store, changed=True, stats={"fused": len(fused)})

    def ensures(self, graph: Graph) -> None:
        for node in graph.nodes:
            if node.op == "attention" and node.attrs.get("kv_stored") and len(node.inputs) != 1:
                raise AssertionError(f"{node.name}: kv_stored attention must read only q")
