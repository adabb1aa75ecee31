"""Choose the paged KV-cache layout (block size, dtype and its scales) and record it on every node
that touches the cache.

The layout is a `KVCacheSpec` (optc/core/kv_cache.py): the manifest's `kv_layout` section holds it, and
every node that touches the cache gets its block size, dtype, scale policy and, for a quantized
cache, where the scales live as attrs (what kernel selection and the executor's transient caches
read off a node). An int8 / fp8_e4m3 cache stores a scale per (token, KV head) beside each block.
A model with sliding-window layers has several KV-cache groups (`kv_cache_groups`, a function of the
model config that the runtime applies too); the stats list them, with a pool block's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from optc.core.ir import Graph, Node
from optc.core.kv_cache import DEFAULT_BLOCK_SIZE, KV_DTYPES, KVCacheSpec, kv_cache_groups
from optc.core.ops import OPS
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult

BLOCK_SIZES = (16, 32)
ROW_ALIGN_BYTES = 16  # cuda: a cache row (one token, one KV head) is read and written in 16-byte vectors


class KvLayout(Pass):
    """Choose the paged KV-cache layout (block size, dtype, scales) and record it on every KV-touching node."""

    @dataclass(frozen=True)
    class Options:
        block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={
            "choices": BLOCK_SIZES, "help": "tokens per KV block"})
        dtype: str | None = field(default=None, metadata={
            "choices": KV_DTYPES, "help": "KV cache dtype (int8 / fp8_e4m3: a scale per token and KV head); "
                                          "default: the recipe's dtype"})

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        block_size, dtype = self.options.block_size, self.options.dtype or ctx.dtype
        self._validate(graph, block_size, dtype, ctx.target)
        spec = KVCacheSpec(block_size, dtype)
        stats = {"block_size": block_size, "dtype": dtype, "scales": spec.scales.value,
                 "bytes_per_token": spec.bytes_per_token(graph.config)}
        groups = kv_cache_groups(graph.config)
        if len(groups) > 1 or groups[0].window is not None:  # sliding layers: what a pool block holds
            stats |= {"groups": [g.to_json() for g in groups], "bytes_per_block": spec.bytes_per_block(graph.config)}
        manifest = {"kv_layout": spec}
        attrs = spec.node_attrs()
        stale = {"kv_scales_at"} - set(attrs)  # a float layout over a quantized one drops the scales' location
        todo = [n for n in graph.nodes if _touches_kv(n)
                and (any(n.attrs.get(k) != v for k, v in attrs.items()) or stale & set(n.attrs))]
        if not todo:
            return PassResult(graph, store, changed=False, stats=stats, manifest=manifest)
        graph = graph.copy()
        graph.nodes = [Node(n.name, n.op, n.inputs, n.outputs,
                            {**{k: v for k, v in n.attrs.items() if k not in stale}, **attrs}, n.params)
                       if _touches_kv(n) else n for n in graph.nodes]
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
        if target != "cuda":
            return
        # the kernels move a cache row (one token, one KV head) in 16-byte vectors
        itemsize = KVCacheSpec(block_size, dtype).torch_dtype.itemsize
        row_bytes = c.head_dim * itemsize
        if row_bytes % ROW_ALIGN_BYTES:
            allowed = [d for d in KV_DTYPES
                       if (c.head_dim * KVCacheSpec(dtype=d).torch_dtype.itemsize) % ROW_ALIGN_BYTES == 0]
            raise ValueError(f"kv_layout: dtype {dtype} with head_dim {c.head_dim} gives {row_bytes}-byte rows; "
                             f"target cuda needs a multiple of {ROW_ALIGN_BYTES} bytes; allowed dtypes for this "
                             f"model: {', '.join(allowed) or 'none'} (or target cpu)")


def _touches_kv(node: Node) -> bool:
    return OPS[node.op].touches_kv_cache
