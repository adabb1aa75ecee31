"""Quantize the lm_head weight (int8 per channel or int4 per group), by round-to-nearest or by GPTQ.

The weight-quantization passes leave the lm_head dense, as AutoAWQ and GPTQ do. On a small model that
makes it the largest single read of a decode step: SmolLM2's (49152 x 576) bf16 lm_head is a fifth
of the dense model's bytes and half of an int4 model's, so it caps what int4 linears can buy
(docs/PERF.md, issue 22). This pass rounds it too, the way llama.cpp's quantized files do.

`method: rtn` rounds each weight to its nearest value (lazily, as the artifact writer asks for it).
`method: gptq` runs the calibration tokens through the graph as the passes before left it (the
quantized blocks compute what the artifact will) up to the lm_head's input, and rounds the lm_head
column by column with GPTQ's error feedback on those inputs (optc/frontend/quant/gptq.py): on
SmolLM2 it cuts the lm_head's own KL cost about sevenfold (docs/PERF.md).

A tied lm_head reads the embedding's tensor. The embedding stays dense (a decode step reads one row
of it per token), so the pass gives the lm_head a tensor of its own, `lm_head.weight`, computed from
the embedding, and the graph's config says the two are no longer tied (an exported checkpoint then
carries both, as an untied model does).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from optc.core.errors import InputError
from optc.core.formats import Format, part_name
from optc.core.ir import Graph, Node, TensorInfo
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.frontend.quant.blocks import progress, start_calibration, tensor_entry
from optc.frontend.quant.gptq import Gptq, GptqOptions, Rounding
from optc.frontend.quant.options import LastParts, WeightQuantOptions, lazy_entries
from optc.frontend.quant.rtn import quantize_weight

UNTIED_NAME = "lm_head.weight"  # the untied lm_head's tensor, as transformers names it


class QuantizeLmHead(Pass):
    """Quantize the lm_head weight by round-to-nearest or GPTQ (a tied one gets its own tensor)."""

    @dataclass(frozen=True)
    class Options(WeightQuantOptions, GptqOptions):
        """The lm_head's format (bits, group size, zero point) and how it is rounded (method; GPTQ's options)."""

        method: Rounding = field(default=Rounding.RTN, metadata={
            "help": "rtn: nearest value; gptq: GPTQ error feedback on the lm_head's inputs over the calibration "
                    "data (damp, block_size, act_order are its options)"})

        def __post_init__(self) -> None:
            super().__post_init__()
            object.__setattr__(self, "method", self.rounding(self.method))

    def requires(self, graph: Graph) -> None:
        fmt = graph.tensors[_head(graph).params["weight"]].format
        want = self.options.format(fmt.dtype)
        if fmt.is_quantized and (fmt.kind, fmt.group_size, fmt.zero_point) != (want.kind, want.group_size,
                                                                               want.zero_point):
            raise InputError(f"the lm_head weight is already quantized ({fmt.label}); {self.name} would quantize "
                             f"it again to {want.label}: keep one lm_head quantization")

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        head = _head(graph)
        name = head.params["weight"]
        info = graph.tensors[name]
        if info.format.is_quantized:
            return PassResult(graph, store, changed=False, stats={"quantized": 0})
        fmt = self.options.format(info.format.dtype)
        fmt.check_shape(info.shape, name)
        shared = sum(name in n.params.values() for n in graph.nodes) > 1  # tied to the embedding
        new = graph.copy()
        target = UNTIED_NAME if shared else name
        if shared:
            if UNTIED_NAME in graph.tensors:
                raise InputError(f"the lm_head reads {name}, which other nodes read too, and the graph already has "
                                 f"a tensor {UNTIED_NAME}")
            new.config = replace(graph.config, tie_word_embeddings=False)
            new.node(head.name).params["weight"] = UNTIED_NAME
        new.tensors[target] = TensorInfo(info.shape, fmt)
        src = store.entry(part_name(name, "weight", info.format))
        stats = {"quantized": 1, "method": self.options.method.value, "tensor": target, "format": fmt.label,
                 "untied": shared}
        if self.options.method is Rounding.GPTQ:
            parts, loss = self._gptq(graph, store, ctx, head, src.load(), fmt)
            stats["gptq_loss"] = round(loss, 6)
            entries = {part_name(target, role, fmt): tensor_entry(t) for role, t in parts.items()}
        else:
            entries = lazy_entries(target, info.shape, src, fmt, LastParts(quantize_weight))
        store = store.with_entries(entries, remove=[] if shared else [part_name(name, "weight", info.format)])
        return PassResult(new, store, changed=True, stats=stats)

    def _gptq(self, graph: Graph, store: TensorStore, ctx: PassContext, head: Node, weight: torch.Tensor,
              fmt: Format) -> tuple[dict[str, torch.Tensor], float]:
        """GPTQ's parts of the lm_head weight, on its inputs over the calibration tokens; and GPTQ's loss."""
        runner, blocks = start_calibration(graph, store, ctx, self.name)
        for block in progress(ctx, blocks, self.name):
            runner.advance(block.nodes, runner.load(block.nodes), block.outputs)
        last = graph.nodes.index(blocks[-1].nodes[-1]) if blocks else -1
        tail = graph.nodes[last + 1:graph.nodes.index(head)]
        x = runner.run(tail, runner.load(tail), until=head.inputs[0])[head.inputs[0]]
        gptq = Gptq(weight.float().to(runner.device), head.params["weight"])
        gptq.add_batch(x)
        o = self.options
        result = gptq.run(fmt, o.damp, o.block_size, o.act_order)
        return result.parts, result.loss

    def ensures(self, graph: Graph) -> None:
        name = _head(graph).params["weight"]
        if not graph.tensors[name].format.is_quantized:
            raise ValueError(f"{self.name}: the lm_head weight {name} is left dense")


def _head(graph: Graph):
    heads = [n for n in graph.nodes if n.op == "lm_head"]
    if len(heads) != 1:
        raise InputError(f"quantize_lm_head needs one lm_head node; the graph has {len(heads)}")
    return heads[0]
