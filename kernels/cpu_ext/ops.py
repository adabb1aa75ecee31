"""Launchers for ops.cpp (kernels/cpu_ext): a decode step's norms, gated activation, rotary + KV store and
attention (decode and speculative verification rows), each one C++ call instead of the reference's 5-15 eager
torch ops.

At batch 1 the CPU step's non-matmul ops cost more in dispatch than in arithmetic (docs/PERF.md, "the decode step's
host cost"): compiling each reference with torch.compile made the step slower (its guards cost more per call than
the ops it fused), so these are plain C++ loops with the references' math and roundings. Each launcher has its op
reference's signature and runs the reference for what ops.cpp does not take (a KV cache of another float dtype,
prefill attention: a request of more than MAX_ROWS query rows, an activation other than silu, a dtype other than
bfloat16 / float32), and wherever the extension cannot be built (kernels/cpu_ext `load`), so an artifact bound to
them runs everywhere.
"""

from __future__ import annotations

import torch

from optc.core.kv_cache import KVCache, dequantize
from optc.core.ops.attention import attention_ref, kv_store_ref
from optc.core.ops.elementwise import gated_act_ref
from optc.core.ops.norm import add_rms_norm_ref, rms_norm_ref
from optc.core.ops.rope import rope_kv_store_ref
from optc.core.settings import MAX_SPECULATIVE_TOKENS
from optc.kernels import cpu_ext

DTYPES = (torch.bfloat16, torch.float32)
# a request with at most this many query rows runs row_attention: a verification of the most drafts, k + 1
MAX_ROWS = MAX_SPECULATIVE_TOKENS + 1
MAX_TREE_NODES = 64  # tree_attention's rows per request: a bit each in an int64 mask


def _ext(x: torch.Tensor):
    """The extension for CPU tensors (a CPU artifact loaded on another device runs the references)."""
    return cpu_ext.load() if x.device.type == "cpu" else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    ext = _ext(x)
    if ext is None or x.dtype not in DTYPES or weight.dtype != x.dtype:
        return rms_norm_ref(x, weight, eps, offset)
    return ext.rms_norm(x.contiguous(), None, weight.contiguous(), eps, offset)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    ext = _ext(x)
    if ext is None or x.dtype not in DTYPES or weight.dtype != x.dtype or residual.dtype != x.dtype:
        return add_rms_norm_ref(x, residual, weight, eps, offset)
    normed, summed = ext.rms_norm(x.contiguous(), residual.contiguous(), weight.contiguous(), eps, offset)
    return normed, summed


def gated_act(x: torch.Tensor, up: torch.Tensor | None = None, act: str = "silu") -> torch.Tensor:
    ext = _ext(x)
    if ext is None or act != "silu" or x.dtype not in DTYPES or x.dim() != 2:
        return gated_act_ref(x, up, act)
    gate, up = x.chunk(2, dim=-1) if up is None else (x, up)
    if up.dtype != gate.dtype or gate.stride(-1) != 1 or up.stride(-1) != 1:
        return gated_act_ref(gate, up, act)
    return ext.silu_mul(gate, up)


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k largest logits' indices, largest first: logits (M, V) -> (M, k) int64. ops.cpp's one SIMD pass
    for CPU float32 rows (torch.topk and argmax make several passes over a row: 0.26 and 0.15 ms for Gemma 3's
    262,144 logits, a tenth of what its lm_head's matmul costs), whose ties go to the smaller index and NaN ranks
    above every number, so k = 1 is argmax; elsewhere torch's argmax (k = 1) or topk."""
    ext = _ext(logits)
    if ext is None or logits.dtype != torch.float32 or logits.dim() != 2 or not 1 <= k <= logits.shape[-1]:
        return logits.argmax(-1, keepdim=True) if k == 1 else logits.topk(k, dim=-1).indices
    return ext.top_k(logits.contiguous(), k)


QUANTIZED_CACHES = (torch.int8, torch.float8_e4m3fn)  # ops.cpp reads and writes their codes with their scales


def cache_ok(kv_cache: KVCache, dtype: torch.dtype) -> bool:
    """A contiguous CPU cache ops.cpp takes: float of the activations' dtype, or int8 / fp8 codes with their
    scales (optc/core/kv_cache.py's `quantize` and `dequantize`, computed the same way)."""
    data, scales = kv_cache.data, kv_cache.scales
    if not data.is_contiguous() or data.device.type != "cpu":
        return False
    if scales is None:
        return data.dtype == dtype
    return data.dtype in QUANTIZED_CACHES and scales.dtype == torch.float32 and scales.is_contiguous()


def rope_kv_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                  kv_cache: KVCache, slot_mapping: torch.Tensor) -> torch.Tensor:
    ext = _ext(q)
    if (ext is None or q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype
            or not cache_ok(kv_cache, q.dtype) or cos_sin.dtype != torch.float32):
        return rope_kv_store_ref(q, k, v, positions, cos_sin, kv_cache, slot_mapping)
    return ext.rope_kv_store(q.contiguous(), k.contiguous(), v.contiguous(), positions.long().contiguous(),
                             cos_sin.contiguous(), kv_cache.data, slot_mapping.long().contiguous(), kv_cache.scales)


def attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: KVCache,
              slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              query_start_loc: torch.Tensor, scale: float, max_query_len: int | None = None,
              max_seq_len: int | None = None, softcap: float | None = None, window: int | None = None,
              tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """attention_ref's math; over a float cache of q's dtype, every row of a request with at most `MAX_ROWS`
    query rows (a decode step's one, a verification's k + 1) runs ops.cpp's row_attention, and only the longer
    requests (prefill) the reference.

    row_attention computes each query row alone, in one order of sums, so a row's output is the same whatever
    else its batch holds: a speculative verification of k + 1 rows gives the bits plain decoding would give one
    row at a time, which keeps greedy speculative output identical to plain decoding in bfloat16 (the
    reference's prefill path, SDPA, rounds differently from its one-query path). That guarantee holds where
    this launcher runs ops.cpp: not where the extension cannot be built, not for a request past `MAX_ROWS` rows
    (an int8 / fp8 cache keeps it: its codes and scales are the reference's, read as code * scale in fp32).

    `tree_mask` (a batch with draft trees, attention_ref's): the requests of at most MAX_TREE_NODES rows run
    row_attention under their rows' bits (`tree_attention`); the longer ones, and those of more than MAX_ROWS
    rows without bits (prefill chunks, causal), the reference, as in a step without trees."""
    ext = _ext(q)
    if (ext is None or q.dtype not in DTYPES or not cache_ok(kv_cache, q.dtype) or seq_lens.shape[0] == 0
            or (tree_mask is not None and window)):
        return attention_ref(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
                             max_query_len, max_seq_len, softcap, window, tree_mask)
    starts = query_start_loc.int().contiguous()
    max_rows = MAX_ROWS if tree_mask is None else MAX_TREE_NODES
    lengths = None if max_query_len is not None and max_query_len <= MAX_ROWS else starts[1:] - starts[:-1]
    if lengths is not None and not bool((lengths <= max_rows).any()):  # prefills only
        return attention_ref(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
                             max_query_len, max_seq_len, softcap, window)
    if k is not None:
        kv_store_ref(k, v, kv_cache, slot_mapping)
    out = ext.row_attention(q.contiguous(), kv_cache.data, block_tables.int().contiguous(),
                            seq_lens.int().contiguous(), starts, scale, softcap or 0.0, window or 0, max_rows,
                            None if tree_mask is None else tree_mask.long().contiguous(), kv_cache.scales)
    if lengths is None:
        return out
    long = lengths > max_rows
    if tree_mask is not None:  # causal prefill chunks of MAX_ROWS + 1 .. 64 rows: the reference, as without trees
        long |= (lengths > MAX_ROWS) & (tree_mask[starts[:-1].long().clamp(max=max(len(q) - 1, 0))] == 0)
    long = long.nonzero().flatten().tolist()
    if long:  # the prefills beside them: the reference over those requests alone, into their rows
        rows = torch.cat([torch.arange(int(starts[b]), int(starts[b + 1])) for b in long])
        sub_starts = torch.nn.functional.pad(lengths[long].cumsum(0), (1, 0)).int()
        out[rows] = attention_ref(q[rows], None, None, kv_cache, slot_mapping, block_tables[long], seq_lens[long],
                                  sub_starts, scale, None, None, softcap, window)
    return out


def tree_attention(q: torch.Tensor, kv_cache: KVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, scale: float, tree_mask: torch.Tensor,
                   softcap: float | None = None) -> torch.Tensor:
    """Attention of draft trees whose K/V are stored: request b's n rows are tree nodes whose keys sit at positions
    seq_lens[b] - n .. seq_lens[b] - 1, and row t sees the context before them and the nodes j of its request
    whose bit j is set in tree_mask[t] (itself and its ancestors; at most 64 nodes). q (T, H_q, D) -> (T, H_q, D).
    Each row computes as row_attention's decode row does, so a chain's mask gives decoding's bits; a cache
    ops.cpp does not take, or no extension: the reference below."""
    if seq_lens.shape[0] and int((query_start_loc[1:] - query_start_loc[:-1]).max()) > MAX_TREE_NODES:
        raise ValueError(f"a draft tree has at most {MAX_TREE_NODES} nodes (one bit each in tree_mask)")
    ext = _ext(q)
    if ext is None or q.dtype not in DTYPES or not cache_ok(kv_cache, q.dtype):
        return _tree_attention_ref(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, tree_mask, softcap)
    return ext.row_attention(q.contiguous(), kv_cache.data, block_tables.int().contiguous(),
                             seq_lens.int().contiguous(), query_start_loc.int().contiguous(), scale, softcap or 0.0,
                             0, MAX_TREE_NODES, tree_mask.long().contiguous(), kv_cache.scales)


def _tree_attention_ref(q: torch.Tensor, kv_cache: KVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, tree_mask: torch.Tensor,
                        softcap: float | None) -> torch.Tensor:
    """tree_attention in fp32 torch ops, request by request: each row's visible keys by mask, softmax, times V."""
    out = torch.empty_like(q)
    block_size, num_kv_heads, head_dim = kv_cache.block_size, kv_cache.data.shape[3], q.shape[-1]
    group = q.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        n = starts[b + 1] - starts[b]
        if n == 0:
            continue
        table = block_tables[b, : -(-length // block_size)].long()
        kv = dequantize(kv_cache.data[table], None if kv_cache.scales is None else kv_cache.scales[table],
                        torch.float32).transpose(0, 1).reshape(2, -1, num_kv_heads, head_dim)[:, :length]
        k, v = kv[0].repeat_interleave(group, 1), kv[1].repeat_interleave(group, 1)  # (L, H_q, D)
        rows = q[starts[b] : starts[b + 1]].float()  # (n, H_q, D)
        scores = torch.einsum("nhd,lhd->hnl", rows, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        bits = (tree_mask[starts[b] : starts[b + 1], None].long() >> torch.arange(n)) & 1  # (n, n)
        seen = torch.cat([torch.ones(n, length - n, dtype=torch.bool), bits.bool()], dim=1)  # (n, L)
        weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[starts[b] : starts[b + 1]] = torch.einsum("hnl,lhd->nhd", weights, v).to(q.dtype)
    return out
