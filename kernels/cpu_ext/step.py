"""A decode or verification step's run of decoder layers as one call into step.cpp (kernels/cpu_ext), in place of
9 graph nodes a layer each called from Python.

`fuse_decoder_layers(graph, executor)` finds, in a graph bound to the CPU kernels, the longest run of decoder layers
of the plain Llama shape (a qkv linear split in three, rotary + KV store, attention over the stored cache, an o
linear, add + RMSNorm, a gate_up linear split in two, silu gate, a down linear and the next add + RMSNorm; every
non-matmul node on its `cpu.cpp_*` kernel, every linear on kernels step.cpp runs: a dense or widened weight, torch's
int4pack, qdot, bf16dot), and hands the executor that run (`Executor.fuse`). Per step whose requests bring at most
MAX_ROWS query rows each (a decode step's one, a speculative verification's k + 1 or a draft tree's nodes, a short
prompt), over a float KV cache of the activations' dtype and one KV-cache group, the run is one call that runs each
node's own kernel in the node order, with the attention node's own row_attention call (its tree bits included), so
its outputs equal the node-by-node step's bit for bit (tests/test_kernels_cpu_step.py); any other step (a longer
prefill, a quantized KV cache) runs the nodes one by one. Weights are the nodes' prepared layouts, shared with the
node-by-node path (`PreparedImpl.params`), so nothing is held twice. Where the extension cannot be built, nothing is
fused.
"""

from __future__ import annotations

import torch

from optc.core.formats import FormatKind
from optc.core.ir import REFERENCE_KERNEL, Graph, Node
from optc.core.ops.linear import one_row_as_two
from optc.core.rope import GLOBAL
from optc.kernels import cpu_ext
from optc.kernels.cpu_ext import bf16dot
from optc.kernels.cpu_ext.ops import MAX_ROWS, MAX_TREE_NODES
from optc.kernels.cpu_ext.qdot import BITS, PREPARED
from optc.kernels.spec import PreparedImpl

DENSE, INT4PACK, QDOT, DENSE_ROWS2, BF16DOT = 0, 1, 2, 3, 4  # step.cpp's linear kinds
LAYER_OPS = ("linear", "rope_kv_store", "attention", "linear", "add_rms_norm", "linear", "gated_act", "linear",
             "add_rms_norm")
LINEARS = (0, 3, 5, 7)  # qkv, o, gate_up, down in LAYER_OPS
CPP = {"rope_kv_store": "cpu.cpp_rope_kv_store", "attention": "cpu.cpp_attention",
       "add_rms_norm": "cpu.cpp_add_rms_norm", "gated_act": "cpu.cpp_gated_act"}
DTYPES = (torch.bfloat16, torch.float32)


def load_step():
    """step.cpp's module (it compiles ops.cpp, qdot.cpp and bf16dot.cpp in), or None where it cannot be built or
    the CPU lacks AVX2."""
    if cpu_ext.load_ops() is None or cpu_ext.isa() is None:
        return None
    return cpu_ext.build(cpu_ext.STEP, cpu_ext.cache_root())


class DecoderRun:
    """The executor's fused run: inputs (normed x, residual), outputs the last layer's (normed, summed)."""

    def __init__(self, stack, cache_layers: list[int], dtype: torch.dtype, max_rows: int | None = None):
        self.stack = stack
        self.max_rows = max_rows  # steps of more rows decline (a linear's kernel for them is not step.cpp's)
        self.cache_layers = cache_layers
        self.dtype = dtype
        self._caches: tuple[object, list[torch.Tensor] | None] = (None, None)

    def __call__(self, inputs: list[torch.Tensor], step) -> list[torch.Tensor] | None:
        x, residual = inputs
        b = step.batch
        rows = x.shape[0]
        query_len = getattr(b, "max_query_len", None)
        if (not isinstance(query_len, int) or query_len > MAX_ROWS or x.dtype != self.dtype
                or (self.max_rows is not None and rows > self.max_rows)
                or getattr(b, "group_tables", ()) or not x.is_contiguous() or not residual.is_contiguous()):
            return None
        caches = self._cache_data(step.kv_caches)
        if caches is None:
            return None
        tree_mask = getattr(b, "tree_mask", None)  # with it, the attention node's own call: MAX_TREE_NODES rows
        return self.stack.forward(x, residual, step.positions.long().contiguous(),
                                  step.cos_sin[GLOBAL].contiguous(), b.slot_mapping.long().contiguous(),
                                  b.block_tables.int().contiguous(), b.seq_lens.int().contiguous(),
                                  b.query_start_loc.int().contiguous(),
                                  None if tree_mask is None else tree_mask.long().contiguous(), caches,
                                  MAX_ROWS if tree_mask is None else MAX_TREE_NODES)

    def _cache_data(self, kv_caches) -> list[torch.Tensor] | None:
        """The layers' cache tensors when every one is a contiguous float cache of the activations' dtype, else
        None; checked once per list of caches."""
        if kv_caches is None:
            return None
        if self._caches[0] is not kv_caches:
            ok = all(c.scales is None and c.data.dtype == self.dtype and c.data.is_contiguous()
                     and c.data.device.type == "cpu" for c in (kv_caches[i] for i in self.cache_layers))
            self._caches = (kv_caches, [c.data for c in kv_caches] if ok else None)
        return self._caches[1]


