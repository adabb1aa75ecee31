"""Quantize every dense linear weight by round-to-nearest (int8 per channel or int4 per group); with
`activations: dynamic` (int8 only) the linears also quantize their input per token at run time (W8A8)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from optc.core.errors import InputError
from optc.core.formats import Activations, Format, part_name
from optc.core.ir import Graph, TensorInfo
from optc.core.store import Entry, TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.frontend.quant.options import LastParts, WeightQuantOptions, dense_linear_weights, ensure_quantized
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
        o = self.options
        targets = dense_linear_weights(graph)
        if not targets:
            return PassResult(graph, store, changed=False, stats={"quantized": 0})
        new = graph.copy()
        entries: dict[str, Entry] = {}
        last = LastParts(quantize_weight)
        for name in targets:
            info = graph.tensors[name]
            fmt = o.format(info.format.dtype)
            fmt.check_shape(info.shape, name)
            new.tensors[name] = TensorInfo(info.shape, fmt)
            src = store.entry(part_name(name, "weight", info.format))
            # parts are computed lazily when the artifact writer asks for them (it asks for one
            # tensor's parts in a row: the last tensor's parts are kept, so each weight is rounded once)
            for role, (shape, dtype) in fmt.part_shapes(info.shape).items():
                load = lambda src=src, fmt=fmt, name=name, role=role: last.parts(name, src, fmt)[role]
                entries[part_name(name, role, fmt)] = Entry(tuple(shape), dtype, load)
        store = store.with_entries(entries, remove=targets)
        section = {"method": "rtn", **o.record()}
        return PassResult(new, store, changed=True, stats={"quantized": len(targets), "method": "rtn"},
                          manifest={"quantization": section})

    def ensures(self, graph: Graph) -> None:
        ensure_quantized(graph, self.name)
