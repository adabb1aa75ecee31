"""Quantize every dense linear weight with GPTQ, block by block on the calibration tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from optc.core.ir import Graph, Node
from optc.core.ops import Param
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.frontend.quant.blocks import linear_groups
from optc.frontend.quant.calibrated import Calibration, run_calibrated
from optc.frontend.quant.gptq import Gptq
from optc.frontend.quant.options import WeightQuantOptions, ensure_quantized


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
        return run_calibrated(self.name, "gptq", o, graph, store, ctx, self._quantize_block,
                              {"damp": o.damp, "act_order": o.act_order})

    def ensures(self, graph: Graph) -> None:
        ensure_quantized(graph, self.name)

    def _quantize_block(self, run: Calibration, nodes: list[Node], params: dict[str, Param]) -> None:
        o = self.options
        # true sequential: each group's inputs come through the already-quantized groups before it
        for group in linear_groups(nodes):
            names = [n.params["weight"] for n in group if n.params["weight"] in run.targets]
            if not names:
                continue
            x = run.runner.run(nodes, params, until=group[0].inputs[0])[group[0].inputs[0]]
            hessian = None
            for name in names:
                gptq = Gptq(params[name].parts["weight"], name)
                if hessian is None:
                    gptq.add_batch(x)
                    hessian = (gptq.hessian, gptq.num_samples)
                gptq.hessian, gptq.num_samples = hessian  # same input, same H (run() copies it)
                fmt = o.format(run.graph.tensors[name].format.dtype)
                run.keep(name, fmt, gptq.quantize(fmt, o.damp, o.block_size, o.act_order), params)
