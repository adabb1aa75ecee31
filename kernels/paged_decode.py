"""Decode attention over the paged, GQA-aware KV cache: one query token per request, with an optional
sliding window and soft cap.

One program serves one (request, KV head, split): the G = H_q / H_kv query heads of the group are
the rows of one tile (padded to 16 for tl.dot), so each K/V block is read once per group, not once
per query head. Long contexts are split across programs (`num_splits`); each split writes its
normalized partial output with its running max and sum, and a second kernel combines the splits:

    out = sum_s exp(m_s - M) * l_s * o_s / sum_s exp(m_s - M) * l_s,    M = max_s m_s

K/V tokens are gathered through the block table (`BLOCK_N` tokens per step, any number of cache
blocks), so the kernel does not depend on the cache's block size. With a `window` the splits cover
only the request's last `window` keys: blocks wholly before the window start are never read (the
runtime may have freed them: null block 0 in the table), and the split heuristic sizes splits for
min(context, window) tokens. Softmax math is fp32 (exp2 with
the scale folded into log2 e); P is cast to the cache dtype for the second dot (an int8 / fp8 cache:
to q's dtype, with the scales folded in as optc.kernels._attend describes); the output is cast on
store. Soft-capping as optc.kernels._attend describes. Semantics are
optc.core.ops.attention.paged_attention_ref's for requests whose query length is 1 (a request with
seq_len 0 gets zeros). Tiles (`TILES`, by the padded head dim BLOCK_D: head dims that are not a
power of two pad with masked columns): (BLOCK_N keys per step, warps).

Splits (`split_shape`): at batch 1 a long context is the only parallelism there is, so the
heuristic aims at TARGET_PROGRAMS (about four waves of an H100's 132 SMs: one wave of 8 KV heads x
16 splits left most SMs idle while the slowest program finished), in splits down to MIN_SPLIT_TOKENS
(one BLOCK_N step); each split adds an fp32 partial row per query head, a few percent of the KV bytes
it reads. Tests compare it with its op's torch reference (optc.core.ops), on the CPU under
TRITON_INTERPRET=1, and the compile check builds it for sm_90; the soft cap, the window and the
head-dim-256 tile have not yet run on a GPU (docs/PERF.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optc.kernels._attend import attend, check_paged_args, score_args, window_start
from optc.kernels._dot import fp32_dot

BLOCK_N = 64  # the widest inner step (KV tokens); splits are whole multiples of it
TARGET_PROGRAMS = 4 * 132  # about four waves on an H100's 132 SMs
MIN_SPLIT_TOKENS = BLOCK_N  # the smallest split: one inner step
# BLOCK_D -> (BLOCK_N KV tokens per inner step, dividing the module's BLOCK_N; num_warps)
# 256 (Gemma): 32-key steps on 8 warps keep K, V and the scores in registers (64 keys on 4 warps spill
# with an int8 / fp8 cache on sm_90)
TILES = {16: (64, 4), 32: (64, 4), 64: (64, 4), 128: (64, 4), 256: (32, 8)}


@triton.jit
def _decode_kernel(
    # pointers
    q_ptr, cache_ptr, scale_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, out_ptr, part_ptr, ml_ptr,
    # sizes
    G, D, block_size, tokens_per_split, qk_scale, cap_log2, window,
    # strides: q / out (token, head); cache (block, k|v, offset, head); scales (block, k|v, offset, head);
    # block table (request);
    # partials (request, head, split) and max/sum (request, head, split, 2)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ckv, stride_co, stride_ch,
    stride_sb, stride_skv, stride_so, stride_sh,
    stride_bt, stride_pb, stride_ph, stride_ps, stride_mb, stride_mh, stride_ms,
    # meta
    IS_SPLIT: tl.constexpr, HAS_SCALES: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
    FP32_DOT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    req, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    token = tl.load(query_start_ptr + req).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * G + offs_g
    mask_gd = (offs_g < G)[:, None] & (offs_d < D)[None, :]
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_gd, other=0.0)
    if not HAS_SCALES:  # a float cache: both dots in the cache dtype; a scaled one reads K/V into q's
        q = q.to(cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = split * tokens_per_split
    if WINDOW:  # the splits cover the keys from the window start to the end of the context
        start += window_start(seq_len - 1, window)
    end = tl.minimum(start + tokens_per_split, seq_len)
    kv_base = cache_ptr + kv_head * stride_ch
    scale_base = scale_ptr + kv_head * stride_sh
    last = tl.full([BLOCK_G], seq_len - 1, tl.int32)  # decode: every row sees the whole context
    for n0 in range(start, end, BLOCK_N):
        m_i, l_i, acc = attend(q, m_i, l_i, acc, last, kv_base, scale_base, block_tables_ptr + req * stride_bt,
                               n0, end, block_size, stride_cb, stride_ckv, stride_co, stride_sb, stride_skv,
                               stride_so, D, qk_scale, cap_log2, window, last, 0, HAS_SCALES, SOFTCAP, WINDOW,
                               False, FP32_DOT, BLOCK_D, BLOCK_N)

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split (or request) stays zero
    if IS_SPLIT:
        part = part_ptr + req * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
        tl.store(part, acc, mask=mask_gd)
        ml = ml_ptr + req * stride_mb + heads * stride_mh + split * stride_ms
        tl.store(ml, m_i, mask=offs_g < G)
        tl.store(ml + 1, l_i, mask=offs_g < G)
    else:
        out = out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_gd)


@triton.jit
def _combine_kernel(
    # pointers
    part_ptr, ml_ptr, query_start_ptr, out_ptr,
    # sizes
    num_splits, D,
    # strides
    stride_pb, stride_ph, stride_ps, stride_mb, stride_mh, stride_ms, stride_ot, stride_oh,
    # meta
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    req, head = tl.program_id(0), tl.program_id(1)
    token = tl.load(query_start_ptr + req).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    ml = ml_ptr + req * stride_mb + head * stride_mh + offs_s * stride_ms
    m = tl.load(ml, mask=mask_s, other=float("-inf"))
    l_s = tl.load(ml + 1, mask=mask_s, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(l_s > 0, tl.exp2(m - tl.where(m_max > float("-inf"), m_max, 0.0)) * l_s, 0.0)
    part = part_ptr + req * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :]
    o = tl.load(part, mask=mask_s[:, None] & (offs_d < D)[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    o = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < D)


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """paged_attention_ref for batches where every request has exactly one query token.

    `kv_scales`: an int8 / fp8 cache's scales (None: a float cache). `max_seq_len` (the batch's
    longest context) sizes the splits; without it the launcher reads seq_lens (a device sync).
    `num_splits` overrides the heuristic. `softcap`, `window`: the reference's (None: none).
    """
    # q: (B, H_q, D), kv_cache: (num_blocks, 2, block_size, H_kv, D) -> (B, H_q, D)
    num_requests, num_heads, num_kv_heads, head_dim, block_size, group = check_paged_args(
        q, kv_cache, block_tables, seq_lens, query_start_loc, kv_scales)
    assert q.shape[0] == num_requests, f"decode needs one query token per request: {q.shape[0]} != {num_requests}"
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_requests == 0:
        return out
    max_seq_len = max_seq_len if max_seq_len is not None else int(seq_lens.max())
    qk_scale, cap_log2, window_arg = score_args(scale, softcap, window)
    num_splits, tokens_per_split = split_shape(num_requests * num_kv_heads, min(max_seq_len, window_arg), num_splits)
    is_split = num_splits > 1
    if is_split:
        part = torch.empty(num_requests, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(num_requests, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # placeholders, never dereferenced
    cs = kv_cache.stride()
    ss = kv_scales.stride() if kv_scales is not None else (0,) * 4
    block_d = triton.next_power_of_2(head_dim)
    block_n, num_warps = TILES[block_d]
    grid = lambda meta: (num_requests, num_kv_heads, num_splits)
    _decode_kernel[grid](
        q, kv_cache, kv_scales if kv_scales is not None else kv_cache, block_tables, seq_lens, query_start_loc,
        out, part, ml,
        group, head_dim, block_size, tokens_per_split, qk_scale, cap_log2, window_arg,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), cs[0], cs[1], cs[2], cs[3], *ss,
        block_tables.stride(0), part.stride(0), part.stride(1), part.stride(2),
        ml.stride(0), ml.stride(1), ml.stride(2),
        IS_SPLIT=is_split, HAS_SCALES=kv_scales is not None, SOFTCAP=softcap is not None,
        WINDOW=window is not None,
        FP32_DOT=fp32_dot(q if kv_scales is not None else kv_cache),
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n, num_warps=num_warps,
    )
    if is_split:
        grid = lambda meta: (num_requests, num_heads)
        _combine_kernel[grid](
            part, ml, query_start_loc, out, num_splits, head_dim,
            part.stride(0), part.stride(1), part.stride(2), ml.stride(0), ml.stride(1), ml.stride(2),
            out.stride(0), out.stride(1),
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=4,
        )
    return out


def split_shape(num_groups: int, max_seq_len: int, num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, tokens_per_split) for `num_groups` (request, KV head) pairs: the decode kernel
    launches num_groups * num_splits programs. `num_splits` overrides the heuristic, which splits
    only when the groups leave the GPU short of TARGET_PROGRAMS, into splits of at least
    MIN_SPLIT_TOKENS. Splits are whole BLOCK_N steps; none is empty at `max_seq_len`."""
    if num_splits is None:
        wanted = 1 if num_groups >= TARGET_PROGRAMS else triton.cdiv(TARGET_PROGRAMS, num_groups)
        num_splits = max(1, min(wanted, triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS)))
    tokens_per_split = triton.cdiv(max(triton.cdiv(max_seq_len, num_splits), 1), BLOCK_N) * BLOCK_N
    return max(triton.cdiv(max_seq_len, tokens_per_split), 1), tokens_per_split
