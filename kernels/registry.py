"""The Triton kernel table: per kernel name, the IR op it implements, a `supports` predicate over
the node's shapes, formats and dtypes, and how to bind it to the executor's op signature.

`select_kernels` (compiler) asks `select(query)` which kernel serves a node; the runtime loader asks
`impls(names)` for the bound implementations of the names recorded in the graph. The table is plain
data: importing this module imports no Triton (it is an optional dependency); a kernel module is
imported when its kernel is bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from optc.formats import DTYPES, Format, FormatKind

MAX_HIDDEN = 16384  # norm kernels keep one row in registers
MAX_GROUP = 64  # query heads per KV head that the attention tiles hold


@dataclass(frozen=True)
class KernelQuery:
    """What a kernel may depend on, as select_kernels reads it off a node."""

    op: str
    dtype: str  # activation dtype name
    weight: Format | None = None  # linear: the weight's format
    weight_shape: tuple[int, ...] = ()  # linear: (N, K)
    hidden_size: int = 0  # norms
    num_heads: int = 0  # rope, attention
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_dtype: str | None = None  # attention, rope_kv_store: recorded by kv_layout
    kv_block_size: int | None = None


@dataclass(frozen=True)
class KernelSpec:
    name: str
    op: str
    supports: Callable[[KernelQuery], bool]
    bind: Callable[[], Callable]  # imports the kernel, returns an executor Impl(node, inputs, params, step)


def select(query: KernelQuery) -> KernelSpec | None:
    """The first kernel for the query's op that supports it, else None (the torch reference)."""
    return next((k for k in KERNELS.values() if k.op == query.op and k.supports(query)), None)


def impls(names: set[str] | list[str]) -> dict[str, Callable]:
    """Kernel name -> bound implementation, for the executor's `impls` table."""
    unknown = sorted(set(names) - set(KERNELS))
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown}; known: {', '.join(sorted(KERNELS))}")
    return {name: KERNELS[name].bind() for name in sorted(names)}


# --- supports predicates ------------------------------------------------------------------------

def _dtype_ok(q: KernelQuery) -> bool:
    return q.dtype in DTYPES


def _norm_ok(q: KernelQuery) -> bool:
    return _dtype_ok(q) and 0 < q.hidden_size <= MAX_HIDDEN


def _rope_ok(q: KernelQuery) -> bool:
    return _dtype_ok(q) and q.head_dim > 0 and q.head_dim % 2 == 0 and q.head_dim <= 512


