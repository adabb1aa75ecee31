"""Quantize every dense linear weight with GPTQ, block by block on the calibration tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from optc.ir import Graph
from optc.ops import Param
from optc.passmanager import Pass, PassContext, PassResult
from optc.quant.blocks import apply, linear_groups, progress, start_calibration, to_host
from optc.quant.gptq import Gptq
from optc.quant.options import WeightQuantOptions, dense_linear_weights, ensure_quantized
from optc.store import TensorStore


class QuantizeGptq(Pass):
    """Quantize every dense linear weight with GPTQ, block by block on the calibration tokens."""

    @dataclass(frozen=True)
    class Options(WeightQuantOptions):
        damp: float = field(default=0.01, metadata={"gt": 0.0, "max": 1.0, "help": "dampening, share of mean diag H"})
        block_size: int = field(default=128, metadata={"choices": (128, 256, 512), "help": "lazy update width"})
        act_order: bool = field(default=False, metadata={"help": "columns by decreasing diag H (static groups)"})

    def requires(self, graph: Graph) -> None:
        self.options.refuse_requantizing(graph, self.name)

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        o = self.options
        targets = set(dense_linear_weights(graph))
        if not targets:
            return PassResult(graph, store, changed=False, stats={"quantized": 0})
        runner, blocks = start_calibration(graph, store, ctx, self.name)
        quantized = {}
        for block in progress(ctx, blocks, self.name):
            params = runner.load(block.nodes)
            # true sequential: each group's inputs come through the already-quantized groups before it
            for group in linear_groups(block.nodes):
                names = [n.params["weight"] for n in group if n.params["weight"] in targets]
                if not names:
                    continue
                x = runner.run(block.nodes, params, until=group[0].inputs[0])[group[0].inputs[0]]
                hessian = None
                for name in names:
                    gptq = Gptq(params[name].parts["weight"], name)
                    if hessian is None:
                        gptq.add_batch(x)
                        hessian = (gptq.hessian, gptq.num_samples)
                    gptq.hessian, gptq.num_samples = hessian  # same input, same H (run() copies it)
                    fmt = o.format(graph.tensors[name].format.dtype)
                    parts = gptq.quantize(fmt, o.damp, o.block_size, o.act_order)
                    quantized[name] = (fmt, to_host(parts))
                    params[name] = Param(parts, fmt)
            runner.advance(block.nodes, params, block.outputs)
        missing = sorted(targets - set(quantized))
        if missing:
            raise ValueError(f"{self.name}: linears outside any decoder block: {missing[:3]}")
        graph, store = apply(graph, store, quantized, {})
        section = {"method": "gptq", **o.record(), "damp": o.damp, "act_order": o.act_order,
                   "calibration": dict(ctx.calibration_record)}
        return PassResult(graph, store, changed=True, stats={"quantized": len(quantized)},
                          manifest={"quantization": section})

    def ensures(self, graph: Graph) -> None:
        ensure_quantized(graph, self.name)
