"""What the weight-quantization passes (RTN, AWQ, GPTQ) share: their common options and which linears
they quantize.

`WeightQuantOptions` is the base of each of those passes' `Options`: bits, group size and zero point,
checked when constructed, and what follows from them (the `Format` of a weight of a given dtype, the
manifest's quantization record). How the integers are chosen is each method's (rtn.py, awq.py,
gptq.py); this module does not quantize anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from optc.core.eagle import PREFIX as EAGLE_PREFIX
from optc.core.errors import InputError
from optc.core.formats import Format, part_name
from optc.core.ir import Graph, TensorInfo
from optc.core.store import Entry, TensorStore
from optc.frontend.passmanager import PassResult
from optc.frontend.quant.rtn import make_format

BITS = {"choices": (4, 8), "help": "4: int4_g grouped; 8: int8_wo per output channel"}
GROUP = {"choices": (32, 64, 128), "help": "int4 group size along the input dimension"}


@dataclass(frozen=True)
class WeightQuantOptions:
    """Bits, int4 group size and zero point of weight-only quantization."""

    bits: int = field(default=4, metadata=BITS)
    group_size: int = field(default=128, metadata=GROUP)
    zero_point: bool = field(default=True, metadata={"help": "int4: asymmetric with a zero point per group"})

    def __post_init__(self) -> None:
        self.format()  # option errors before any work

    @property
    def has_zero_point(self) -> bool:
        """Whether weights get a zero point: int4 only (int8 is symmetric whatever `zero_point` says)."""
        return self.zero_point and self.bits == 4

    @property
    def stored_group_size(self) -> int | None:
        """The group size weights are stored with: None for int8 (per output channel)."""
        return self.group_size if self.bits == 4 else None

    def format(self, dtype: str = "float32") -> Format:
        """The format of a weight quantized with these options whose scales are stored in `dtype`."""
        return make_format(self.bits, self.group_size, self.has_zero_point, dtype)

    def record(self) -> dict[str, Any]:
        """The manifest's quantization fields these options decide."""
        return {"bits": self.bits, "group_size": self.stored_group_size, "zero_point": self.has_zero_point}

    def refuse_requantizing(self, graph: Graph, pass_name: str) -> None:
        """A linear already quantized to another format is an error; one in this format is left as it is
        (so a second run of the same pass changes nothing)."""
        kind = self.format().kind  # a GGUF kind kept with the same bits and groups is still another format
        want = (self.bits, self.stored_group_size, self.has_zero_point, self.format().activations)
        weights = [n.params[r] for n in graph.nodes for r in ("weight", "gate_up", "down")
                   if n.op in ("linear", "moe") and r in n.params]
        for name in dict.fromkeys(weights):
            fmt = graph.tensors[name].format
            if fmt.is_quantized and (fmt.kind != kind
                                     or (fmt.bits, fmt.group_size, fmt.zero_point, fmt.activations) != want):
                have = (f"{fmt.kind.value} bits={fmt.bits} group_size={fmt.group_size} zero_point={fmt.zero_point}"
                        f" activations={fmt.activations.value}")
                raise InputError(f"{name} is already quantized ({have}); {pass_name} would quantize it again to bits="
                                 f"{want[0]} group_size={want[1]} zero_point={want[2]} activations={want[3].value}: "
                                 "keep one quantization pass")


def expert_weights(graph: Graph) -> list[str]:
    """The experts' stacked weights (gate_up, down) of `moe` nodes still stored dense, in node order; the
    router is never among them (it stays float)."""
    names = [n.params[role] for n in graph.nodes if n.op == "moe" for role in ("gate_up", "down")]
    return [t for t in dict.fromkeys(names) if not graph.tensors[t].format.is_quantized]


def dense_linear_weights(graph: Graph) -> list[str]:
    """Weights of `linear` nodes still stored dense, in node order (embedding and lm_head excluded)."""
    names = [n.params["weight"] for n in graph.nodes if n.op == "linear"]
    return [t for t in dict.fromkeys(names) if not graph.tensors[t].format.is_quantized]


