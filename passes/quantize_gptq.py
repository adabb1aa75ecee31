"""Quantize every dense linear weight with GPTQ, block by block on the calibration tokens."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from optc.core.formats import Format
from optc.core.ir import Graph
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.frontend.quant.calibrated import run_calibrated
from optc.frontend.quant.experts import ExpertStats
from optc.frontend.quant.gptq import GptqOptions, quantize_block
from optc.frontend.quant.options import WeightQuantOptions, ensure_quantized


class QuantizeGptq(Pass):
    """Quantize every dense linear weight with GPTQ, block by block on the calibration tokens."""

    @dataclass(frozen=True)
    class Options(WeightQuantOptions, GptqOptions):
        pass

    def requires(self, graph: Graph) -> None:
        self.options.refuse_requantizing(graph, self.name)

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        o = self.options

        def format_of(name: str) -> Format:
            return o.format(graph.tensors[name].format.dtype)

        experts = ExpertStats("gptq")
        step = partial(quantize_block, options=o, format_of=format_of, experts=experts)
        return run_calibrated(self.name, "gptq", graph, store, ctx, step, {**o.record(), **o.gptq_record()},
                              experts.to_json)

    def ensures(self, graph: Graph) -> None:
        ensure_quantized(graph, self.name)