def _attention_ok(q: KernelQuery) -> bool:
    d = q.head_dim
    return (_dtype_ok(q) and (q.kv_dtype or q.dtype) in DTYPES and 16 <= d <= 256 and d & (d - 1) == 0
            and q.num_kv_heads > 0 and q.num_heads % q.num_kv_heads == 0
            and q.num_heads // q.num_kv_heads <= MAX_GROUP)


def _rope_kv_store_ok(q: KernelQuery) -> bool:
    return _rope_ok(q) and (q.kv_dtype or q.dtype) in DTYPES


def _w4a16_ok(q: KernelQuery) -> bool:
    w = q.weight
    # act_order weights (imported GPTQ desc_act) carry a `perm` part the kernel does not apply
    return (_dtype_ok(q) and w is not None and w.kind is FormatKind.INT4_G and not w.act_order
            and len(q.weight_shape) == 2 and q.weight_shape[1] % w.group_size == 0 and q.weight_shape[1] % 8 == 0)


def _w8a16_ok(q: KernelQuery) -> bool:
    w = q.weight
    return _dtype_ok(q) and w is not None and w.kind is FormatKind.INT8_WO and len(q.weight_shape) == 2


# --- bindings: launcher -> Impl(node, inputs, params, step); values between nodes are (T, features)

def _bind_rms_norm():
    from optc.kernels.norm import rms_norm

    return lambda node, inputs, params, step: [rms_norm(inputs[0], params["weight"].dense(), node.attrs["eps"])]


def _bind_add_rms_norm():
    from optc.kernels.norm import add_rms_norm

    def impl(node, inputs, params, step):
        return list(add_rms_norm(inputs[0], inputs[1], params["weight"].dense(), node.attrs["eps"]))
    return impl


def _bind_silu_mul():
    from optc.kernels.activation import silu_mul

    return lambda node, inputs, params, step: [silu_mul(inputs[0], inputs[1])]  # gate, up views


def _heads(x, num_heads, head_dim):
    return x.view(x.shape[0], num_heads, head_dim)


def _bind_rope():
    from optc.kernels.rope import rope

    def impl(node, inputs, params, step):
        a = node.attrs
        q, k = _heads(inputs[0], a["num_heads"], a["head_dim"]), _heads(inputs[1], a["num_kv_heads"], a["head_dim"])
        return [rope(q, step.positions, step.cos_sin).flatten(1), rope(k, step.positions, step.cos_sin).flatten(1)]
    return impl


def _bind_rope_kv_store():
    from optc.kernels.rope import rope_kv_store

    def impl(node, inputs, params, step):
        a = node.attrs
        q = _heads(inputs[0], a["num_heads"], a["head_dim"])
        k, v = (_heads(t, a["num_kv_heads"], a["head_dim"]) for t in inputs[1:3])
        cache = step.kv_cache(a["layer"])
        return [rope_kv_store(q, k, v, step.positions, step.cos_sin, cache, step.batch.slot_mapping).flatten(1)]
    return impl


def _bind_paged_attention():
    from optc.kernels.paged_decode import paged_decode
    from optc.kernels.paged_prefill import paged_prefill
    from optc.kernels.rope import kv_store

    def impl(node, inputs, params, step):
        a, b = node.attrs, step.batch
        cache = step.kv_cache(a["layer"])
        if not a.get("kv_stored", False):
            k, v = (_heads(t, a["num_kv_heads"], a["head_dim"]) for t in inputs[1:3])
            kv_store(k, v, cache, b.slot_mapping)
        q = _heads(inputs[0], a["num_heads"], a["head_dim"])
        args = (q, cache, b.block_tables, b.seq_lens, b.query_start_loc, a["scale"])
        # python ints when the batch carries them (ForwardBatch), else the launchers read the tensors;
        # a CUDA-graph capture must pass the capacity as max_seq_len (the split count is baked in)
        max_query_len, max_seq_len = getattr(b, "max_query_len", None), getattr(b, "max_seq_len", None)
        if max_query_len is None:
            max_query_len = int((b.query_start_loc[1:] - b.query_start_loc[:-1]).max()) if q.shape[0] else 0
        if max_query_len == 1 and q.shape[0] == b.seq_lens.shape[0]:
            return [paged_decode(*args, max_seq_len=max_seq_len).flatten(1)]
        return [paged_prefill(*args, max_query_len=max_query_len).flatten(1)]
    return impl


def _bind_linear(module: str, launcher: str):
    def bind():
        import importlib

        fn = getattr(importlib.import_module(f"optc.kernels.{module}"), launcher)

        def impl(node, inputs, params, step):
            w = params["weight"]
            y = fn(inputs[0], w.parts, w.format, params["bias"].dense() if "bias" in params else None)
            split = node.attrs.get("split")
            return list(y.split(split, dim=-1)) if split else [y]
        return impl
    return bind


KERNELS: dict[str, KernelSpec] = {s.name: s for s in (
    KernelSpec("triton.rms_norm", "rms_norm", _norm_ok, _bind_rms_norm),
    KernelSpec("triton.add_rms_norm", "add_rms_norm", _norm_ok, _bind_add_rms_norm),
    KernelSpec("triton.silu_mul", "silu_mul", _dtype_ok, _bind_silu_mul),
    KernelSpec("triton.rope", "rope", _rope_ok, _bind_rope),
    KernelSpec("triton.rope_kv_store", "rope_kv_store", _rope_kv_store_ok, _bind_rope_kv_store),
    KernelSpec("triton.paged_attention", "attention", _attention_ok, _bind_paged_attention),
    KernelSpec("triton.w4a16", "linear", _w4a16_ok, _bind_linear("w4a16", "w4a16_linear")),
    KernelSpec("triton.w8a16", "linear", _w8a16_ok, _bind_linear("w8a16", "w8a16_linear")),
)}
