"""Quantize every dense linear weight to fp8_e4m3 (float8 weights, a scale per output channel or per
tensor); with `activations: dynamic` the linears also quantize their input to fp8 per token at run time.

`activations: none` is W8A16 (the weight is dequantized in the GEMV, activations stay in the model
dtype); `dynamic` is W8A8, what vLLM calls fp8 dynamic per-token. The format (optc/core/formats/fp8_e4m3.py)
says how weights are rounded and how the linear computes. The embedding and lm_head stay dense, as in
the other quantization passes. Run `smoothquant` before this pass to move activation outliers into
the weights; this pass searches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from optc.core.errors import InputError
from optc.core.formats import Activations, Format, FormatKind, part_name
from optc.core.formats.fp8_e4m3 import quantize_fp8_weight
from optc.core.ir import Graph, TensorInfo
from optc.core.store import Entry, TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.frontend.quant.options import LastParts, dense_linear_weights, ensure_quantized


class QuantizeFp8(Pass):
    """Quantize every dense linear weight to fp8_e4m3; W8A16, or W8A8 with dynamic per-token activations."""

    @dataclass(frozen=True)
    class Options:
        activations: Activations = field(default=Activations.NONE, metadata={
            "help": "none: weight-only (W8A16); dynamic: each token's activations cast to fp8 with its own scale"})
        per_tensor: bool = field(default=False, metadata={"help": "one scale per weight instead of per output channel"})

        def __post_init__(self) -> None:
            object.__setattr__(self, "activations", Activations(self.activations))

        def format(self, dtype: str = "float32") -> Format:
            return Format(FormatKind.FP8_E4M3, dtype=dtype, per_tensor=self.per_tensor, activations=self.activations)

    def requires(self, graph: Graph) -> None:
        """A linear already quantized to anything but this pass's format is an error (one in it is kept, so a
        second run changes nothing)."""
        want = self.options.format()
        for name in dict.fromkeys(n.params["weight"] for n in graph.nodes if n.op == "linear"):
            fmt = graph.tensors[name].format
            if fmt.is_quantized and (fmt.kind, fmt.per_tensor, fmt.activations) != (
                    want.kind, want.per_tensor, want.activations):
                raise InputError(f"{name} is already quantized ({fmt.label}); {self.name} would quantize it again to "
                                 f"{want.label}: keep one quantization pass")

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        targets = dense_linear_weights(graph)
        if not targets:
            return PassResult(graph, store, changed=False, stats={"quantized": 0})
        new = graph.copy()
        entries: dict[str, Entry] = {}
        last = LastParts(quantize_fp8_weight)
        for name in targets:
            info = graph.tensors[name]
            fmt = self.options.format(info.format.dtype)
            fmt.check_shape(info.shape, name)
            new.tensors[name] = TensorInfo(info.shape, fmt)
            src = store.entry(part_name(name, "weight", info.format))
            # parts are computed when the artifact writer asks for them, one tensor's parts in a row: the
            # last tensor's parts are kept, so each weight is quantized once
            for role, (shape, dtype) in fmt.part_shapes(info.shape).items():
                load = lambda src=src, fmt=fmt, name=name, role=role: last.parts(name, src, fmt)[role]
                entries[part_name(name, role, fmt)] = Entry(tuple(shape), dtype, load)
        section = {"method": "fp8", "format": FormatKind.FP8_E4M3.value,
                   "scales": "per_tensor" if self.options.per_tensor else "per_channel",
                   "activations": self.options.activations.value}
        return PassResult(new, store.with_entries(entries, remove=targets), changed=True,
                          stats={"quantized": len(targets)}, manifest={"quantization": section})

    def ensures(self, graph: Graph) -> None:
        ensure_quantized(graph, self.name)
