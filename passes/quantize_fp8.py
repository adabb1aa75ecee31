"""Quantize every dense linear weight to fp8_e4m3 (float8 weights, a scale per output channel or per
tensor); with `activations: dynamic` the linears also quantize their input to fp8 per token at run time.

`activations: none` is W8A16 (the weight is dequantized in the GEMV, activations stay in the model
dtype); `dynamic` is W8A8, what vLLM calls fp8 dynamic per-token. The format (optc/core/formats/fp8_e4m3.py)
says how weights are stored and how the linear computes; `method` says how they are rounded to it:
`rtn` rounds each weight to the nearest e4m3 value (lazily, as the artifact writer asks for it), `gptq`
rounds column by column on the calibration tokens and feeds each column's error into the columns not
yet rounded (optc/frontend/quant/gptq.py, through the calibrated driver), with the same scales. The
embedding and lm_head stay dense, as in the other quantization passes. Run `smoothquant` before this
pass to move activation outliers into the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from optc.core.errors import InputError
from optc.core.formats import Activations, Format, FormatKind
from optc.core.formats.fp8_e4m3 import quantize_fp8_weight
from optc.core.ir import Graph
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.frontend.quant.calibrated import run_calibrated
from optc.frontend.quant.experts import ExpertStats
from optc.frontend.quant.gptq import GptqOptions, Rounding, quantize_block
from optc.frontend.quant.options import ensure_quantized, round_linears


class QuantizeFp8(Pass):
    """Quantize every dense linear weight to fp8_e4m3; W8A16, or W8A8 with dynamic per-token activations."""

    @dataclass(frozen=True)
    class Options(GptqOptions):
        """The fp8 format (scales per channel or per tensor, activations) and how weights are rounded to it."""

        method: Rounding = field(default=Rounding.RTN, metadata={
            "help": "rtn: nearest e4m3 value; gptq: GPTQ error feedback on the calibration data (damp, "
                    "block_size, act_order are its options)"})
        activations: Activations = field(default=Activations.NONE, metadata={
            "help": "none: weight-only (W8A16); dynamic: each token's activations cast to fp8 with its own scale"})
        per_tensor: bool = field(default=False, metadata={"help": "one scale per weight instead of per output channel"})

        def __post_init__(self) -> None:
            if self.activations not in {m.value for m in Activations}:
                raise InputError(f"activations: {self.activations!r} is not allowed; allowed: "
                                 f"{', '.join(m.value for m in Activations)}")
            object.__setattr__(self, "activations", Activations(self.activations))
            object.__setattr__(self, "method", self.rounding(self.method))

        def format(self, dtype: str = "float32") -> Format:
            return Format(FormatKind.FP8_E4M3, dtype=dtype, per_tensor=self.per_tensor, activations=self.activations)

        def record(self) -> dict[str, Any]:
            """The manifest's quantization fields these options decide."""
            gptq = self.gptq_record() if self.method is Rounding.GPTQ else {}
            return {"format": FormatKind.FP8_E4M3.value, "scales": "per_tensor" if self.per_tensor else "per_channel",
                    "activations": self.activations.value, **gptq}

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
        o = self.options
        if o.method is Rounding.GPTQ:
            def format_of(name: str) -> Format:
                return o.format(graph.tensors[name].format.dtype)

            experts = ExpertStats("gptq")
            return run_calibrated(self.name, o.method.value, graph, store, ctx,
                                  partial(quantize_block, options=o, format_of=format_of, experts=experts),
                                  o.record(), experts.to_json)
        return self._round_to_nearest(graph, store)

    def ensures(self, graph: Graph) -> None:
        ensure_quantized(graph, self.name)

    def _round_to_nearest(self, graph: Graph, store: TensorStore) -> PassResult:
        return round_linears(graph, store, self.options.format, quantize_fp8_weight, self.options.record())
