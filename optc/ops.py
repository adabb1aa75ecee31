"""The op vocabulary: per op, its arity, required attrs and params, a param shape rule and the
torch reference implementation; plus `verify(graph, store)`.

A reference takes `(node, inputs, params, step)` and returns the node's outputs. `params` maps a
role to a `Param` (stored parts + format); `step` (optc.execute.Step) carries positions, the
batch layout, the KV caches and the rope table. Values between nodes are 2-D: (T, features).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from optc.formats import Format, dequantize, linear_ref, part_name
from optc.ir import Graph, ModelConfig, Node
from optc.kernels.attention import kv_store_ref, paged_attention_sdpa
from optc.kernels.norm import add_rms_norm_ref, rms_norm_ref
from optc.kernels.rope import rope_kv_store_ref, rope_ref
from optc.store import TensorStore


@dataclass(frozen=True)
class Param:
    parts: dict[str, torch.Tensor]
    format: Format

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.parts, self.format, dtype)


@dataclass(frozen=True)
class OpSpec:
    num_inputs: int
    num_outputs: int | None  # None: given by attrs (linear split)
    attrs: tuple[str, ...]
    params: tuple[str, ...]
    optional_params: tuple[str, ...]
    param_shapes: Callable[[Node, ModelConfig], dict[str, tuple[int, ...]]]
    ref: Callable


def _heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    return x.view(x.shape[0], num_heads, head_dim)


def _embedding(node, inputs, params, step):
    return [F.embedding(inputs[0], params["weight"].dense())]


def _rms_norm(node, inputs, params, step):
    return [rms_norm_ref(inputs[0], params["weight"].dense(), node.attrs["eps"])]


def _add_rms_norm(node, inputs, params, step):
    return list(add_rms_norm_ref(inputs[0], inputs[1], params["weight"].dense(), node.attrs["eps"]))


def _add(node, inputs, params, step):
    return [inputs[0] + inputs[1]]


def _linear(node, inputs, params, step):
    w = params["weight"]
    bias = params["bias"].dense() if "bias" in params else None
    y = linear_ref(inputs[0], w.parts, w.format, bias)
    split = node.attrs.get("split")
    return list(y.split(split, dim=-1)) if split else [y]


def _rope(node, inputs, params, step):
    a = node.attrs
    q, k = _heads(inputs[0], a["num_heads"], a["head_dim"]), _heads(inputs[1], a["num_kv_heads"], a["head_dim"])
    pos = step.positions
    return [rope_ref(q, pos, step.cos_sin).flatten(1), rope_ref(k, pos, step.cos_sin).flatten(1)]


def _rope_kv_store(node, inputs, params, step):
    a = node.attrs
    q = _heads(inputs[0], a["num_heads"], a["head_dim"])
    k, v = (_heads(t, a["num_kv_heads"], a["head_dim"]) for t in inputs[1:3])
    cache = step.kv_cache(a["layer"])
    return [rope_kv_store_ref(q, k, v, step.positions, step.cos_sin, cache, step.batch.slot_mapping).flatten(1)]


def _attention(node, inputs, params, step):
    a = node.attrs
    cache = step.kv_cache(a["layer"])
    if not a.get("kv_stored", False):
        k, v = (_heads(t, a["num_kv_heads"], a["head_dim"]) for t in inputs[1:3])
        kv_store_ref(k, v, cache, step.batch.slot_mapping)
    b = step.batch
    q = _heads(inputs[0], a["num_heads"], a["head_dim"])
    return [paged_attention_sdpa(q, cache, b.block_tables, b.seq_lens, b.query_start_loc, a["scale"]).flatten(1)]


def _silu_mul(node, inputs, params, step):
    gate, up = inputs
    return [F.silu(gate) * up]  # = silu_mul_ref(cat(gate, up)) without the copy


def _lm_head(node, inputs, params, step):
    x = inputs[0] if step.logits_indices is None else inputs[0][step.logits_indices]
    w = params["weight"]
    return [linear_ref(x, w.parts, w.format).float()]


def _linear_shapes(node: Node, cfg: ModelConfig) -> dict:
    n, k = node.attrs["out_features"], node.attrs["in_features"]
    return {"weight": (n, k), "bias": (n,)}


_hidden = lambda node, cfg: {"weight": (cfg.hidden_size,)}
_vocab = lambda node, cfg: {"weight": (cfg.vocab_size, cfg.hidden_size)}
_none = lambda node, cfg: {}
_ATTN = ("layer", "num_heads", "num_kv_heads", "head_dim")

OPS: dict[str, OpSpec] = {
    "embedding": OpSpec(1, 1, (), ("weight",), (), _vocab, _embedding),
    "rms_norm": OpSpec(1, 1, ("eps",), ("weight",), (), _hidden, _rms_norm),
    "add_rms_norm": OpSpec(2, 2, ("eps",), ("weight",), (), _hidden, _add_rms_norm),
    "add": OpSpec(2, 1, (), (), (), _none, _add),
    "linear": OpSpec(1, None, ("in_features", "out_features"), ("weight",), ("bias",), _linear_shapes, _linear),
    "rope": OpSpec(3, 2, ("num_heads", "num_kv_heads", "head_dim"), (), (), _none, _rope),
    "rope_kv_store": OpSpec(4, 1, _ATTN, (), (), _none, _rope_kv_store),
    "attention": OpSpec(3, 1, (*_ATTN, "scale"), (), (), _none, _attention),
    "silu_mul": OpSpec(2, 1, (), (), (), _none, _silu_mul),
    "lm_head": OpSpec(1, 1, (), ("weight",), (), _vocab, _lm_head),
}


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
