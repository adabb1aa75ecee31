"""What the fused CPU decode step (step.cpp's interpreter, kernels/cpu_ext/step.py) takes: for a node bound to a
kernel, `reason(graph, node)` is None where step.cpp runs that node as its bound kernel does (the very function on
the same tensors, so bit for bit), else the words that say why not.

The declaration is an acceptance, not a refusal list: per op, the kernels step.cpp runs it as (`KERNELS`) and every
node attribute it reads (`ATTRS`). A node of another op, bound to another kernel, or carrying an attribute step.cpp
does not read (one a new family adds) is left out by name, so the step can never ignore an attribute: it learns it
here and in step.cpp together. The plan pass (passes/plan_cpu_step.py) asks this for every node and records the
answer in the artifact. Nothing here needs the extension built: what the machine that loads the artifact lacks
(no compiler, no AVX2) leaves the whole plan node by node at load, logged.
"""

from __future__ import annotations

from optc.core.formats import FormatKind
from optc.core.ir import REFERENCE_KERNEL, Graph, Node
from optc.core.kv_cache import KV_QUANT_DTYPES

DTYPES = ("bfloat16", "float32")  # the activations step.cpp computes in
# what a linear node bound to each kernel runs in step.cpp (kernels/cpu_ext/step.py builds its call per kernel)
LINEAR_KERNELS = (REFERENCE_KERNEL, "cpu.bf16dot", "cpu.widened", "cpu.int4pack", "cpu.int8pack", "cpu.qdot",
                  "cpu.int8gf_int4x2")
