"""What both paged attention kernels share: the inner step (one tile of keys, read through the
block table, folded into a flash-attention online softmax), the score transform of a soft-capped
layer, the key range a sliding window leaves, and the launchers' checks of the cache layout
(optc.core.ops.attention describes it).

Rows are query (token, head) pairs; `query_pos` is each row's position, so a row sees keys up to
it (decode passes the request's last position: every key in the context), and with a sliding
window (`WINDOW`) only keys above query_pos - window. Without a window the step compiles as plain
causal attention (the launchers pass NO_WINDOW, unread). A speculative draft tree (`TREE`, prefill's
only: the attention op's `tree_mask`) also hides this step's key j (at context_len + j) from a row
whose `tree_bits` lack bit j (a node sees itself and its ancestors; a row of a causal request passes
all bits set, -1, so causality alone decides). With one, callers start their key loop at
the window start of their first row (`window_start`), so blocks wholly before it, which the runtime
may have freed (null block 0 in the table), are never read. Scores are in log2 units (the scale is
folded into `qk_scale` with log2 e) and exp2 is used; the running max `m_i`, sum `l_i` and
unnormalized output `acc` are fp32; P is cast to the cache dtype for the second dot. The caller
divides `acc` by `l_i` at the end. With a window, a row that has seen no key yet keeps m_i = -inf
and l_i = 0 without NaN (its window starts past a prefill tile's first step).

Soft-capping (`SOFTCAP`, Gemma 2): the reference's scaled score x = s * scale becomes
cap * tanh(x / cap), then the mask; tanh is 1 - 2 / (1 + e^(2y)), in exp2, saturating to +-1
without overflow (e^(2y) = inf gives 1). The launcher passes qk_scale = 2 * scale / cap * log2 e
(the exp2 argument) and cap_log2 = cap * log2 e.

An int8 / fp8 cache (`HAS_SCALES`) is read as stored and cast to q's dtype (exact: int8 and e4m3
values are bf16 / fp16 values); its per-(token, KV head) scales fold into the scores (a column
scale of q K^T) and into P before the second dot (a row scale of V), so no dequantized tile is
formed and the scale multiplies are per key, not per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optc.kernels._dot import dot

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # the window of a layer without one: longer than any context


@triton.jit
def attend(
    q, m_i, l_i, acc, query_pos,
    kv_base, scale_base, table_ptr, n0, end, block_size, stride_cb, stride_ckv, stride_co,
    stride_sb, stride_skv, stride_so, D, qk_scale, cap_log2, window, tree_bits, context_len,
    HAS_SCALES: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, TREE: tl.constexpr,
    FP32_DOT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # keys n0 .. n0 + BLOCK_N - 1 below `end`; kv_base (scale_base) points at the KV head's K (K
    # scale) of block 0
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < end
    blocks = tl.load(table_ptr + offs_n // block_size, mask=mask_n, other=0)
    rows = blocks.to(tl.int64) * stride_cb + (offs_n % block_size) * stride_co
    kv_ptr = kv_base + rows[:, None] + offs_d[None, :]
    mask_nd = mask_n[:, None] & (offs_d < D)[None, :]
    k = tl.load(kv_ptr, mask=mask_nd, other=0.0)
    if HAS_SCALES:
        scale_ptr = scale_base + blocks.to(tl.int64) * stride_sb + (offs_n % block_size) * stride_so
        k = k.to(q.dtype)
    s = dot(q, tl.trans(k), FP32_DOT)
    if HAS_SCALES:  # s[i, n] = q_i . (k_n * ks_n)
        s = s * tl.load(scale_ptr, mask=mask_n, other=0.0)[None, :]
    if SOFTCAP:  # cap * tanh(x / cap) in log2 units; qk_scale = 2 * scale / cap * log2 e
        s = cap_log2 * (1.0 - 2.0 / (1.0 + tl.exp2(s * qk_scale)))
    else:
        s = s * qk_scale
    visible = (offs_n[None, :] <= query_pos[:, None]) & mask_n[None, :]
    if WINDOW:
        visible = visible & (offs_n[None, :] > query_pos[:, None] - window)
    if TREE:  # this step's key j (at context_len + j) is seen where bit j of the row's tree bits is set
        new = offs_n[None, :] - context_len
        bit = (tree_bits[:, None] >> tl.minimum(tl.maximum(new, 0), 63).to(tl.int64)) & 1
        visible = visible & ((new < 0) | (bit != 0))
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if WINDOW:  # a row whose window starts past this step has seen no key: p = 0 and alpha = 0, not NaN
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    else:  # causal: each caller's first step shows every row a key
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(kv_ptr + stride_ckv, mask=mask_nd, other=0.0)
    if HAS_SCALES:  # sum_n p[i, n] * (v_n * vs_n) = sum_n (p[i, n] * vs_n) * v_n
        p = p * tl.load(scale_ptr + stride_skv, mask=mask_n, other=0.0)[None, :]
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, FP32_DOT)
    return m_new, l_i, acc


@triton.jit
def window_start(first_pos, window):
    """The first key the query at `first_pos` sees (0 without a window)."""
    return tl.maximum(first_pos - window + 1, 0)


def score_args(scale: float, softcap: float | None, window: int | None) -> tuple[float, float, int]:
    """(qk_scale, cap_log2, window) for `attend`: the soft cap folded as its docstring says."""
    assert softcap is None or softcap > 0, f"softcap {softcap} must be positive"
    assert window is None or window > 0, f"window {window} must be positive"
    window = NO_WINDOW if window is None else min(window, NO_WINDOW)
    if softcap is None:
        return scale * LOG2E, 0.0, window
    return 2.0 * scale / softcap * LOG2E, softcap * LOG2E, window


def check_paged_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> tuple[int, int, int, int, int, int]:
    """The Triton launchers' checks of the layout above; returns (num_requests, num_heads,
    num_kv_heads, head_dim, block_size, group)."""
    # q: (T, H_q, D), kv_cache: (num_blocks, 2, block_size, H_kv, D)
    num_requests = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    assert q.dim() == 3 and q.stride(2) == 1, f"q must be (T, H_q, D) with contiguous D, got {list(q.shape)}"
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2 and kv_cache.shape[4] == head_dim, (
        f"kv_cache {list(kv_cache.shape)} must be (num_blocks, 2, block_size, H_kv, {head_dim})"
    )
    assert kv_cache.stride(4) == 1, "kv_cache head dim must be contiguous"
    assert num_heads % num_kv_heads == 0, f"H_q {num_heads} is not a multiple of H_kv {num_kv_heads}"
    assert 16 <= head_dim <= 256, f"head dim {head_dim} must be in [16, 256]"
    assert query_start_loc.shape == (num_requests + 1,), "query_start_loc must be (B + 1,)"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_requests, "block_tables must be (B, max_blocks)"
    if kv_scales is not None:
        assert kv_scales.shape == kv_cache.shape[:4] and kv_scales.dtype == torch.float32, (
            f"kv_scales {list(kv_scales.shape)} {kv_scales.dtype} must be fp32 {list(kv_cache.shape[:4])}"
        )
    else:
        assert kv_cache.dtype.is_floating_point and kv_cache.dtype.itemsize > 1, (
            f"a {kv_cache.dtype} KV cache needs its kv_scales"
        )
    return num_requests, num_heads, num_kv_heads, head_dim, block_size, num_heads // num_kv_heads
