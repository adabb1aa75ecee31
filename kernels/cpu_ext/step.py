"""A decode or verification step's planned runs of graph nodes, each as one call into step.cpp (kernels/cpu_ext),
in place of the nodes called one by one from Python.

passes/plan_cpu_step.py records the runs in the artifact (`step_run` on each node of a run, `step_left_out` with the
reason on every other; kernels/cpu_ext/step_takes.py says what step.cpp takes). `fuse_planned(graph, executor)`
builds each run as a step.cpp `Run` (per node: its op kind, value slots, attributes and weights, the very tensors
its bound kernel reads) and hands it to the executor (`Executor.fuse`); it fuses exactly the plan, and matches no
pattern. Per step whose requests bring at most MAX_ROWS query rows each (a decode step's one, a speculative
verification's k + 1 or a draft tree's nodes, a short prompt), over KV caches ops.cpp takes (float of the
activations' dtype, or int8 / fp8 with their scales), a run is one call that runs each node's own kernel in node
order, so its outputs equal the node-by-node step's bit for bit (tests/test_kernels_cpu_step.py); any other step (a
longer prefill, draft trees over sliding windows) runs the nodes one by one. Weights are the nodes' prepared
layouts, shared with the node-by-node path (`PreparedImpl.params`), so nothing is held twice. Where the extension
cannot be built, nothing is fused.
"""

from __future__ import annotations

import logging

import torch

from optc.core.formats import FormatKind
from optc.core.ir import REFERENCE_KERNEL, Graph, Node
from optc.core.ops.linear import one_row_as_two
from optc.core.rope import GLOBAL
from optc.kernels import cpu_ext
from optc.kernels.cpu_ext import bf16dot
from optc.kernels.cpu_ext.ops import MAX_ROWS, MAX_TREE_NODES, cache_ok
from optc.kernels.cpu_ext.qdot import BITS, PREPARED
from optc.kernels.cpu_ext.step_takes import runs
from optc.kernels.spec import PreparedImpl

DENSE, INT4PACK, QDOT, DENSE_ROWS2, BF16DOT, INT4X2, INT8PACK = range(7)  # step.cpp's linear kinds
DENSE_EXPERTS, INT8PACK_EXPERTS, INT4PACK_EXPERTS = range(3)  # step.cpp's moe experts
# step.cpp's op kinds
OPS = ("linear", "rms_norm", "add_rms_norm", "gated_act", "rope_kv_store", "attention", "add", "moe", "mla_attention")
ACTS = ("silu", "gelu_tanh")  # step.cpp's gated activations
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

log = logging.getLogger("optc.kernels.cpu_ext")


