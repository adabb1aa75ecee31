"""Paged attention over the GQA-aware KV cache, and the KV store: torch references and the op spec.

KV cache per layer: a `KVCache` (optc/core/kv_cache.py) whose data is (num_blocks, 2, block_size, H_kv,
D); index 0 of dim 1 is K, 1 is V. The op and the store take the `KVCache` (data plus optional
scales) and store through `KVCache.encode`; the attention math (`paged_attention_ref`/`_sdpa`)
takes the cache's data and, for an int8 / fp8 cache, its per-(token, KV head) scales, and reads
K/V dequantized (value * scale, optc/core/kv_cache.py). K/V are stored once per KV head, never repeated
per query head. A token at slot s lives in block s // block_size, offset s % block_size; slot -1
is not stored (padding). Block tables are padded with block 0, the reserved null block.

Attention is causal over each request's context: query i of request b (at position p =
seq_lens[b] - query_len_b + i) sees keys 0 .. p, or with a sliding `window` (attr) keys p - window + 1
.. p (transformers' `kv_idx > q_idx - sliding_window`); blocks wholly before a window may be the null
block in the table, never read. With a `softcap` (attr, Gemma 2) the scaled scores become
softcap * tanh(scores / softcap) before the mask. Math is fp32, cast on store.
`paged_attention_ref` is the specification the Triton kernels (optc.kernels.paged_decode,
paged_prefill) are tested against; `paged_attention_sdpa`, the torch path the runtime runs, computes
the same: SDPA for prefill, the reference's own fp32 math for a decode step. Both read `seq_lens` and
the query lengths on the host, and the store checks the slot mapping for padding there: the reference
syncs with the device (no CUDA-graph capture).
"""

from __future__ import annotations

import torch

from optc.core.kv_cache import KVCache, dequantize
from optc.core.ops.spec import OpSpec, heads, no_params


