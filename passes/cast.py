"""Cast dense weights (and the scales of quantized ones) to one floating dtype, and record it as the
activation dtype (`graph.config.dtype`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from optc.core.formats import DTYPES, part_name
from optc.core.ir import Graph, TensorInfo
from optc.core.store import TensorStore, transformed
from optc.frontend.passmanager import Pass, PassContext, PassResult


class Cast(Pass):
    """Cast dense weights (and the scales of quantized ones) to one floating dtype."""

    @dataclass(frozen=True)
    class Options:
        dtype: str | None = field(
            default=None, metadata={"choices": tuple(DTYPES), "help": "target dtype; default: the recipe's dtype"}
        )

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        dtype = self.options.dtype or ctx.dtype
        to = DTYPES[dtype]
        new_graph = graph.copy()
        entries, cast = {}, 0
        for name, info in graph.tensors.items():
            fmt = info.format
            if fmt.dtype == dtype:
                continue
            for role in fmt.scheme.float_roles:  # dense: the weight itself; quantized: the scales
                key = part_name(name, role, fmt)
                entries[key] = transformed(store.entry(key), lambda t, to=to: t.to(to), dtype=to)
            new_graph.tensors[name] = TensorInfo(info.shape, replace(fmt, dtype=dtype))
            cast += 1
        if not cast and graph.config.dtype == dtype:
            return PassResult(graph, store, changed=False, stats={"cast": 0, "dtype": dtype})
        new_graph.config = replace(graph.config, dtype=dtype)  # activations follow the weights
        return PassResult(new_graph, store.with_entries(entries), changed=True, stats={"cast": cast, "dtype": dtype})
