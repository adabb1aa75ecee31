"""Causal varlen prefill (and chunked prefill) attention over the paged, GQA-aware KV cache, with
an optional sliding window and soft cap (optc.core.ops.attention describes the layout and the
reference).

The K/V of every token, the earlier context's and this step's, are read from the paged cache (the
store happens first, in rope_kv_store or kv_store), so a chunk of a long prompt attends to the
chunks before it through the block table with no special case. Query i of request b sits at
position seq_lens[b] - query_len_b + i and sees keys 0 .. its own position (with a `window`, the
last `window` of them). With a `tree_mask` (speculative draft trees), a request of at most 64 rows
whose first row has bits sees this step's keys as its rows' bits say (optc.core.ops.attention's
`attention_ref`): each node itself and its ancestors.

One program serves one (request, KV head, row tile): the rows of a tile are (query token, query
head of the group) pairs flattened as row = i * G + g, so each K/V tile is read once per group.
The KV loop runs from key 0 (with a `window`, from the window start of the tile's first query: blocks
wholly before it are never read) to the tile's last causal position. Flash-attention online softmax in fp32
(exp2, scale folded into log2 e); P is cast to the cache dtype for the second dot (an int8 / fp8
cache: to q's dtype, scales folded in as optc.kernels._attend describes); cast on store. Soft-capping
as optc.kernels._attend describes.

Tiles (`TILES`, by the padded head dim BLOCK_D): (BLOCK_M rows, BLOCK_N keys, warps); head dims that
are not a power of two (Phi-3's 96) pad to BLOCK_D with masked columns. The head-dim-256 tile
(Gemma) runs 8 warps, which spreads its (64, 256) fp32 accumulator so that sm_90 code keeps it in
registers (4 warps spill; BLOCK_M 32 spills with an int8 / fp8 cache); the compile-only check
(tests/test_kernels_compile.py) holds each bf16 / fp16 tile to no spills.

Tests compare it with its op's torch reference (optc.core.ops), on the CPU under TRITON_INTERPRET=1.
The soft cap, the window and the head-dim-256 tile are checked there and compiled for sm_90
(tests/test_kernels_compile.py), not yet run on a GPU (docs/PERF.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optc.kernels._attend import attend, check_paged_args, score_args, window_start
from optc.kernels._dot import fp32_dot

# BLOCK_D -> (BLOCK_M (query token, head) rows per program, BLOCK_N KV tokens per inner step, num_warps)
TILES = {16: (64, 32, 4), 32: (64, 32, 4), 64: (64, 32, 4), 128: (64, 32, 4), 256: (64, 32, 8)}


@triton.jit
def _prefill_kernel(
    # pointers
    q_ptr, cache_ptr, scale_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, tree_ptr, out_ptr,
    # sizes
    G, D, block_size, qk_scale, cap_log2, window,
    # strides: q / out (token, head); cache (block, k|v, offset, head); scales (block, k|v, offset, head);
    # block table (request)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ckv, stride_co, stride_ch,
    stride_sb, stride_skv, stride_so, stride_sh, stride_bt,
    # meta
    HAS_SCALES: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, TREE: tl.constexpr,
    FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    req, kv_head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_ptr + req)
    query_len = tl.load(query_start_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len  # tokens before this step's queries

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < query_len * G
    query_idx = rows // G
    heads = kv_head * G + rows % G
    query_pos = context_len + query_idx  # (BLOCK_M,); rows past the end are masked on store
    offs_d = tl.arange(0, BLOCK_D)
    mask_md = mask_m[:, None] & (offs_d < D)[None, :]
    tokens = (q_start + query_idx).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_md, other=0.0)
    if not HAS_SCALES:  # a float cache: both dots in the cache dtype; a scaled one reads K/V into q's
        q = q.to(cache_ptr.dtype.element_ty)
    tree_bits = tl.full([BLOCK_M], -1, tl.int64)  # all bits: causality alone decides
    if TREE:  # a request of at most 64 rows whose first row has bits is a draft tree
        is_tree = (query_len <= 64) & (tl.load(tree_ptr + q_start) != 0)
        tree_bits = tl.where(is_tree, tl.load(tree_ptr + tokens, mask=mask_m, other=-1), tree_bits)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # causal: no row of this tile sees past its last query's position, nor (a window) before its first
    # query's window start; an empty tile loops 0 times
    last_query = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // G, query_len - 1)
    end = tl.where(tile * BLOCK_M < query_len * G, context_len + last_query + 1, 0)
    start = 0  # a constant without a window: plain causal attention compiles as it did before windows
    if WINDOW:
        start = window_start(context_len + (tile * BLOCK_M) // G, window)
    kv_base = cache_ptr + kv_head * stride_ch
    scale_base = scale_ptr + kv_head * stride_sh
    for n0 in range(start, end, BLOCK_N):
        m_i, l_i, acc = attend(q, m_i, l_i, acc, query_pos, kv_base, scale_base, block_tables_ptr + req * stride_bt,
                               n0, end, block_size, stride_cb, stride_ckv, stride_co, stride_sb, stride_skv,
                               stride_so, D, qk_scale, cap_log2, window, tree_bits, context_len, HAS_SCALES,
                               SOFTCAP, WINDOW, TREE, FP32_DOT, BLOCK_D, BLOCK_N)

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_md)


def paged_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
    max_query_len: int | None = None,
    softcap: float | None = None,
    window: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_attention_ref for any query lengths (prefill, chunked prefill, speculative verify, draft trees).

    `kv_scales`: an int8 / fp8 cache's scales (None: a float cache). `max_query_len` sizes the grid;
    without it the launcher reads query_start_loc (a device sync). `softcap`, `window`, `tree_mask`:
    the reference's (None: none; trees take no window).
    """
    # q: (T, H_q, D), kv_cache: (num_blocks, 2, block_size, H_kv, D), tree_mask: (T,) int64 -> (T, H_q, D)
    assert tree_mask is None or (window is None and tree_mask.shape == q.shape[:1]
                                 and tree_mask.dtype == torch.int64), "tree_mask must be (T,) int64, without a window"
    num_requests, _, num_kv_heads, head_dim, block_size, group = check_paged_args(
        q, kv_cache, block_tables, seq_lens, query_start_loc, kv_scales)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_requests == 0 or q.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    cs = kv_cache.stride()
    ss = kv_scales.stride() if kv_scales is not None else (0,) * 4
    block_d = triton.next_power_of_2(head_dim)
    block_m, block_n, num_warps = TILES[block_d]
    grid = lambda meta: (num_requests, num_kv_heads, triton.cdiv(max_query_len * group, meta["BLOCK_M"]))
    _prefill_kernel[grid](
        q, kv_cache, kv_scales if kv_scales is not None else kv_cache, block_tables, seq_lens, query_start_loc,
        tree_mask if tree_mask is not None else seq_lens, out,
        group, head_dim, block_size, *score_args(scale, softcap, window),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), cs[0], cs[1], cs[2], cs[3], *ss,
        block_tables.stride(0),
        HAS_SCALES=kv_scales is not None, SOFTCAP=softcap is not None, WINDOW=window is not None,
        TREE=tree_mask is not None, FP32_DOT=fp32_dot(q if kv_scales is not None else kv_cache),
        BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=num_warps,
    )
    return out