class StepRun:
    """The executor's fused run of planned nodes: the run's input values in, the values read after it out."""

    def __init__(self, run, num_values: int, outputs: list[int], layers: list[int], tables: list[str],
                 dtype: torch.dtype, max_rows: int | None, windowed: bool, linears: dict[str, int]):
        self.run = run
        self.num_values = num_values
        self.outputs = outputs
        self.layers = layers  # the KV layers its nodes read and write
        self.tables = tables  # the rope tables by index
        self.dtype = dtype
        self.max_rows = max_rows  # steps of more rows decline (a linear's kernel for them is not step.cpp's)
        self.windowed = windowed  # draft trees decline (the attention launcher runs the reference for them)
        self.linears = linears  # linear node name -> its index in the run (where `attach_lora` finds them)
        self._caches: tuple[object, tuple[list[torch.Tensor], list[torch.Tensor]] | None] = (None, None)

    def __call__(self, inputs: list[torch.Tensor], step) -> list[torch.Tensor] | None:
        b = step.batch
        query_len = getattr(b, "max_query_len", None)
        tree_mask = getattr(b, "tree_mask", None)  # with it, the attention node's own call: MAX_TREE_NODES rows
        if (not isinstance(query_len, int) or query_len > MAX_ROWS or (tree_mask is not None and self.windowed)
                or (self.max_rows is not None and inputs[0].shape[0] > self.max_rows)
                or any(x.dtype != self.dtype or not x.is_contiguous() for x in inputs)):
            return None
        caches = self._cache_data(step.kv_caches)
        if caches is None:
            return None
        groups = ((b.block_tables, b.slot_mapping), *getattr(b, "group_tables", ()))
        cos_sin = [step.cos_sin[name] for name in self.tables]
        if any(t.dtype != torch.float32 for t in cos_sin):
            return None
        return self.run.forward(inputs, self.num_values, self.outputs, step.positions.long().contiguous(),
                                [t.contiguous() for t in cos_sin], [t.int().contiguous() for t, _ in groups],
                                [s.long().contiguous() for _, s in groups], b.seq_lens.int().contiguous(),
                                b.query_start_loc.int().contiguous(),
                                None if tree_mask is None else tree_mask.long().contiguous(), *caches,
                                MAX_ROWS if tree_mask is None else MAX_TREE_NODES, step.lora_slots)

    def _cache_data(self, kv_caches) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The layers' cache tensors and their scales (an empty tensor for a float cache) when every cache the run
        touches is one ops.cpp takes (a float cache of the activations' dtype, or int8 / fp8 codes with their
        scales), else None; checked once per list of caches."""
        if kv_caches is None:
            return None
        if self._caches[0] is not kv_caches:
            ok = all(cache_ok(kv_caches[i], self.dtype) for i in self.layers)
            empty = torch.empty(0)
            tensors = ([c.data for c in kv_caches], [empty if c.scales is None else c.scales for c in kv_caches])
            self._caches = (kv_caches, tensors if ok else None)
        return self._caches[1]


def fuse_planned(graph: Graph, executor) -> int:
    """Give `executor` each run the graph's plan records as one step.cpp call; the number of runs fused (0 where
    the graph has no plan or the extension is unavailable)."""
    planned = runs(graph)
    if not planned or graph.config.dtype not in DTYPES:
        return 0
    ext = cpu_ext.load()
    if ext is None:
        return 0
    fused = 0
    for start, stop in planned:
        built = _build(ext, graph, executor, start, stop)
        if built is None:
            continue
        inputs, outputs, fn = built
        fused += executor.fuse(start, stop, inputs, outputs, fn)
    return fused


def attach_lora(executor, lora) -> int:
    """Give every fused run's linears that adapters target their LoRA slot tables (runtime/lora.py's LoraSlots:
    lora.cpp's a, bt and parts, written in place as adapters load), so that a step with adapter rows stays one call;
    the number of linears given them."""
    attached = 0
    for fn in executor.fused_fns():
        for name, index in getattr(fn, "linears", {}).items():
            table = lora.tables.get(name)
            if table is not None:
                fn.run.set_lora(index, table.a, table.bt, table.parts)
                attached += 1
    return attached


def _build(ext, graph: Graph, executor, start: int, stop: int) -> tuple[tuple, tuple, StepRun] | None:
    """Run [start, stop) as a step.cpp Run: (its input names, its output names, the executor's fn), or None (logged)
    where a node's kernel did not prepare what step.cpp reads on this machine (qdot without its extension)."""
    nodes = graph.nodes[start:stop]
    defined = {v for n in nodes for v in n.outputs}
    inputs = tuple(dict.fromkeys(v for n in nodes for v in n.inputs if v not in defined and v != "positions"))
    read_later = {v for n in graph.nodes[stop:] for v in n.inputs} | set(graph.outputs)
    outputs = tuple(v for n in nodes for v in n.outputs if v in read_later)
    slot = {v: i for i, v in enumerate(inputs)}
    for v in (v for n in nodes for v in n.outputs):
        slot[v] = len(slot)
    last = {v: i for i, n in enumerate(nodes) for v in n.inputs if v in slot}
    run, tables, layers, max_rows = ext.Run(), [], [], None
    for i, node in enumerate(nodes):
        ins, outs = [slot[v] for v in node.inputs if v != "positions"], [slot[v] for v in node.outputs]
        release = [slot[v] for v, at in last.items() if at == i and v not in outputs]
        if node.op == "linear":
            found = _choices(node, executor, start + i)
            if found is None or not found[0]:
                log.warning("optc: the fused CPU step's run at node %s runs node by node: %s (%s) has no step.cpp "
                            "kernel on this machine", nodes[0].name, node.name, node.kernel)
                return None
            choices, bound = found  # the plan's bound (step_max_rows), or a lower one this machine's kernels set
            for rows in (bound, node.attrs.get("step_max_rows")):
                max_rows = rows if max_rows is None else min(max_rows, rows or max_rows)
            run.add_linear(ins, outs, release, choices, list(node.attrs.get("split") or [node.attrs["out_features"]]))
            continue
        ints, floats, tensors = _node(node, executor, start + i, tables, layers)
        run.add(OPS.index(node.op), ins, outs, release, ints, floats, tensors)
    windowed = any(n.attrs.get("window") for n in nodes)
    fn = StepRun(run, len(slot), [slot[v] for v in outputs], sorted(set(layers)), tables,
                 DTYPES[graph.config.dtype], max_rows, windowed,
                 {n.name: i for i, n in enumerate(nodes) if n.op == "linear"})
    return inputs, outputs, fn


def _node(node: Node, executor, index: int, tables: list[str],
          layers: list[int]) -> tuple[list[int], list[float], list]:
    """A non-linear node's attributes as step.cpp's Run.add reads them (step.cpp's Node says the layout)."""
    a = node.attrs
    if node.op in ("rms_norm", "add_rms_norm"):
        weight = executor.params[node.params["weight"]].dense().contiguous()
        ints = [a.get("head_dim") or 0] if node.op == "rms_norm" else []
        return ints, [a["eps"], a.get("offset", 0.0)], [weight]
    if node.op == "gated_act":
        return [ACTS.index(a["act"]), int(node.kernel != REFERENCE_KERNEL)], [], []
    if node.op == "add":
        return [], [], []
    if node.op == "moe":
        return _moe(node, executor, index)
    layers.append(a["layer"])
    group = a.get("kv_group", -1) + 1  # 0: the batch's own tables
    if node.op in ("rope_kv_store", "mla_attention"):
        table = a.get("rope_table", GLOBAL)
        if table not in tables:
            tables.append(table)
        if node.op == "mla_attention":  # the reference reads its params dense (mla.py's _mla_call)
            params = [executor.params[node.params[r]].dense() for r in ("kv_norm", "kv_b")]
            return ([a["num_heads"], a["qk_nope_head_dim"], a["v_head_dim"], a["layer"], tables.index(table), group],
                    [a["scale"], a["eps"]], params)
        return [a["num_heads"], a["num_kv_heads"], a["head_dim"], a["layer"], tables.index(table), group], [], []
    # attention
    return [a["num_heads"], a["head_dim"], a["layer"], a.get("window") or 0, group], [a["scale"],
                                                                                      a.get("softcap") or 0.0], []


def _moe(node: Node, executor, index: int) -> tuple[list[int], list[float], list]:
    """A moe node as step.cpp's MOE reads it: the routing attributes, the experts' kind, and the router with the
    experts' weights (dense stacked, or moe_packed's prepared parts per expert, `{role}.{e}`)."""
    a = node.attrs
    ints = [a["top_k"], int(a["renormalize"]), ACTS.index(a["act"]), int(a.get("round_weights", False)),
            a.get("num_groups", 1), a.get("topk_groups", 1), int(a.get("float_router", False))]
    router = executor.params[node.params["router"]].dense()
    if node.kernel == REFERENCE_KERNEL:
        experts = [executor.params[node.params[r]].dense() for r in ("gate_up", "down")]
        return [*ints, DENSE_EXPERTS, 0], [a.get("routed_scale", 1.0)], [router, *experts]
    impl = executor.impl(index)
    impl = impl.bound.get(node.kernel, impl) if hasattr(impl, "bound") else impl  # a per-M router: the kernel's
    prepared = impl.params(node, executor.node_params(index))
    fmt = prepared["gate_up"].format
    kind, roles = (INT8PACK_EXPERTS, ("qweight", "scales")) if fmt.kind is FormatKind.INT8_WO else (
        INT4PACK_EXPERTS, ("int4pack", "scales_and_zeros"))
    experts = [prepared[m].parts[f"{r}.{e}"] for m in ("gate_up", "down") for e in range(a["num_experts"])
               for r in roles]
    return [*ints, kind, fmt.group_size or 0], [a.get("routed_scale", 1.0)], [router, *experts]


def _choices(node: Node, executor, index: int) -> tuple[list[tuple], int | None] | None:
    """step.cpp's kernels for a linear node per M bucket (its `kernel_by_m`, else its kernel for every M), with the
    params its own launchers read, and the most rows they take (None: any): the buckets up to the first whose
    kernel step.cpp does not run (a prefill's reference matmul of a quantized weight). None where that is the
    first bucket."""
    table = node.attrs.get("kernel_by_m") or [[None, node.kernel]]
    impl = executor.impl(index)
    params = executor.node_params(index)
    choices = []
    for max_rows, name in table:
        choice = _choice(name, node, impl.bound.get(name, node.op) if hasattr(impl, "bound") else impl, params)
        if choice is None:
            return (choices, choices[-1][0]) if choices else None
        choices.append((-1 if max_rows is None else max_rows, *choice))
    return choices, None


def _choice(name: str, node: Node, impl, params) -> tuple | None:
    w = params["weight"]
    fmt = w.format
    if name == REFERENCE_KERNEL:  # a dense weight of the activations' dtype (the cast pass's): F.linear
        dense = fmt.kind is FormatKind.DENSE and w.parts["weight"].dtype == fmt.torch_dtype
        # the linear node runs a one-row bfloat16 product of an unquantized weight as two rows (linear.py)
        rows2 = not fmt.is_quantized and fmt.torch_dtype == torch.bfloat16 and one_row_as_two(w.parts["weight"].device)
        kind = DENSE_ROWS2 if rows2 else DENSE
        return (kind, [w.parts["weight"]], 0, 0, 0, 0.0) if dense else None
    if name == "cpu.bf16dot":  # as its launcher runs: bf16dot up to its ROWS, torch's GEMM above
        isa = cpu_ext.bf16_isa()
        return None if isa is None else (BF16DOT, [w.parts["weight"]], bf16dot.ROWS, 0, isa, 0.0)
    if not isinstance(impl, PreparedImpl):
        return None
    parts = impl.params(node, params)["weight"].parts
    if name == "cpu.widened":
        return DENSE, [parts["dense"]], 0, 0, 0, 0.0
    if name == "cpu.int4pack":
        return INT4PACK, [parts["int4pack"], parts["scales_and_zeros"]], fmt.group_size, 0, 0, 0.0
    if name == "cpu.int8pack":
        return INT8PACK, [parts["qweight"], parts["scales"]], 0, 0, 0, 0.0
    if name == "cpu.int8gf_int4x2":
        return (INT4X2, [parts["high"], parts["high_table"], parts["low"], parts["low_table"]], fmt.group_size, 0, 0,
                0.0)
    if name == "cpu.qdot" and PREPARED in parts:
        scales = parts[PREPARED]
        k = node.attrs["in_features"]
        empty = torch.empty(0)
        mins = parts["mins"] if fmt.zero_point and "mins" in parts else empty
        offset = 8.0 if BITS[fmt.kind] == 4 and not fmt.zero_point else 0.0
        return (QDOT, [parts["qweight"], scales, mins, parts.get("qdot_soff", empty)], k // scales.shape[1],
                BITS[fmt.kind], cpu_ext.isa(), offset)
    return None
