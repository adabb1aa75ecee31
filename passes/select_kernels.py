"""Bind every node to a kernel for the recipe's target, else the torch reference.

cuda: the first kernel that supports the node (a Triton kernel autotunes its tiles per M on first use); a
linear that several kernels support records them all (`kernel_candidates`) and a default per-M table
(`kernel_by_m`, optc.kernels.choose_cuda.default_by_m: e.g. the decode kernel up to 16 rows, the GEMM
above), which the first load on a GPU refines by measuring them (cached per device). `int4_packing:
n8_tiles` first stores the int4_g linear weights in the packing the CUDA decode kernels read
(passes/_int4_tiles.py; the default k8_lsb keeps triton.w4a16).
cpu: where a node has a supporting kernel, the kernels and the reference are timed on the build
machine per M bucket (optc.kernels.choose) and the fastest per bucket is recorded: `kernel` and, when
the winner changes with M, `kernel_by_m` (see optc.kernels.registry). `measure: false` binds the first
supporting kernel for every M instead (deterministic graphs, tests). A node already bound to
candidates keeps its binding, so a second run measures nothing. Timings go to the pass stats
(`optc inspect` shows them). A node bound to a kernel that does not support it, or a kernel that
raises on it while measured, is a build-time error naming node, shape and kernel, the op attribute
the kernel cannot take (a family's soft cap, window, activation, rotary width, norm offset) when that
is what it refuses, and what to do.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from optc.core.errors import InputError
from optc.core.formats import INT4_PACKING, INT4_TILES_PACKING
from optc.core.ir import REFERENCE_KERNEL, Graph, Node
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.kernels.registry import KERNELS, KernelQuery, KernelSpec, candidates
from optc.passes._int4_tiles import lay_out_tiles

# KernelQuery fields read off a family's op attributes -> the node attribute each comes from
FAMILY_ATTRS = {"softcap": "softcap", "window": "window", "act": "act", "rotary_dim": "rotary_dim",
                "norm_offset": "offset"}


class SelectKernels(Pass):
    """Bind every node to a kernel for the recipe's target (measured per M bucket on cpu), else torch."""

    @dataclass(frozen=True)
    class Options:
        disable: tuple[str, ...] = field(default=(), metadata={
            "choices": tuple(KERNELS), "help": "kernels not to use (ablations); their nodes get torch"})
        enable: tuple[str, ...] = field(default=(), metadata={
            "choices": tuple(KERNELS), "help": "kernels that are off unless named here (a default one: no effect)"})
        measure: bool = field(default=True, metadata={
            "help": "cpu: time the candidates per M bucket on the build machine (false: first supporting kernel)"})
        int4_packing: str = field(default=INT4_PACKING, metadata={
            "choices": (INT4_PACKING, INT4_TILES_PACKING),
            "help": "cuda: how int4_g linear weights are stored; n8_tiles lays them out for triton.w4a16_decode "
                    "and triton.w4a16_prefill (docs/FORMATS.md)"})

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        layout_stats, relaid = None, False
        if self.options.int4_packing == INT4_TILES_PACKING:
            if ctx.target != "cuda":
                raise InputError(f"select_kernels: int4_packing {INT4_TILES_PACKING} is for target cuda (its kernels "
                                 f"are Triton's), not {ctx.target}")
            graph, store, layout_stats = lay_out_tiles(graph, store)
            relaid = layout_stats["laid_out"] > 0
        chooser = None
        if ctx.target == "cpu" and self.options.measure:
            from optc.kernels.choose import Chooser

            chooser = Chooser()
        attrs, timings = [], {}
        for n in graph.nodes:
            new, measured = self._choose(graph, n, ctx.target, chooser)
            attrs.append(new)
            if measured is not None:
                timings.setdefault(_shape_key(graph, n), measured)
        chosen = [a["kernel"] for a in attrs]
        stats = {"target": ctx.target, "kernels": dict(sorted(Counter(chosen).items()))}
        by_m = {n.name: a["kernel_by_m"] for n, a in zip(graph.nodes, attrs, strict=True) if "kernel_by_m" in a}
        if by_m:
            stats["kernel_by_m"] = by_m
        if timings:
            stats["measured_us"] = timings
        if layout_stats is not None:
            stats["int4_layout"] = layout_stats
        if not relaid and all(_binding(n.attrs) == a for n, a in zip(graph.nodes, attrs, strict=True)):
            return PassResult(graph, store, changed=False, stats=stats)
        graph = graph.copy()
        graph.nodes = [Node(n.name, n.op, n.inputs, n.outputs, _rebind(n.attrs, a), n.params)
                       for n, a in zip(graph.nodes, attrs, strict=True)]
        return PassResult(graph, store, changed=True, stats=stats)

    def ensures(self, graph: Graph) -> None:
        for n in graph.nodes:
            kernel = n.attrs.get("kernel", "")  # recorded on every node, the reference's name too
            if kernel != REFERENCE_KERNEL and (kernel not in KERNELS or KERNELS[kernel].op != n.op):
                raise AssertionError(f"{n.name} ({n.op}) is bound to {kernel!r}")
            check_bound(graph, n)

    def _choose(self, graph: Graph, node: Node, target: str, chooser) -> tuple[dict, dict | None]:
        query = _query(graph, node)
        specs = [s for s in candidates(query, target, self.options.enable) if s.name not in self.options.disable]
        if not specs:
            return {"kernel": REFERENCE_KERNEL}, None
        if target == "cuda" and node.op == "linear" and len(specs) > 1:  # measured at the first load on a GPU
            from optc.kernels.choose_cuda import default_by_m

            names = [s.name for s in specs]
            table = default_by_m(names)
            return {"kernel": table[0][1], **({"kernel_by_m": table} if len(table) > 1 else {}),
                    "kernel_candidates": names}, None
        if chooser is None or len(query.weight_shape) != 2:  # measured: matmuls over one (N, K) weight
            return {"kernel": specs[0].name}, None
        bound = {node.attrs.get("kernel")} | {k for _, k in node.attrs.get("kernel_by_m", ())}
        if None not in bound and bound <= {s.name for s in specs} | {REFERENCE_KERNEL}:
            return _binding(node.attrs), None  # measured before: a second run keeps it
        choice = chooser.choose(node, query, specs)
        binding = {"kernel": choice.kernel}
        if len(choice.by_m) > 1:
            binding["kernel_by_m"] = [list(p) for p in choice.by_m]
        return binding, choice.micros


