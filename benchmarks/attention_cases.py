"""benchmarks/kernels.py's attention rows: paged KV caches of random blocks (float, int8 or fp8 with scales), and
the decode, prefill and draft-tree cases over them, each a (kernel fn, torch fn) pair; a row with a soft cap or a
sliding window compares with the runtime's torch path, which computes them.
"""

from __future__ import annotations

from functools import partial as bind

import torch
import torch.nn.functional as F

BLOCK_SIZE = 16
PREFILL = 512  # prompt tokens of the prefill rows (linears at M=PREFILL take the tiled GEMM path)
TREE_ROWS = 11  # a draft tree's verification rows: the root and 10 nodes


def layers(m) -> list[tuple[str, int | None]]:
    """(kernel name suffix, window) per kind of attention layer the model has: global, and local if it slides."""
    return [("", None)] + ([(".local", m.window)] if m.window else [])


def _torch_path(m, window, q, cache, tables, seq_lens, starts, scale, kv_scales, **bounds):
    """The runtime's torch attention (SDPA, or the fp32 reference where it soft-caps), for rows with a
    soft cap or a window, which the plain SDPA call of the other rows does not compute."""
    from optc.core.ops.attention import paged_attention_sdpa

    return bind(paged_attention_sdpa, q, cache, tables, seq_lens, starts, scale, kv_scales=kv_scales,
                softcap=m.softcap, window=window, **bounds)


def _gather(cache, kv_scales, tables, dtype):
    """The blocks of `tables` (B, nb) as (B, nb, 2, block_size, H_kv, D) in `dtype` (dequantized with scales)."""
    from optc.core.kv_cache import dequantize

    table = tables.long()
    return cache[table] if kv_scales is None else dequantize(cache[table], kv_scales[table], dtype)


def quantized_cache(cache, kv: str, data):
    """A KVCache of `kv` (int8 | fp8_e4m3) with the float cache's shape: values from it, scales drawn."""
    from optc.core.kv_cache import QMAX, STORAGE_DTYPES, KVCache

    storage = STORAGE_DTYPES[kv]
    values = (cache * 40).clamp(-127, 127).to(storage) if storage == torch.int8 else cache.to(storage)
    return KVCache(values, data(*cache.shape[:4], dtype=torch.float32).abs() * 0.02, QMAX[kv])


def _paged(m, batch, ctx, dev, data):
    """A KV cache holding `batch` contexts of `ctx` tokens in shuffled blocks, with its tables."""
    per = -(-ctx // BLOCK_SIZE)
    cache = data(1 + batch * per, 2, BLOCK_SIZE, m.kv_heads, m.head_dim)
    tables = (torch.randperm(batch * per, device=dev) + 1).int().view(batch, per)
    seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    return cache, tables, seq_lens


def decode(m, batch, ctx, dev, data, kernel, kv_dtype=None, window=None):
    cache, tables, seq_lens = _paged(m, batch, ctx, dev, data)
    starts = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    q = data(batch, m.heads, m.head_dim)
    scale = m.head_dim ** -0.5
    kv_scales = None
    if kv_dtype is not None:  # the kernel reads the quantized cache; torch gathers and dequantizes, as the reference
        quantized = quantized_cache(cache, kv_dtype, data)
        cache, kv_scales = quantized.data, quantized.scales

    def torch_fn():  # gather each request's K/V (dequantized), then SDPA with GQA (no causal mask for decode)
        kv = _gather(cache, kv_scales, tables, q.dtype).transpose(1, 2).reshape(batch, 2, ctx, m.kv_heads, m.head_dim)
        k, v = kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)  # (B, H_kv, ctx, D)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)

    tri = bind(kernel, q, cache, tables, seq_lens, starts, scale, kv_scales, max_seq_len=ctx, softcap=m.softcap,
               window=window)
    if m.softcap or window:
        torch_fn = _torch_path(m, window, q, cache, tables, seq_lens, starts, scale, kv_scales, max_query_len=1,
                               max_seq_len=ctx)
    return tri, torch_fn


def prefill(m, batch, dev, data, kernel, kv_dtype=None, window=None):
    cache, tables, seq_lens = _paged(m, batch, PREFILL, dev, data)
    starts = torch.arange(0, (batch + 1) * PREFILL, PREFILL, device=dev, dtype=torch.int32)
    q = data(batch * PREFILL, m.heads, m.head_dim)
    scale = m.head_dim ** -0.5
    kv_scales = None
    if kv_dtype is not None:
        quantized = quantized_cache(cache, kv_dtype, data)
        cache, kv_scales = quantized.data, quantized.scales

    def torch_fn():  # causal SDPA with GQA over each prompt's gathered (dequantized) K/V
        kv = _gather(cache, kv_scales, tables, q.dtype)
        kv = kv.transpose(1, 2).reshape(batch, 2, PREFILL, m.kv_heads, m.head_dim)
        k, v = kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
        qb = q.view(batch, PREFILL, m.heads, m.head_dim).transpose(1, 2)
        return F.scaled_dot_product_attention(qb, k, v, scale=scale, is_causal=True, enable_gqa=True)

    tri = bind(kernel, q, cache, tables, seq_lens, starts, scale, kv_scales, max_query_len=PREFILL,
               softcap=m.softcap, window=window)
    if m.softcap or window:
        torch_fn = _torch_path(m, window, q, cache, tables, seq_lens, starts, scale, kv_scales)
    return tri, torch_fn


def tree(m, dev, data, kernel):
    """A draft tree's verification at batch 1: the root and TREE_ROWS - 1 nodes, two children per node, after
    PREFILL - TREE_ROWS tokens of context, under its ancestor bits (the attention op's tree_mask); the torch
    side is the op reference with the same mask."""
    from optc.core.ops.attention import paged_attention_ref
    from optc.runtime.batch import tree_rows

    cache, tables, seq_lens = _paged(m, 1, PREFILL, dev, data)
    q = data(TREE_ROWS, m.heads, m.head_dim)
    starts = torch.tensor([0, TREE_ROWS], device=dev, dtype=torch.int32)
    tree_mask = torch.tensor(tree_rows([(j - 1) // 2 for j in range(TREE_ROWS - 1)])[1], device=dev)
    args = (q, cache, tables, seq_lens, starts, m.head_dim ** -0.5)
    return (bind(kernel, *args, max_query_len=TREE_ROWS, tree_mask=tree_mask),
            bind(paged_attention_ref, *args, tree_mask=tree_mask))


def tree_bytes(m, e: int) -> int:
    """What `tree` reads and writes at least: the context's K/V, q and the output."""
    return 2 * PREFILL * m.kv_heads * m.head_dim * e + 2 * TREE_ROWS * m.heads * m.head_dim * e