def kv_store_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    # k, v: (T, H_kv, D) -> kv_cache.data[slot // bs, 0 | 1, slot % bs] in place, in the cache's stored form
    keep = slot_mapping >= 0
    if not bool(keep.all()):  # padding rows (slot -1) are not stored
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    blocks, offsets = slot_mapping // kv_cache.block_size, slot_mapping % kv_cache.block_size
    # K and V in one write: data[blocks, :, offsets] is (T, 2, H_kv, D)
    values, scales = kv_cache.encode(torch.stack((k, v), 1))
    kv_cache.data[blocks, :, offsets] = values
    if scales is not None:  # (T, 2, H_kv): beside the values, in the same block
        kv_cache.scales[blocks, :, offsets] = scales


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """All requests at once: queries and K/V padded per request, one causal mask (no Python loop).
    `kv_scales` (num_blocks, 2, block_size, H_kv): a quantized cache's scales (None: a float cache).
    `tree_mask` (T,) int64: draft trees (see `attention_ref`)."""
    # q: (T, H_q, D) -> (T, H_q, D)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    num_requests = seq_lens.shape[0]
    dev = q.device
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    max_query = int(query_lens.max()) if num_requests else 0
    if num_tokens == 0 or max_query == 0:
        return torch.empty_like(q)
    num_blocks = -(-int(seq_lens.max()) // block_size)
    table = block_tables[:, :num_blocks].long()
    kv = dequantize(kv_cache[table], None if kv_scales is None else kv_scales[table], torch.float32)
    # kv: (B, nb, 2, bs, H_kv, D)
    k = kv[:, :, 0].reshape(num_requests, -1, num_kv_heads, head_dim).transpose(1, 2)  # (B, H_kv, L, D)
    v = kv[:, :, 1].reshape(num_requests, -1, num_kv_heads, head_dim).transpose(1, 2)
    request = torch.repeat_interleave(torch.arange(num_requests, device=dev), query_lens)  # (T,)
    row = torch.arange(num_tokens, device=dev) - query_start_loc[request].long()  # index within its request
    qp = q.new_zeros((num_requests, max_query, num_heads, head_dim), dtype=torch.float32)
    qp[request, row] = q.float()
    # (B, H_kv, group * Lq, D): the query heads of one KV head share its K/V (read once per group)
    qh = qp.view(num_requests, max_query, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qh = qh.reshape(num_requests, num_kv_heads, group * max_query, head_dim)
    scores = _capped((qh @ k.transpose(-1, -2)) * scale, softcap)  # (B, H_kv, group * Lq, L)
    query_pos = (seq_lens.long() - query_lens)[:, None] + torch.arange(max_query, device=dev)  # (B, Lq)
    masked = ~_visible(torch.arange(k.shape[2], device=dev)[None, None, :], query_pos[:, :, None], window)
    if tree_mask is not None:
        masked = _tree_masked(masked, tree_mask, request, row, seq_lens.long() - query_lens, query_lens)
    scores.masked_fill_(masked.repeat(1, group, 1)[:, None], float("-inf"))  # masked: (B, Lq, L)
    out = (scores.softmax(-1) @ v).view(num_requests, num_kv_heads, group, max_query, head_dim)
    out = out.permute(0, 3, 1, 2, 4).reshape(num_requests, max_query, num_heads, head_dim)
    return out[request, row].to(q.dtype)


def paged_attention_sdpa(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    kv_scales: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The torch-bound runtime path: `paged_attention_ref`'s math on the gathered cache.

    Prefill runs SDPA, which reads K/V in the cache dtype (a quantized cache: dequantized to q's
    dtype) and accumulates in fp32 inside, so no fp32 copy of a long gathered context is made. A
    decode step (one query per request) runs the reference's fp32 math on the gathered blocks, one
    matmul per KV head group (`_decode`): on the CPU that is 1.4-3x faster than SDPA's kernel at
    these sizes, and equal to the reference. In a decode step whose caller knows the longest context
    as a Python int (`max_seq_len`, with `max_query_len` 1) it is used instead of reading it off
    `seq_lens`, which saves a reduction and a host read per layer. A soft-capped layer runs the
    reference's fp32 scores in prefill too (SDPA has no cap).
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_requests = seq_lens.shape[0]
    dev = q.device
    if num_tokens == num_requests > 0 and max_query_len == 1 and max_seq_len is not None:
        max_query, longest = 1, max_seq_len
    else:
        query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
        max_query = int(query_lens.max()) if num_requests else 0
        longest = int(seq_lens.max()) if num_requests else 0
    if num_tokens == 0 or max_query == 0:
        return torch.empty_like(q)
    # a capacity bound (a CUDA-graph batch) may exceed the table: more masked keys change nothing
    num_blocks = min(-(-longest // block_size), block_tables.shape[1])
    length = num_blocks * block_size
    # index_select copies whole blocks as contiguous rows: much faster on the CPU than advanced indexing
    table = block_tables[:, :num_blocks].reshape(-1).long()
    if num_tokens == num_requests and max_query == 1:  # a decode step: one query per request, no padding
        return _decode(q, kv_cache, kv_scales, table, seq_lens, scale, softcap, window)
    if softcap:
        return paged_attention_ref(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, kv_scales, softcap,
                                   window)
    dtype = q.dtype if kv_scales is not None else kv_cache.dtype
    k, v = (dequantize(kv_cache[:, i].index_select(0, table), None if kv_scales is None
                       else kv_scales[:, i].index_select(0, table), dtype)
            .view(num_requests, length, num_kv_heads, head_dim).transpose(1, 2)
            for i in (0, 1))  # (B, H_kv, L, D)
    request = torch.repeat_interleave(torch.arange(num_requests, device=dev), query_lens)  # (T,)
    row = torch.arange(num_tokens, device=dev) - query_start_loc[request].long()
    qp = q.new_zeros((num_requests, max_query, num_heads, head_dim), dtype=dtype)
    qp[request, row] = q.to(dtype)
    query_pos = (seq_lens.long() - query_lens)[:, None] + torch.arange(max_query, device=dev)  # (B, Lq)
    allowed = _visible(torch.arange(length, device=dev)[None, None, :], query_pos[:, :, None], window)  # (B, Lq, L)
    out = torch.nn.functional.scaled_dot_product_attention(
        qp.transpose(1, 2), k, v, attn_mask=allowed[:, None], scale=scale, enable_gqa=True)  # (B, H_q, Lq, D)
    return out.transpose(1, 2)[request, row].to(q.dtype)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, table: torch.Tensor,
            seq_lens: torch.Tensor, scale: float, softcap: float | None, window: int | None) -> torch.Tensor:
    """One query per request against its gathered blocks (`table`: (B * nb,) block ids), in fp32 as
    `paged_attention_ref` computes it; K and V are gathered by one index_select."""
    # q: (B, H_q, D) -> (B, H_q, D)
    b, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    kv = dequantize(kv_cache.index_select(0, table), None if kv_scales is None else kv_scales.index_select(0, table),
                    torch.float32).view(b, -1, 2, block_size, num_kv_heads, head_dim)  # (B, nb, 2, bs, H_kv, D)
    length = kv.shape[1] * block_size
    k = kv[:, :, 0].reshape(b, length, num_kv_heads, head_dim).permute(0, 2, 3, 1)  # (B, H_kv, D, L)
    v = kv[:, :, 1].reshape(b, length, num_kv_heads, head_dim).transpose(1, 2)  # (B, H_kv, L, D)
    scores = q.float().view(b, num_kv_heads, num_heads // num_kv_heads, head_dim) @ k  # (B, H_kv, group, L)
    keys = torch.arange(length, device=q.device)
    masked = ~_visible(keys, seq_lens[:, None].long() - 1, window)  # (B, L): the query is at seq_len - 1
    scores = _capped(scores.mul_(scale), softcap).masked_fill_(masked[:, None, None], float("-inf"))
    return (scores.softmax(-1) @ v).view(b, num_heads, head_dim).to(q.dtype)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    kv_cache: KVCache,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    softcap: float | None = None,
    window: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention op: store k, v into the cache (None: stored already, by rope_kv_store), then
    attend. `max_query_len` / `max_seq_len` are the batch's bounds when the caller knows them as
    Python ints (launchers size their grids with them); the reference reads the tensors instead.

    `tree_mask` (T,) int64 (a batch with speculative draft trees; no window): a request of n <= 64 query rows,
    whose K/V sit at the n slots before seq_len, lets row i see the context before them and its request's
    rows j whose bit j is set in tree_mask[i] (a tree node: itself and its ancestors; causal rows: bits 0..i);
    a request whose first row has no bits, or of more rows, is causal. The fp32 reference's math
    (`paged_attention_ref`)."""
    # q: (T, H_q, D), k, v: (T, H_kv, D) -> (T, H_q, D)
    if k is not None:
        kv_store_ref(k, v, kv_cache, slot_mapping)
    if tree_mask is not None:
        return paged_attention_ref(q, kv_cache.data, block_tables, seq_lens, query_start_loc, scale,
                                   kv_cache.scales, softcap, window, tree_mask)
    return paged_attention_sdpa(q, kv_cache.data, block_tables, seq_lens, query_start_loc, scale,
                                max_query_len, max_seq_len, kv_scales=kv_cache.scales, softcap=softcap, window=window)


def attention_kwargs(node) -> dict:
    """The optional arguments an attention node passes its implementation (none for plain causal
    attention, so a kernel that implements only that keeps its signature)."""
    return {a: node.attrs[a] for a in ("softcap", "window") if node.attrs.get(a)}


def _visible(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys a query sees: causal, and within the window when there is one."""
    seen = key_pos <= query_pos
    return seen if window is None else seen & (key_pos > query_pos - window)


def _tree_masked(masked: torch.Tensor, tree_mask: torch.Tensor, request: torch.Tensor, row: torch.Tensor,
                 context: torch.Tensor, query_lens: torch.Tensor) -> torch.Tensor:
    """`masked` (B, Lq, L) with each request of at most 64 rows, whose first row has bits, seeing its new keys as
    its rows' bits say."""
    bits = torch.zeros(masked.shape[:2], dtype=torch.int64, device=masked.device)
    bits[request, row] = tree_mask.long()
    new = torch.arange(masked.shape[2], device=masked.device)[None, :] - context[:, None]  # (B, L): new row index
    is_new = (new >= 0) & (new < query_lens[:, None])
    seen = ((bits[:, :, None] >> new.clamp(0, 63)[:, None, :]) & 1).bool()  # (B, Lq, L)
    tree = ((query_lens <= 64) & (bits[:, 0] != 0))[:, None, None] & is_new[:, None, :]
    return torch.where(tree, ~seen, masked)


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if not softcap else torch.tanh(scores / softcap) * softcap


def _attention_call(fn, node, inputs, params, step):
    # attention(q, k, v) {layer, heads, scale, softcap?, window?, kv_group?} -> out;  {kv_stored}: attention(q)
    # reads the cache
    a, b = node.attrs, step.batch
    cache = step.kv_cache(a["layer"])
    group = a.get("kv_group")  # a model with several KV-cache groups: the block table of the node's
    block_tables, slot_mapping = (b.block_tables, b.slot_mapping) if group is None else b.group_tables[group]
    k = v = None
    if not a.get("kv_stored", False):
        k, v = (heads(t, a["num_kv_heads"], a["head_dim"]) for t in inputs[1:3])
    q = heads(inputs[0], a["num_heads"], a["head_dim"])
    # Python ints when the batch carries them (the runtime's ForwardBatch); a CUDA-graph capture
    # passes its capacity as max_seq_len
    tree_mask = getattr(b, "tree_mask", None)  # draft trees: only kernels that take the mask run such a batch
    out = fn(q, k, v, cache, slot_mapping, block_tables, b.seq_lens, b.query_start_loc, a["scale"],
             max_query_len=getattr(b, "max_query_len", None), max_seq_len=getattr(b, "max_seq_len", None),
             **attention_kwargs(node), **({} if tree_mask is None else {"tree_mask": tree_mask}))
    return [out.flatten(1)]


ATTENTION_ATTRS = ("layer", "num_heads", "num_kv_heads", "head_dim")
ATTENTION = OpSpec(3, 1, (*ATTENTION_ATTRS, "scale"), (), no_params, attention_ref, _attention_call,
                   touches_kv_cache=True, reference_syncs_host=True)
