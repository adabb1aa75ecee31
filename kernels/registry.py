"""The Triton kernel table: per kernel name, the IR op it implements, a `supports` predicate over
the node's shapes, formats and dtypes, and its launcher.

A launcher has its op's torch reference signature (optc.ops), so the op's own node -> arguments
adapter binds it: `impls(names)` returns `OPS[op].bind(launcher)` per name. `select_kernels`
(compiler) asks `select(query)` which kernel serves a node; the runtime loader asks `impls(names)`
for the names recorded in the graph. The table is plain data: importing this module imports no
Triton; a kernel module is imported when its kernel is bound.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from optc.formats import DTYPES, Format, FormatKind
from optc.ops import OPS, Impl

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
    launcher: str  # "module:function" in optc.kernels, with the op reference's signature

    def bind(self) -> Impl:
        """Import the launcher and adapt it to the executor's Impl(node, inputs, params, step)."""
        module, function = self.launcher.split(":")
        return OPS[self.op].bind(getattr(importlib.import_module(f"optc.kernels.{module}"), function))


def select(query: KernelQuery) -> KernelSpec | None:
    """The first kernel for the query's op that supports it, else None (the torch reference)."""
    return next((k for k in KERNELS.values() if k.op == query.op and k.supports(query)), None)


def impls(names: set[str] | list[str]) -> dict[str, Impl]:
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


KERNELS: dict[str, KernelSpec] = {s.name: s for s in (
    KernelSpec("triton.rms_norm", "rms_norm", _norm_ok, "norm:rms_norm"),
    KernelSpec("triton.add_rms_norm", "add_rms_norm", _norm_ok, "norm:add_rms_norm"),
    KernelSpec("triton.silu_mul", "silu_mul", _dtype_ok, "activation:silu_mul"),
    KernelSpec("triton.rope", "rope", _rope_ok, "rope:rope"),
    KernelSpec("triton.rope_kv_store", "rope_kv_store", _rope_kv_store_ok, "rope:rope_kv_store"),
    KernelSpec("triton.paged_attention", "attention", _attention_ok, "attention:paged_attention"),
    KernelSpec("triton.w4a16", "linear", _w4a16_ok, "w4a16:w4a16_linear"),
    KernelSpec("triton.w8a16", "linear", _w8a16_ok, "w8a16:w8a16_linear"),
)}
