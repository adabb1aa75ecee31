"""Merge a peft LoRA adapter into the dense linear weights: W += scale * (B @ A) * alpha / r, as peft's
`merge_and_unload()` does, so the artifact is the fine-tuned model and needs no adapter at run time.

It runs before quantization (a recipe lists it first): a quantized weight is refused by name, since merging into
it would round the delta away or double-quantize. The adapter is read and checked against the graph as the runtime
reads it (optc/core/lora.py: shapes, targets, another base model's dimensions); a fused linear (fuse_qkv,
fuse_gate_up) takes each projection's delta in its rows. The pass records the adapter's sha256 in its stats (the
manifest's passes), and marks each merged linear with `lora_merged` (that sha256), so a second run changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from optc.core.errors import InputError
from optc.core.formats import part_name
from optc.core.ir import Graph, Node
from optc.core.lora import linear_targets, load_adapter
from optc.core.store import TensorStore, transformed
from optc.frontend.passmanager import Pass, PassContext, PassResult

NO_RANK_LIMIT = 1 << 16  # merging has no slots to fill: any rank merges


class MergeLora(Pass):
    """Merge a peft LoRA adapter (folder `path`, times `scale`) into the dense linear weights."""

    @dataclass(frozen=True)
    class Options:
        path: str = field(default="", metadata={"help": "the peft adapter folder (adapter_config.json + "
                                                        "adapter_model.safetensors)"})
        scale: float = field(default=1.0, metadata={"help": "multiplies the adapter's alpha / r"})

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        if not self.options.path:
            raise InputError("merge_lora needs `path`: a peft adapter folder")
        adapter = load_adapter(self.options.path, graph, max_rank=NO_RANK_LIMIT)
        stats = {"sha256": adapter.sha256, "rank": adapter.rank}
        targets = linear_targets(graph)
        by_node: dict[str, list] = {}
        for module, (a, b) in sorted(adapter.factors.items()):
            by_node.setdefault(targets[module].node, []).append((targets[module], a, b))
        nodes = {n.name: n for n in graph.nodes}  # in node order below: the first refusal is the first linear
        # linear(x) [W] -> linear(x) [W + scale * B A] {lora_merged}
        todo = [n.name for n in graph.nodes if n.name in by_node and n.attrs.get("lora_merged") != adapter.sha256]
        if not todo:
            return PassResult(graph, store, changed=False, stats={**stats, "merged": 0})
        new_graph, entries = graph.copy(), {}
        for name in todo:
            node = nodes[name]
            tensor = node.params["weight"]
            fmt = graph.tensors[tensor].format
            if fmt.is_quantized:
                raise InputError(f"merge_lora: {name}'s weight is {fmt.kind.value}: merge adapters before "
                                 "quantizing (list merge_lora first in the recipe's passes)")
            key = part_name(tensor, "weight", fmt)
            entries[key] = transformed(store.entry(key), lambda w, parts=by_node[name]: _merged(w, parts,
                                                                                                 self.options.scale))
        new_graph.nodes = [Node(n.name, n.op, n.inputs, n.outputs, {**n.attrs, "lora_merged": adapter.sha256},
                                n.params) if n.name in todo else n for n in graph.nodes]
        return PassResult(new_graph, store.with_entries(entries), changed=True, stats={**stats, "merged": len(todo)})


def _merged(w: torch.Tensor, parts: list, scale: float) -> torch.Tensor:
    """w (N, K) with each module's delta b @ a (its rows of a fused linear) added in float32, cast back."""
    out = w.float().clone()
    for target, a, b in parts:
        out[target.offset:target.offset + target.rows] += scale * (b @ a)
    return out.to(w.dtype)
