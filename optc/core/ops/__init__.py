"""The op vocabulary: per op, its `OpSpec` (arity, required attrs and params, a param shape rule,
traits, the torch reference and the one node -> arguments adapter), plus `verify(graph, store)`.

The references live beside their specs, one module per family (elementwise, norm, rope, attention,
linear, moe, mla); they are pure torch, so the IR, the frontend, the passes and a CPU runtime never import
Triton. The Triton launchers (optc.kernels) share the references' signatures and plug into the
same adapters (`OPS[op].bind(launcher)`). Values between nodes are 2-D: (T, features).
"""

from __future__ import annotations

from optc.core.formats import Format, part_name
from optc.core.ir import REFERENCE_KERNEL, Graph, Node
from optc.core.ops.attention import ATTENTION
from optc.core.ops.collective import ALL_GATHER, ALL_REDUCE
from optc.core.ops.elementwise import ADD, GATED_ACT
from optc.core.ops.linear import EMBEDDING, LINEAR, LM_HEAD
from optc.core.ops.mla import MLA_ATTENTION
from optc.core.ops.moe import MOE
from optc.core.ops.norm import ADD_RMS_NORM, RMS_NORM
from optc.core.ops.rope import ROPE, ROPE_KV_STORE
from optc.core.ops.spec import Impl, OpSpec, Param
from optc.core.store import TensorStore

__all__ = ["COLLECTIVE_OPS", "OPS", "REFERENCE_KERNEL", "Impl", "OpSpec", "Param", "VerifyError", "host_syncing_nodes",
           "verify"]

OPS: dict[str, OpSpec] = {
    "embedding": EMBEDDING,
    "rms_norm": RMS_NORM,
    "add_rms_norm": ADD_RMS_NORM,
    "add": ADD,
    "linear": LINEAR,
    "rope": ROPE,
    "rope_kv_store": ROPE_KV_STORE,
    "attention": ATTENTION,
    "gated_act": GATED_ACT,
    "lm_head": LM_HEAD,
    "moe": MOE,
    "mla_attention": MLA_ATTENTION,
    "all_reduce": ALL_REDUCE,
    "all_gather": ALL_GATHER,
}
# only in a tensor-parallel rank's graph, derived at load (optc/core/ops/sharding.py): never in an artifact,
# so nothing that reads artifacts (export, calibration) meets them
COLLECTIVE_OPS = ("all_reduce", "all_gather")


def host_syncing_nodes(graph: Graph) -> list[Node]:
    """Nodes that run a torch reference which syncs with the host: what blocks a CUDA-graph capture. A node
    bound to a CPU kernel (`cpu.*`: a CPU-target artifact loaded on a GPU) runs its op's reference there."""
    return [n for n in graph.nodes if (n.kernel == REFERENCE_KERNEL or n.kernel.startswith("cpu."))
            and OPS[n.op].reference_syncs_host]


class VerifyError(ValueError):
    pass


def verify(graph: Graph, store: TensorStore | None = None) -> None:
    """Check the graph (and the store's parts, without loading them); raise VerifyError on the first problem."""
    defined = set(graph.inputs)
    for node in graph.nodes:
        where = f"node {node.name!r} ({node.op})"
        spec = OPS.get(node.op)
        if spec is None:
            raise VerifyError(f"{where}: unknown op; known ops: {', '.join(sorted(OPS))}")
        attention_reads_only = node.op == "attention" and node.attrs.get("kv_stored")
        expected_inputs = 1 if attention_reads_only else spec.num_inputs
        if len(node.inputs) != expected_inputs:
            raise VerifyError(f"{where}: takes {expected_inputs} inputs, has {len(node.inputs)}")
        missing = [a for a in spec.attrs if a not in node.attrs]
        if missing:
            raise VerifyError(f"{where}: missing attrs {missing}")
        split = node.attrs.get("split")
        num_outputs = spec.num_outputs or (len(split) if split else 1)
        if split and sum(split) != node.attrs["out_features"]:
            raise VerifyError(f"{where}: split {split} does not sum to out_features {node.attrs['out_features']}")
        if len(node.outputs) != num_outputs:
            raise VerifyError(f"{where}: produces {num_outputs} outputs, lists {len(node.outputs)}")
        for v in node.inputs:
            if v not in defined:
                raise VerifyError(f"{where}: input {v!r} is used before it is defined")
        for v in node.outputs:
            if v in defined:
                raise VerifyError(f"{where}: value {v!r} is defined twice")
            defined.add(v)
        for role in spec.params:
            if role not in node.params:
                raise VerifyError(f"{where}: missing param {role!r}")
        shapes = spec.param_shapes(node, graph.config)
        for role, tensor in node.params.items():
            if role not in spec.params + spec.optional_params:
                raise VerifyError(f"{where}: unexpected param {role!r}")
            info = graph.tensors.get(tensor)
            if info is None:
                raise VerifyError(f"{where}: param {role}={tensor!r} is not in the tensor table")
            if role in shapes and tuple(info.shape) != tuple(shapes[role]):
                raise VerifyError(f"{where}: {tensor} has shape {list(info.shape)}, expected {list(shapes[role])}")
            if store is not None:
                _verify_parts(tensor, info.shape, info.format, store)
        problem = spec.check and spec.check(node, {r: graph.tensors[t].format for r, t in node.params.items()})
        if problem:
            raise VerifyError(f"{where}: {problem}")
    for v in graph.outputs:
        if v not in defined:
            raise VerifyError(f"graph output {v!r} is never produced")


def _verify_parts(name: str, shape, fmt: Format, store: TensorStore) -> None:
    for role, (pshape, dtype) in fmt.part_shapes(tuple(shape)).items():
        key = part_name(name, role, fmt)
        if key not in store:
            raise VerifyError(f"tensor {key!r} ({fmt.kind.value} part {role}) is missing from the weights")
        e = store.entry(key)
        if e.shape != tuple(pshape) or e.dtype != dtype:
            raise VerifyError(f"tensor {key!r} is {e.dtype}{list(e.shape)}, expected {dtype}{list(pshape)}")
