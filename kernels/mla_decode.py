"""MLA decode in the absorbed form over the paged latent cache (optc/core/ops/mla.py): one program per
(request, head) reads the request's cached rows [latent (R) | rope key (Dr)] block by block and keeps an
online softmax of (q_lat . c + q_pe . k_pe) * scale, accumulating the attention output in latent space.

The launcher has `mla_attention_ref`'s signature: it stores the step's latents and folds W_UK into the
query in torch (`store_latents`, one einsum), runs the kernel for a decode step (one query per request,
a float cache), applies W_UV after it, and runs the reference for any other batch (prefill expands K/V)
or a quantized cache. Numerical policy: fp32 loads, fp32 scores, softmax and accumulator; the output is
cast on store to q's dtype by the launcher. Not bound by default (`select_kernels` binds it when its
`enable` names it): it has been checked under the interpreter and compiled for sm_90, not timed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optc.core.kv_cache import KVCache
from optc.core.ops.mla import mla_attention_ref, store_latents


@triton.jit
def _mla_decode_kernel(
    # pointers: q_lat (B, H, R) fp32, q_pe (B, H, Dr) fp32, the cache (num_blocks, 1, bs, 1, R + Dr),
    # block tables (B, max_blocks) int32, seq_lens (B,), out (B, H, R) fp32
    q_lat_ptr, q_pe_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    # sizes
    rank, rope_dim, scale,
    # strides (elements)
    stride_qb, stride_qh, stride_pb, stride_ph, stride_cache_block, stride_cache_token, stride_table,
    stride_ob, stride_oh,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_R: tl.constexpr,  # >= rank, a power of two
    BLOCK_DR: tl.constexpr,  # >= rope_dim, a power of two
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_DR)
    t = tl.arange(0, BLOCK_SIZE)
    q_lat = tl.load(q_lat_ptr + b * stride_qb + h * stride_qh + r, mask=r < rank, other=0.0)
    q_pe = tl.load(q_pe_ptr + b * stride_pb + h * stride_ph + d, mask=d < rope_dim, other=0.0)
    seq_len = tl.load(seq_lens_ptr + b)
    m = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), 0)  # running max of the scores
    denom = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), 0)  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_R], tl.float32)  # running sum of exp(score - m) * latent
    for n in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + b * stride_table + n).to(tl.int64)
        valid = n * BLOCK_SIZE + t < seq_len
        row = cache_ptr + block * stride_cache_block + t[:, None] * stride_cache_token
        c = tl.load(row + r[None, :], mask=valid[:, None] & (r[None, :] < rank), other=0.0).to(tl.float32)
        k_pe = tl.load(row + rank + d[None, :], mask=valid[:, None] & (d[None, :] < rope_dim),
                       other=0.0).to(tl.float32)
        s = (tl.sum(c * q_lat[None, :], 1) + tl.sum(k_pe * q_pe[None, :], 1)) * scale  # (BLOCK_SIZE,)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        denom = denom * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * c, 0)
        m = m_new
    tl.store(out_ptr + b * stride_ob + h * stride_oh + r, acc / denom, mask=r < rank)


def mla_decode(q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
               kv_norm: torch.Tensor, kv_b: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
               eps: float, qk_nope_head_dim: int, v_head_dim: int, absorb: bool | None = None) -> torch.Tensor:
    """`mla_attention_ref` with a decode step's attention in the Triton kernel (any other batch: the reference)."""
    # q: (T, H, Dn + Dr), kv_a: (T, R + Dr) -> (T, H * Dv)
    num_tokens, num_heads, _ = q.shape
    if num_tokens != seq_lens.shape[0] or kv_cache.scales is not None or absorb is False or num_tokens == 0:
        return mla_attention_ref(q, kv_a, positions, cos_sin, kv_norm, kv_b, kv_cache, slot_mapping, block_tables,
                                 seq_lens, query_start_loc, scale, eps, qk_nope_head_dim, v_head_dim, absorb)
    dn, dr = qk_nope_head_dim, cos_sin.shape[-1]
    rank = kv_a.shape[-1] - dr
    assert kv_cache.data.shape[1:] == (1, kv_cache.block_size, 1, rank + dr), \
        f"a latent cache of rows {rank} + {dr}, got {tuple(kv_cache.data.shape)}"
    assert kv_cache.data.is_contiguous(), "the latent cache must be contiguous"
    q_nope, q_pe = store_latents(q, kv_a, positions, cos_sin, kv_norm, kv_cache, slot_mapping, eps, dn)
    w = kv_b.float().view(num_heads, dn + v_head_dim, rank)
    q_lat = torch.einsum("thd,hdr->thr", q_nope, w[:, :dn]).contiguous()  # (B, H, R): W_UK folded in
    q_pe = q_pe.contiguous()
    tables = block_tables.to(torch.int32)
    out = torch.empty_like(q_lat)
    grid = (num_tokens, num_heads)
    _mla_decode_kernel[grid](
        q_lat, q_pe, kv_cache.data, tables, seq_lens, out,
        rank, dr, scale,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.data.stride(0),
        kv_cache.data.stride(2), tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=kv_cache.block_size, BLOCK_R=triton.next_power_of_2(rank), BLOCK_DR=triton.next_power_of_2(dr),
    )
    return torch.einsum("thr,hvr->thv", out, w[:, dn:]).flatten(1).to(q.dtype)  # W_UV after attention
