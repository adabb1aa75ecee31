"""SmoothQuant: per-input-channel factors s from the calibration activations, 1/s folded into the op
that produces a linear group's input and s into the group's weight columns, so that a W8A8 pass after
it (`quantize_fp8: {activations: dynamic}`, `quantize_rtn: {bits: 8, activations: dynamic}`) quantizes
activations with smaller outliers. The float model computes the same function (up to rounding the
rescaled weights to their dtype); the factors are optc/frontend/quant/smoothquant.py's.

A group is every `linear` of a decoder block reading one value; it is smoothed when that value is
read by the group alone and the op producing it lies in the block and can absorb 1/s (as AWQ,
`optc.frontend.quant.blocks.fold_target`): the input norm (q/k/v), the post-attention norm (gate/up), the up
rows feeding `gated_act` (down), the v rows feeding attention without GQA (o; SmolLM2 and Llama 3 use
GQA, so their o_proj is not smoothed). Smoothed linears carry the attr `smoothquant_alpha`, so a
second run changes nothing. Statistics are the max |x| per channel over all calibration tokens, in
fp32, computed block by block on the already smoothed blocks before. Quantizing is the next pass's job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from optc.core.errors import InputError
from optc.core.ir import Graph, Node
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.frontend.quant.blocks import (
    FoldTarget,
    apply,
    dense_param,
    fold_target,
    linear_groups,
    progress,
    split_blocks,
    start_calibration,
)
from optc.frontend.quant.smoothquant import channel_max, smooth_factors

ATTR = "smoothquant_alpha"  # on a smoothed linear: the α its input's factors were computed with


class SmoothQuant(Pass):
    """Migrate activation outliers into the weights: x / s into the op before, W · diag(s) in the linears."""

    @dataclass(frozen=True)
    class Options:
        alpha: float = field(default=0.5, metadata={
            "min": 0.0, "max": 1.0, "help": "migration strength: s = max|x|^α / max|w|^(1-α)"})

    def requires(self, graph: Graph) -> None:
        quantized = [n.params["weight"] for n in graph.nodes
                     if n.op == "linear" and graph.tensors[n.params["weight"]].format.is_quantized]
        if quantized:
            raise InputError(f"{quantized[0]} is already quantized; {self.name} rescales dense weights: put it "
                             "before the quantization pass")

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        todo = _candidates(graph)
        if not todo:
            return PassResult(graph, store, changed=False, stats={"smoothed_groups": 0})
        runner, blocks = start_calibration(graph, store, ctx, self.name)
        rescaled: dict[str, torch.Tensor] = {}
        x_max_before = x_max_after = 0.0
        for block in progress(ctx, blocks, self.name):
            params = runner.load(block.nodes)
            groups = todo.get(block.index, [])
            env = runner.run(block.nodes, params) if groups else {}
            for group, target in groups:
                x = group[0].inputs[0]
                names = [n.params["weight"] for n in group]
                act_max = channel_max(env[x])
                weight_max = torch.cat([params[t].parts["weight"] for t in names]).abs().amax(0)
                s = smooth_factors(act_max, weight_max, self.options.alpha)
                x_max_before = max(x_max_before, float(act_max.max()))
                x_max_after = max(x_max_after, float((act_max / s).max()))
                for t in names:  # each stored tensor rounded at once, so later blocks see the artifact's values
                    rescaled[t] = self._rounded(graph, t, params[t].parts["weight"] * s)
                    params[t] = dense_param(rescaled[t])
                prev_name = target.tensor
                rescaled[prev_name] = self._rounded(graph, prev_name, target.fold(params[prev_name].parts["weight"], s))
                params[prev_name] = dense_param(rescaled[prev_name])
            runner.advance(block.nodes, params, block.outputs)
        new, store = apply(graph, store, {}, rescaled)
        smoothed = {n.name for groups in todo.values() for group, _ in groups for n in group}
        new.nodes = [Node(n.name, n.op, n.inputs, n.outputs, {**n.attrs, ATTR: self.options.alpha}, n.params)
                     if n.name in smoothed else n for n in new.nodes]
        stats = {"smoothed_groups": sum(len(g) for g in todo.values()), "smoothed_linears": len(smoothed),
                 "max_abs_x_before": round(x_max_before, 2), "max_abs_x_after": round(x_max_after, 2)}
        return PassResult(new, store, changed=True, stats=stats)

    @staticmethod
    def _rounded(graph: Graph, name: str, w: torch.Tensor) -> torch.Tensor:
        """w rounded to `name`'s stored dtype, as fp32 on the host."""
        return w.to(graph.tensors[name].format.torch_dtype).float().cpu()


def _candidates(graph: Graph) -> dict[int, list[tuple[list[Node], FoldTarget]]]:
    """Block index -> the groups still to smooth there, each with where its 1/s is folded."""
    consumers = graph.consumers()
    todo: dict[int, list[tuple[list[Node], FoldTarget]]] = {}
    for block in split_blocks(graph)[1]:
        block_tensors = {t for n in block.nodes for t in n.params.values()}
        for group in linear_groups(block.nodes):
            x = group[0].inputs[0]
            if any(ATTR in n.attrs for n in group):
                continue
            if {c.name for c in consumers.get(x, [])} != {n.name for n in group}:
                continue  # another op reads x too: x / s would change what it computes
            target = fold_target(graph, block.nodes, x)
            if target is None or target.tensor not in block_tensors:
                continue
            todo.setdefault(block.index, []).append((group, target))
    return todo