def draft_head_weights(graph: Graph) -> list[str]:
    """The EAGLE draft head's linear weights (optc/core/eagle.py; not node params: the runtime reads them)
    still stored dense; its norms and fc bias stay float."""
    return [name for name, info in graph.tensors.items()
            if name.startswith(f"{EAGLE_PREFIX}.") and name.endswith(".weight") and len(info.shape) == 2
            and not info.format.is_quantized]


def ensure_quantized(graph: Graph, pass_name: str) -> None:
    """Raise when a linear is left dense after a weight-quantization pass."""
    left = dense_linear_weights(graph) + expert_weights(graph)
    if left:
        raise ValueError(f"{pass_name}: linears left dense: {left[:3]}")


class LastParts:
    """The quantized parts of the last weight asked for (a one-entry cache): a pass's lazy store entries
    are read one tensor's parts in a row by the artifact writer, so each weight is quantized once and at
    most one weight's parts are held. `quantize(w, fmt, name)` -> parts."""

    def __init__(self, quantize: Callable[[Any, Format, str], dict]) -> None:
        self.quantize = quantize
        self.name: str | None = None
        self.value: dict = {}

    def parts(self, name: str, src: Entry, fmt: Format) -> dict:
        if name != self.name:
            self.name, self.value = None, {}  # drop the previous weight's parts before computing
            self.value, self.name = self.quantize(src.load(), fmt, name), name
        return self.value


def lazy_entries(name: str, shape: tuple[int, ...], src: Entry, fmt: Format, last: LastParts) -> dict[str, Entry]:
    """Store entries for tensor `name`'s parts in `fmt`, computed from its dense `src` when the artifact
    writer asks for them. The writer asks for one tensor's parts in a row and `last` keeps the last
    tensor's, so each weight is rounded once."""
    return {part_name(name, role, fmt): Entry(tuple(part_shape), dtype,
                                              lambda role=role: last.parts(name, src, fmt)[role])
            for role, (part_shape, dtype) in fmt.part_shapes(shape).items()}


def round_linears(graph: Graph, store: TensorStore, format_of: Callable[[str], Format],
                  quantize: Callable[[Any, Format, str], dict], record: dict[str, Any]) -> PassResult:
    """Every dense linear weight and moe expert weight rounded to the nearest value of `format_of(its dtype)`
    by `quantize`, lazily (`lazy_entries`); the manifest's quantization section is method rtn plus `record`.
    Experts (E, N, K) are rounded one expert at a time, their parts stacked (`Format.part_shapes`). A draft
    head stored before this pass has its linears rounded too, like the model's (the runtime dequantizes them
    when it loads the head); where the head's are the only linears left dense (the model's were quantized in
    this format by an earlier pass), the manifest's quantization section stays that pass's."""
    model = dense_linear_weights(graph) + expert_weights(graph)
    targets = model + draft_head_weights(graph)
    if not targets:
        return PassResult(graph, store, changed=False, stats={"quantized": 0})
    num_experts, num_head = len(expert_weights(graph)), len(draft_head_weights(graph))
    counts = {"expert_tensors": num_experts} if num_experts else {}  # of them, stacked experts (E, N, K)
    counts |= {"draft_head_tensors": num_head} if num_head else {}
    new = graph.copy()
    entries: dict[str, Entry] = {}
    last = LastParts(partial(per_expert, quantize))
    for name in targets:
        info = graph.tensors[name]
        fmt = format_of(info.format.dtype)
        fmt.check_shape(info.shape, name)
        new.tensors[name] = TensorInfo(info.shape, fmt)
        entries.update(lazy_entries(name, info.shape, store.entry(part_name(name, "weight", info.format)), fmt, last))
    return PassResult(new, store.with_entries(entries, remove=targets), changed=True,
                      stats={"quantized": len(targets), "method": "rtn", **counts},
                      manifest={"quantization": {"method": "rtn", **record}} if model else {})


def per_expert(quantize: Callable[[Any, Format, str], dict], w: Any, fmt: Format, name: str) -> dict:
    """`quantize` of a matrix; of a stack of experts' matrices (E, N, K), each expert's parts stacked."""
    if w.dim() != 3:
        return quantize(w, fmt, name)
    experts = [quantize(w[e], fmt, f"{name} (expert {e})") for e in range(w.shape[0])]
    return {role: torch.stack([p[role] for p in experts]) for role in experts[0]}
