"""Quantize every dense linear weight by round-to-nearest (int8 per channel or int4 per group)."""

from __future__ import annotations

from dataclasses import dataclass, field

from optc.errors import InputError
from optc.formats import part_name
from optc.ir import Graph, TensorInfo
from optc.passmanager import PassContext, PassResult
from optc.quant.rtn import make_format, quantize_weight
from optc.store import Entry, TensorStore

BITS = {"choices": (4, 8), "help": "4: int4_g grouped; 8: int8_wo per output channel"}
GROUP = {"choices": (32, 64, 128), "help": "int4 group size along the input dimension"}


class QuantizeRtn:
    """Quantize every dense linear weight by round-to-nearest (int8 per channel or int4 per group)."""

    name = "quantize_rtn"

    @dataclass(frozen=True)
    class Options:
        bits: int = field(default=4, metadata=BITS)
        group_size: int = field(default=128, metadata=GROUP)
        zero_point: bool = field(default=True, metadata={"help": "int4: asymmetric with a zero point per group"})

    def __init__(self, options: Options | None = None):
        self.options = options or self.Options()
        o = self.options
        make_format(o.bits, o.group_size, o.zero_point and o.bits == 4)  # option errors before any work

    def requires(self, graph: Graph) -> None:
        refuse_requantizing(graph, self.name, self.options)

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        o = self.options
        targets = dense_linear_weights(graph)
        if not targets:
            return PassResult(graph, store, changed=False, stats={"quantized": 0})
        new = graph.copy()
        entries: dict[str, Entry] = {}
        last = _LastParts()
        for name in targets:
            info = graph.tensors[name]
            fmt = make_format(o.bits, o.group_size, o.zero_point and o.bits == 4, info.format.dtype)
            fmt.check_shape(info.shape, name)
            new.tensors[name] = TensorInfo(info.shape, fmt)
            src = store.entry(part_name(name, "weight", info.format))
            # parts are computed lazily when the artifact writer asks for them (it asks for one
            # tensor's parts in a row: the last tensor's parts are kept, so each weight is rounded once)
            for role, (shape, dtype) in fmt.part_shapes(info.shape).items():
                load = lambda src=src, fmt=fmt, name=name, role=role: last.parts(name, src, fmt)[role]
                entries[part_name(name, role, fmt)] = Entry(tuple(shape), dtype, load)
        store = store.with_entries(entries, remove=targets)
        section = {"method": "rtn", "bits": o.bits, "group_size": o.group_size if o.bits == 4 else None,
                   "zero_point": o.zero_point and o.bits == 4}
        return PassResult(new, store, changed=True, stats={"quantized": len(targets)},
                          manifest={"quantization": section})

    def ensures(self, graph: Graph) -> None:
        left = dense_linear_weights(graph)
        if left:
            raise ValueError(f"{self.name}: linears left dense: {left[:3]}")


def dense_linear_weights(graph: Graph) -> list[str]:
    """Weights of `linear` nodes still stored dense, in node order (embedding and lm_head excluded)."""
    names = [n.params["weight"] for n in graph.nodes if n.op == "linear"]
    return [t for t in dict.fromkeys(names) if not graph.tensors[t].format.is_quantized]


def refuse_requantizing(graph: Graph, pass_name: str, options) -> None:
    """A linear already quantized to another format is an error; one in this pass's format is left as it
    is (so a second run of the same pass changes nothing)."""
    zero_point = options.zero_point and options.bits == 4
    want = (options.bits, options.group_size if options.bits == 4 else None, zero_point)
    for name in dict.fromkeys(n.params["weight"] for n in graph.nodes if n.op == "linear"):
        fmt = graph.tensors[name].format
        if fmt.is_quantized and (fmt.bits, fmt.group_size, fmt.zero_point) != want:
            have = f"{fmt.kind.value} bits={fmt.bits} group_size={fmt.group_size} zero_point={fmt.zero_point}"
            raise InputError(f"{name} is already quantized ({have}); {pass_name} would quantize it again to bits="
                             f"{want[0]} group_size={want[1]} zero_point={want[2]}: keep one quantization pass")


class _LastParts:
    """The quantized parts of the last weight asked for (a one-entry cache)."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.value: dict = {}

    def parts(self, name: str, src: Entry, fmt) -> dict:
        if name != self.name:
            self.name, self.value = None, {}  # drop the previous weight's parts before computing
            self.value, self.name = quantize_weight(src.load(), fmt, name), name
        return self.value
