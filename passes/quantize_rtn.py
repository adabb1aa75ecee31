"""Quantize every dense linear weight by round-to-nearest (int8 per channel or int4 per group); with
`activations: dynamic` (int8 only) the linears also quantize their input per token at run time (W8A8)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from optc.core.errors import InputError
from optc.core.formats import Activations, Format
from optc.core.ir import Graph
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.frontend.quant.options import WeightQuantOptions, ensure_quantized, round_linears
from optc.frontend.quant.rtn import quantize_weight


class QuantizeRtn(Pass):
    """Quantize every dense linear weight by round-to-nearest (int8 per channel or int4 per group)."""

    @dataclass(frozen=True)
    class Options(WeightQuantOptions):
        activations: Activations = field(default=Activations.NONE, metadata={
            "help": "dynamic: int8 W8A8, each token's activations quantized with its own scale at run time"})

        def __post_init__(self) -> None:
            object.__setattr__(self, "activations", Activations(self.activations))
            if self.activations is not Activations.NONE and self.bits != 8:
                raise InputError(f"activations: {self.activations.value} needs bits: 8 (int8 W8A8), got bits: "
                                 f"{self.bits}")
            super().__post_init__()

        def format(self, dtype: str = "float32") -> Format:
            return replace(super().format(dtype), activations=self.activations)

        def record(self) -> dict[str, Any]:
            act = {"activations": self.activations.value} if self.activations is not Activations.NONE else {}
            return {**super().record(), **act}

    def requires(self, graph: Graph) -> None:
        self.options.refuse_requantizing(graph, self.name)

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        return round_linears(graph, store, self.options.format, quantize_weight, self.options.record())

    def ensures(self, graph: Graph) -> None:
        ensure_quantized(graph, self.name)
