"""The calibrated weight-quantization driver: the skeleton AWQ and GPTQ share.

`run_calibrated` runs the calibration tokens through the graph one decoder block at a time
(optc.frontend.quant.blocks): per block it loads the block's params, hands them to the method's
`quantize_block`, then advances the activations through the block as the method left it (quantized
weights, folded scales), so each block is calibrated on the error of the blocks before it. At the
end of each block the tensors it quantized or folded are spilled to a temporary file (optc.core.store.Spill) and
the pass keeps entries that read them back, so its memory does not grow with the model's depth; the artifact
writer reads them. At the end it checks that every dense linear was quantized, puts the quantized and folded
tensors into the store, and returns the pass result with the manifest's `quantization` section. Which linears a
method takes together and how it rounds them is the method's (passes/quantize_awq.py; GPTQ's step,
optc/frontend/quant/gptq.py, serves quantize_gptq and quantize_fp8's `method: gptq`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from optc.core.formats import Format, part_name
from optc.core.ir import Graph, Node
from optc.core.ops import Param
from optc.core.store import Entry, Spill, TensorStore
from optc.frontend.passmanager import PassContext, PassResult
from optc.frontend.quant.blocks import BlockRunner, apply, progress, start_calibration
from optc.frontend.quant.options import dense_linear_weights, expert_weights


@dataclass
class Calibration:
    """One calibrated run: what the method may read (graph, targets, runner) and what it writes."""

    graph: Graph
    targets: set[str]  # the dense linear weights (and moe experts) to quantize
    runner: BlockRunner
    spill: Spill = field(default_factory=Spill)
    # this block's results: quantized parts, and dense weights rewritten in their stored dtype (AWQ's 1/s)
    block_quantized: dict[str, tuple[Format, dict[str, torch.Tensor]]] = field(default_factory=dict)
    folded: dict[str, torch.Tensor] = field(default_factory=dict)
    # the blocks' results written out so far: entries reading them back
    quantized: dict[str, tuple[Format, dict[str, Entry]]] = field(default_factory=dict)
    rewritten: dict[str, Entry] = field(default_factory=dict)

    def keep(self, name: str, fmt: Format, parts: dict[str, torch.Tensor], params: dict[str, Param]) -> None:
        """Record `name` quantized to `parts`, and let the rest of the block compute with them."""
        self.block_quantized[name] = (fmt, parts)
        self.folded.pop(name, None)  # a folded weight quantized later in the block is written quantized only
        params[name] = Param(parts, fmt)

    def end_block(self) -> None:
        """Spill the block's quantized and folded tensors and keep entries that read them back."""
        tensors = {part_name(n, r, fmt): t
                   for n, (fmt, parts) in self.block_quantized.items() for r, t in parts.items()}
        entries = self.spill.write({**tensors, **self.folded})
        for n, (fmt, parts) in self.block_quantized.items():
            self.quantized[n] = (fmt, {r: entries[part_name(n, r, fmt)] for r in parts})
        self.rewritten.update({n: entries[n] for n in self.folded})
        self.block_quantized.clear()
        self.folded.clear()


QuantizeBlock = Callable[[Calibration, list[Node], dict[str, Param]], None]


def run_calibrated(pass_name: str, method: str, graph: Graph, store: TensorStore, ctx: PassContext,
                   quantize_block: QuantizeBlock, record: dict[str, Any],
                   stats: Callable[[], dict[str, Any]] = dict) -> PassResult:
    """Quantize every dense linear of `graph` block by block with `quantize_block`; `record` (the format's
    and the method's options) goes into the manifest section, `stats()` (read after the last block) into
    the pass stats, after the method's name."""
    targets = set(dense_linear_weights(graph) + expert_weights(graph))  # a method that cannot do experts refuses them
    if not targets:
        return PassResult(graph, store, changed=False, stats={"quantized": 0})
    runner, blocks = start_calibration(graph, store, ctx, pass_name)
    run = Calibration(graph, targets, runner)
    for block in progress(ctx, blocks, pass_name):
        params = runner.load(block.nodes)
        quantize_block(run, block.nodes, params)
        runner.advance(block.nodes, params, block.outputs)
        run.end_block()
    missing = sorted(targets - set(run.quantized))
    if missing:
        raise ValueError(f"{pass_name}: linears outside any decoder block: {missing[:3]}")
    graph, store = apply(graph, store, run.quantized, run.rewritten)
    section = {"method": method, **record, "calibration": dict(ctx.calibration_record)}
    return PassResult(graph, store, changed=True,
                      stats={"quantized": len(run.quantized), "method": method, **stats()},
                      manifest={"quantization": section})