def check_bound(graph: Graph, node: Node) -> None:
    """Raise an InputError naming node, shape and kernel when a kernel the node is bound to (its
    `kernel`, one in `kernel_by_m` or a candidate the first load on a GPU may choose) does not support
    the node: the op attribute it cannot take and the model's architecture when an attribute is the
    reason, and what to do."""
    names = {node.kernel} | {k for _, k in node.attrs.get("kernel_by_m", ())}
    names |= set(node.attrs.get("kernel_candidates", ()))
    for name in sorted(names - {REFERENCE_KERNEL}):
        spec = KERNELS.get(name)
        query = _query(graph, node)
        if spec is not None and spec.op == node.op and not spec.supports(query):
            w = query.weight
            shape = (f"weight {list(query.weight_shape)} {w.kind.value}" if w is not None
                     else f"hidden {query.hidden_size}, head_dim {query.head_dim}")
            attr = _refused_attr(spec, query)
            what = (f"take its attribute {attr[0]}={attr[1]!r} ({graph.config.architecture})" if attr is not None
                    else "run that shape")
            raise InputError(f"node {node.name} ({node.op}, {shape}, {query.dtype}) is bound to kernel {name}, "
                             f"which cannot {what}: rebuild with select_kernels after every pass that changes the "
                             f"node (it leaves a node no kernel takes on its torch reference), or disable the "
                             f"kernel (select_kernels: {{disable: [{name}]}})")


def _refused_attr(spec: KernelSpec, query: KernelQuery) -> tuple[str, object] | None:
    """(node attribute, value) of the family attribute `spec` refuses in `query`: the first whose plain
    value (Llama's) the kernel would take; None when the shape or format is the reason."""
    plain = KernelQuery(query.op, query.dtype)
    for field_name, attr in FAMILY_ATTRS.items():
        value = getattr(query, field_name)
        default = getattr(plain, field_name)
        if value != default and spec.supports(replace(query, **{field_name: default})):
            return attr, value
    return None


BINDING = ("kernel", "kernel_by_m", "kernel_candidates")


def _binding(attrs: dict) -> dict:
    return {k: attrs[k] for k in BINDING if k in attrs}


def _rebind(attrs: dict, binding: dict) -> dict:
    return {**{k: v for k, v in attrs.items() if k not in BINDING}, **binding}


def _shape_key(graph: Graph, node: Node) -> str:
    q = _query(graph, node)
    fmt = q.weight.kind.value + (f"/g{q.weight.group_size}" if q.weight.group_size else "")
    return f"{node.op} {q.weight_shape[0]}x{q.weight_shape[1]} {fmt} {q.dtype}"


def _query(graph: Graph, node: Node) -> KernelQuery:
    """What the registry's predicates look at, read off the node, its params and the model config."""
    c, a = graph.config, node.attrs
    weight = graph.tensors.get(node.params.get("weight", node.params.get("gate_up", "")))  # moe: its experts
    return KernelQuery(
        op=node.op, dtype=c.dtype,
        weight=weight.format if weight else None, weight_shape=tuple(weight.shape) if weight else (),
        hidden_size=a.get("head_dim", c.hidden_size) if node.op in ("rms_norm", "add_rms_norm") else c.hidden_size,
        num_heads=a.get("num_heads", 0), num_kv_heads=a.get("num_kv_heads", 0), head_dim=a.get("head_dim", 0),
        kv_dtype=a.get("kv_dtype"), kv_block_size=a.get("kv_block_size"),
        norm_offset=a.get("offset", 0.0), act=a.get("act", "silu"), softcap=a.get("softcap") or None,
        window=a.get("window"), rotary_dim=a.get("rotary_dim"),
    )