def fuse_decoder_layers(graph: Graph, executor) -> bool:
    """Give `executor` the graph's longest run of fusible decoder layers as one step.cpp call; False (nothing
    changed) where there is none or the extension is unavailable."""
    if graph.config.dtype not in ("bfloat16", "float32"):
        return False
    layers = _layer_runs(graph)
    if not layers:
        return False
    ext = load_step()
    if ext is None:
        return False
    nodes = graph.nodes
    stack = ext.Stack()
    max_rows = None  # the most rows every layer's linears take (None: any)
    for first in layers:
        group = nodes[first:first + len(LAYER_OPS)]
        found = [_choices(group[i], executor, first + i) for i in LINEARS]
        if any(c is None for c in found):
            return False
        linears = [choices for choices, _ in found]
        for _, bound in found:
            max_rows = bound if max_rows is None else min(max_rows, bound or max_rows)
        rope, attention, post, nxt = group[1].attrs, group[2].attrs, group[4], group[8]
        stack.add(linears, [list(group[i].attrs.get("split") or [group[i].attrs["out_features"]]) for i in LINEARS],
                  _norm_weight(executor, post), post.attrs["eps"], _norm_weight(executor, nxt), nxt.attrs["eps"],
                  rope["num_heads"], rope["num_kv_heads"], rope["head_dim"], attention["scale"], rope["layer"])
    first, stop = layers[0], layers[-1] + len(LAYER_OPS)
    head = nodes[first]
    inputs = (head.inputs[0], nodes[first + 4].inputs[0])
    dtype = torch.bfloat16 if graph.config.dtype == "bfloat16" else torch.float32
    run = DecoderRun(stack, [nodes[i + 1].attrs["layer"] for i in layers], dtype, max_rows)
    return executor.fuse(first, stop, inputs, tuple(nodes[stop - 1].outputs), run)


def _layer_runs(graph: Graph) -> list[int]:
    """First node index of each layer in the longest run of chained fusible layers ([] when none)."""
    nodes, size = graph.nodes, len(LAYER_OPS)
    best: list[int] = []
    run: list[int] = []
    i = 0
    while i + size <= len(nodes):
        if _fusible(nodes[i:i + size]) and (not run or _chained(nodes[run[-1]:run[-1] + size], nodes[i:i + size])):
            run.append(i)
            i += size
            continue
        best, run = max(best, run, key=len), []
        i += 1
    return max(best, run, key=len)


def _fusible(group: list[Node]) -> bool:
    """The nodes are one plain decoder layer wired as step.cpp runs it, each on a kernel it calls."""
    if tuple(n.op for n in group) != LAYER_OPS:
        return False
    qkv, rope, attn, o, post, gate_up, act, down, nxt = group
    if any(n.kernel != CPP[n.op] or "kernel_by_m" in n.attrs for n in (rope, attn, post, act, nxt)):
        return False
    a = rope.attrs
    if (len(qkv.attrs.get("split") or ()) != 3 or len(gate_up.attrs.get("split") or ()) != 2
            or any("split" in n.attrs or "bias" in n.params for n in (o, down))
            or any("bias" in n.params for n in (qkv, gate_up))):
        return False
    if (a.get("rope_table", GLOBAL) != GLOBAL or "kv_group" in a or not attn.attrs.get("kv_stored")
            or attn.attrs.get("softcap") or attn.attrs.get("window") or "kv_group" in attn.attrs
            or attn.attrs["layer"] != a["layer"] or act.attrs["act"] != "silu"
            or any(n.attrs.get("offset") or n.attrs.get("head_dim") for n in (post, nxt))):
        return False
    # add + RMSNorm nodes read (the residual stream, the new value)
    return (tuple(rope.inputs[:3]) == tuple(qkv.outputs) and tuple(attn.inputs) == tuple(rope.outputs)
            and o.inputs[0] == attn.outputs[0] and post.inputs[1] == o.outputs[0]
            and gate_up.inputs[0] == post.outputs[0] and tuple(act.inputs) == tuple(gate_up.outputs)
            and down.inputs[0] == act.outputs[0] and tuple(nxt.inputs) == (post.outputs[1], down.outputs[0]))


def _chained(before: list[Node], after: list[Node]) -> bool:
    """`after` reads its x and residual from `before`'s trailing add + RMSNorm."""
    return after[0].inputs[0] == before[-1].outputs[0] and after[4].inputs[0] == before[-1].outputs[1]


def _norm_weight(executor, node: Node) -> torch.Tensor:
    w = executor.params[node.params["weight"]]
    return w.dense().contiguous()


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
    if name == "cpu.qdot" and PREPARED in parts:
        scales = parts[PREPARED]
        k = node.attrs["in_features"]
        empty = torch.empty(0)
        mins = parts["mins"] if fmt.zero_point and "mins" in parts else empty
        offset = 8.0 if BITS[fmt.kind] == 4 and not fmt.zero_point else 0.0
        return (QDOT, [parts["qweight"], scales, mins, parts.get("qdot_soff", empty)], k // scales.shape[1],
                BITS[fmt.kind], cpu_ext.isa(), offset)
    return None