ACTS = ("silu", "gelu_tanh")  # gated_act: ops.cpp's silu_mul (cpu.cpp_gated_act), or the reference's ATen ops
KERNELS: dict[str, tuple[str, ...]] = {
    "linear": LINEAR_KERNELS,
    "rms_norm": ("cpu.cpp_rms_norm",),
    "add_rms_norm": ("cpu.cpp_add_rms_norm",),
    "gated_act": ("cpu.cpp_gated_act", REFERENCE_KERNEL),
    "rope_kv_store": ("cpu.cpp_rope_kv_store",),
    "attention": ("cpu.cpp_attention",),
    "add": (REFERENCE_KERNEL,),  # x + y: the reference's ATen add
    "moe": (REFERENCE_KERNEL, "cpu.moe_packed"),  # the reference's ATen ops, the experts' matmuls the kernel's
    "mla_attention": (REFERENCE_KERNEL,),  # the reference's ATen ops (absorbed at one query row a request)
}
BINDING = ("kernel", "kernel_by_m", "kernel_candidates", "layer")  # every op: read by the executor, not the math
KV = ("num_heads", "num_kv_heads", "head_dim", "kv_block_size", "kv_dtype", "kv_scales", "kv_scales_at", "kv_group")
ATTRS: dict[str, tuple[str, ...]] = {
    "linear": ("in_features", "out_features", "split"),
    "rms_norm": ("eps", "offset", "head_dim"),
    "add_rms_norm": ("eps", "offset"),
    "gated_act": ("act",),
    "rope_kv_store": (*KV, "rope_table", "rotary_dim"),
    "attention": (*KV, "scale", "softcap", "window", "kv_stored"),
    "add": (),
    "moe": ("num_experts", "intermediate_size", "top_k", "scoring", "renormalize", "act", "round_weights",
            "routed_scale", "num_groups", "topk_groups", "float_router"),
    "mla_attention": (*KV, "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "scale", "eps"),
}
PLAN_ATTRS = ("step_run", "step_max_rows", "step_left_out")  # what the plan pass writes on nodes


def reason(graph: Graph, node: Node) -> str | None:
    """None where step.cpp runs `node` as its bound kernel does, else why it does not."""
    dtype = graph.config.dtype
    if dtype not in DTYPES:
        return f"activations in {dtype} (step.cpp computes in {' or '.join(DTYPES)})"
    if node.op not in KERNELS:
        return f"op {node.op} (step.cpp runs {', '.join(KERNELS)})"
    if node.kernel not in KERNELS[node.op]:
        return f"kernel {node.kernel} ({node.op} runs in step.cpp as {', '.join(KERNELS[node.op])})"
    unread = sorted(set(node.attrs) - set(ATTRS[node.op]) - set(BINDING) - set(PLAN_ATTRS))
    if unread:
        return f"attribute {unread[0]}={node.attrs[unread[0]]!r} (step.cpp does not read it)"
    if node.op == "linear":
        return _linear(graph, node, node.kernel)
    if node.op in ("rms_norm", "add_rms_norm"):
        return _dense_weight(graph, node, "weight")
    if node.op in ("gated_act", "moe") and node.attrs.get("act") not in ACTS:
        return f"act {node.attrs.get('act')!r} (step.cpp: {', '.join(ACTS)})"
    if node.op == "moe":
        if node.attrs.get("scoring") != "softmax":
            return f"scoring {node.attrs.get('scoring')!r} (step.cpp: softmax)"
        dense = node.kernel == REFERENCE_KERNEL  # moe_packed's experts: what its supports predicate took
        experts = (_dense_weight(graph, node, "gate_up") or _dense_weight(graph, node, "down")) if dense else None
        return experts or _dense_router(graph, node)
    if node.op == "mla_attention" and (weights := _dense_weight(graph, node, "kv_norm")
                                       or _dense_weight(graph, node, "kv_b")):
        return weights
    if node.op in ("rope_kv_store", "attention", "mla_attention"):
        a = node.attrs
        if node.op == "attention" and not a.get("kv_stored"):
            return "attention that stores K/V itself (step.cpp: after rope_kv_store, fuse_rope_kv)"
        kv = a.get("kv_dtype", dtype), a.get("kv_scales", "none")
        if node.op == "mla_attention" and kv != (dtype, "none"):
            return f"a {kv[0]} latent cache with scales {kv[1]} (step.cpp: {dtype}, none)"
        if kv not in ((dtype, "none"), *((q, "per_token_head") for q in KV_QUANT_DTYPES)):
            return (f"a {kv[0]} KV cache with scales {kv[1]} (step.cpp: {dtype} with none, or "
                    f"{' / '.join(KV_QUANT_DTYPES)} with per_token_head)")
    return None


def runs(graph: Graph) -> list[tuple[int, int]]:
    """The planned runs as [start, stop) node ranges, in order ([] for a graph without a plan)."""
    ranges: dict[int, list[int]] = {}
    for i, n in enumerate(graph.nodes):
        if "step_run" in n.attrs:
            ranges.setdefault(n.attrs["step_run"], [i, i])[1] = i
    return [(a, b + 1) for a, b in ranges.values()]


def max_rows(graph: Graph, node: Node) -> int | None:
    """The most rows a linear node runs in step.cpp (None: any): its `kernel_by_m` buckets up to the first whose
    kernel step.cpp does not run (a prefill's reference matmul of a quantized weight)."""
    rows = None
    for bucket, name in node.attrs.get("kernel_by_m") or ():
        if not _runs(graph, node, name):
            return rows
        rows = bucket
    return None


def _linear(graph: Graph, node: Node, kernel: str) -> str | None:
    if set(node.params) != {"weight"}:
        extra = sorted(set(node.params) - {"weight"})
        return f"param {extra[0] if extra else 'weight (none)'} (step.cpp: a linear without bias)"
    first = (node.attrs.get("kernel_by_m") or [[None, kernel]])[0][1]
    if first not in LINEAR_KERNELS:
        return f"kernel {first} for its fewest rows (a linear runs in step.cpp as {', '.join(LINEAR_KERNELS)})"
    return _dense_weight(graph, node, "weight") if first == REFERENCE_KERNEL else None


def _runs(graph: Graph, node: Node, kernel: str) -> bool:
    """step.cpp runs a linear node's bucket bound to `kernel` (the reference: only over a dense weight)."""
    return kernel in LINEAR_KERNELS and (kernel != REFERENCE_KERNEL or _dense_weight(graph, node, "weight") is None)


def _dense_router(graph: Graph, node: Node) -> str | None:
    fmt = graph.tensors[node.params["router"]].format
    return None if fmt.kind is FormatKind.DENSE else f"router is {fmt.label} (step.cpp: dense)"


def _dense_weight(graph: Graph, node: Node, role: str) -> str | None:
    """step.cpp reads the node's `role` weight as it is: a dense tensor of the activations' dtype."""
    fmt = graph.tensors[node.params[role]].format
    if fmt.kind is not FormatKind.DENSE or fmt.dtype != graph.config.dtype:
        return f"{role} is {fmt.label}, not dense {graph.config.dtype} (what its reference reads as it is)"
    return None
