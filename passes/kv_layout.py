"""Choose the paged KV-cache layout (block size, dtype) and record it on every attention.

The layout is a `KVCacheSpec` (optc/core/kv_cache.py): the manifest's `kv_layout` section holds it, and
every node that touches the cache gets its block size and dtype as attrs (what kernel selection
reads off a node).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from optc.core.ir import Graph, Node
from optc.core.kv_cache import DEFAULT_BLOCK_SIZE, KV_DTYPES, KVCacheSpec
from optc.core.ops import OPS
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult

BLOCK_SIZES = (16, 32)


class KvLayout(Pass):
    """Choose the paged KV-cache layout (block size, dtype) and record it on every attention."""

    @dataclass(frozen=True)
    class Options:
        block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={
            "choices": BLOCK_SIZES, "help": "tokens per KV block"})
        dtype: str | None = field(default=None, metadata={
            "choices": KV_DTYPES, "help": "KV cache dtype; default: the recipe's dtype"})

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        block_size, dtype = self.options.block_size, self.options.dtype or ctx.dtype
        self._validate(graph, block_size, dtype, ctx.target)
        spec = KVCacheSpec(block_size, dtype)
        stats = {"block_size": block_size, "dtype": dtype,
                 "bytes_per_token": spec.bytes_per_block(graph.config) // block_size}
        manifest = {"kv_layout": spec}
        attrs = {"kv_block_size": block_size, "kv_dtype": dtype}
        todo = [n for n in graph.nodes if _touches_kv(n) and any(n.attrs.get(k) != v for k, v in attrs.items())]
        if not todo:
            return PassResult(graph, store, changed=False, stats=stats, manifest=manifest)
        graph = graph.copy()
        graph.nodes = [Node(n.name, n.op, n.inputs, n.outputs, {**n.attrs, **attrs}, n.params) if _touches_kv(n)
                       else n for n in graph.nodes]
        return PassResult(graph, store, changed=True, stats=stats, manifest=manifest)

    def ensures(self, graph: Graph) -> None:
        for n in graph.nodes:
            if _touches_kv(n) and "kv_block_size" not in n.attrs:
                raise AssertionError(f"{n.name}: no KV layout recorded")

    @staticmethod
    def _validate(graph: Graph, block_size: int, dtype: str, target: str) -> None:
        if block_size not in BLOCK_SIZES:
            raise ValueError(f"kv_layout: block_size {block_size} is not allowed; allowed: {list(BLOCK_SIZES)}")
        if dtype not in KV_DTYPES:
            raise ValueError(f"kv_layout: dtype {dtype!r} is not allowed; allowed: {', '.join(KV_DTYPES)}")
        c = graph.config
        for n in graph.nodes:
            if not _touches_kv(n):
                continue
            a = n.attrs
            if (a["num_heads"], a["num_kv_heads"], a["head_dim"]) != (c.num_heads, c.num_kv_heads, c.head_dim):
                raise ValueError(f"kv_layout: {n.name} has heads {a['num_heads']}/{a['num_kv_heads']} x "
                                 f"{a['head_dim']}, the model {c.num_heads}/{c.num_kv_heads} x {c.head_dim}")
        # on cuda a cache row (one token, one KV head) must be 16-byte aligned for vectorized access
        row_bytes = c.head_dim * KVCacheSpec(block_size, dtype).torch_dtype.itemsize
        if target == "cuda" and row_bytes % 16:
            raise ValueError(f"kv_layout: head_dim {c.head_dim} in {dtype} gives {row_bytes}-byte rows; target "
                             "cuda needs a multiple of 16 bytes (use another dtype or target cpu)")


def _touches_kv(node: Node) -> bool:
    return OPS[node.op].touches_kv_cache
