"""Choose the paged KV-cache layout (block size, dtype) and record it on every attention."""

from __future__ import annotations

from dataclasses import dataclass, field

from optc.formats import DTYPES
from optc.ir import Graph, Node
from optc.ops import OPS
from optc.passmanager import Pass, PassContext, PassResult
from optc.store import TensorStore

BLOCK_SIZES = (16, 32)


class KvLayout(Pass):
    """Choose the paged KV-cache layout (block size, dtype) and record it on every attention."""

    @dataclass(frozen=True)
    class Options:
        block_size: int = field(default=16, metadata={"choices": BLOCK_SIZES, "help": "tokens per KV block"})
        dtype: str | None = field(default=None, metadata={
            "choices": tuple(DTYPES), "help": "KV cache dtype; default: the recipe's dtype"})

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        block_size, dtype = self.options.block_size, self.options.dtype or ctx.dtype
        self._validate(graph, block_size, dtype, ctx.target)
        c = graph.config
        layout = {"block_size": block_size, "dtype": dtype}
        stats = {**layout, "bytes_per_token": c.num_layers * 2 * c.num_kv_heads * c.head_dim * DTYPES[dtype].itemsize}
        manifest = {"kv_layout": layout}
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
        if dtype not in DTYPES:
            raise ValueError(f"kv_layout: dtype {dtype!r} is not allowed; allowed: {', '.join(DTYPES)}")
        c = graph.config
        for n in graph.nodes:
            if not _touches_kv(n):
                continue
            a = n.attrs
            if (a["num_heads"], a["num_kv_heads"], a["head_dim"]) != (c.num_heads, c.num_kv_heads, c.head_dim):
                raise ValueError(f"kv_layout: {n.name} has heads {a['num_heads']}/{a['num_kv_heads']} x "
                                 f"{a['head_dim']}, the model {c.num_heads}/{c.num_kv_heads} x {c.head_dim}")
        # on cuda a cache row (one token, one KV head) must be 16-byte aligned for vectorized access
        if target == "cuda" and (c.head_dim * DTYPES[dtype].itemsize) % 16:
            raise ValueError(f"kv_layout: head_dim {c.head_dim} in {dtype} gives {c.head_dim * DTYPES[dtype].itemsize}"
                             f"-byte rows; target cuda needs a multiple of 16 bytes (use another dtype or target cpu)")


def _touches_kv(node: Node) -> bool:
    return OPS[node.op].touches_kv_cache
