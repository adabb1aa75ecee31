"""Rotary position embedding (rotate-half / NeoX form, as in HF Llama), and rope fused with the
KV-cache store: a Triton kernel for the references in optc.core.ops.rope and optc.core.ops.attention.

`cos_sin`: (max_positions, R) fp32, [cos(p * inv_freq) | sin(p * inv_freq)] per position p, built
once at load time from the model's rope parameters (see optc.core.rope); the rope op's adapter picks
the layer's table (`rope_table`), so the kernel sees one tensor. R is the rotary width: R = D rotates
the whole head; with partial rotary (R < D, Phi-4-mini's 96 of 128) the first R dims of each head
rotate and the other D - R pass through unchanged (into the cache too). Math is fp32, cast on store.

A program holds each head's whole row (D padded to a power of two, masked): element d < R/2 is
x_d cos - x_(d + R/2) sin, element R/2 <= d < R is x_d cos + x_(d - R/2) sin (the rotate-half pairs,
read as a second, shifted load), element d >= R is x_d (cos 1, sin 0).

One kernel serves three launchers: `rope_kv_store` (rotate q and k, write rotated k and v into the
paged cache through the slot mapping; one program per token), `rope` (rotate one tensor) and
`kv_store` (write k and v without rotating). Rotated k is rounded to k's dtype and then to the
cache dtype, exactly as the reference's two steps do. Into an int8 / fp8 cache each (token, KV head)
row is quantized as optc.core.kv_cache.quantize does (absmax over the row, fp32 scale stored beside the
block, int8 rounded half up, fp8 rounded to nearest even), in the same expressions.

Tests compare it with its op's torch reference (optc.core.ops), on the CPU under TRITON_INTERPRET=1;
partial rotary and head dims 96 / 256 are also compiled for sm_90, not yet run on a GPU (docs/PERF.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optc.core.kv_cache import KVCache


@triton.jit
def _rotate(x_ptr, offs_h, offs_d, mask, partner, cos, sin, stride_h, ROTATE: tl.constexpr):
    # x: (BLOCK_H, BLOCK_D) rows of each head -> rotated rows, fp32; `partner` (BLOCK_D,): the dim each
    # rotated dim pairs with; `sin` carries the rotate-half sign
    ptr = x_ptr + offs_h[:, None] * stride_h
    x = tl.load(ptr + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROTATE:
        pair = tl.load(ptr + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        return x * cos + pair * sin
    return x


@triton.jit
def _quantize(x, scale_ptrs, mask_h, qmax, inv_qmax, IS_INT: tl.constexpr):
    # x: (BLOCK_H, BLOCK_D) fp32 rows of each head (masked columns 0) -> stored values (fp32 holding
    # them exactly); the row's scale amax / qmax goes to scale_ptrs (BLOCK_H,)
    # the reference's products (optc.core.kv_cache.quantize): the scale is amax * (1 / qmax), the inverse an IEEE
    # reciprocal (div_rn: a compiled `/` is approximate, and its last bit can move a value across an int8
    # rounding boundary) times qmax
    amax = tl.max(tl.abs(x), axis=1)
    tl.store(scale_ptrs, amax * inv_qmax, mask=mask_h)
    safe = tl.where(amax > 0, amax, 1.0)
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full(safe.shape, 1.0, tl.float32), safe) * qmax, 0.0)[:, None]
    y = tl.minimum(tl.maximum(x * inv, -qmax), qmax)
    if IS_INT:  # round half up; the cast to int8 then truncates an integer
        y = tl.floor(y + 0.5)
    return y


@triton.jit
def _rope_kv_store_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, q_out_ptr, positions_ptr, cos_sin_ptr, cache_ptr, scale_ptr, slot_ptr,
    # sizes: D the head dim, HALF half the rotary width; qmax: a scaled cache's largest stored magnitude,
    # inv_qmax its reciprocal (rounded to fp32 as torch rounds a Python scalar)
    H_Q, H_KV, D, HALF, block_size, qmax, inv_qmax,
    # strides: q, k, v, q_out (token, head); cos_sin (position); cache (block, k|v, offset, head);
    # scales (block, k|v, offset, head)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_cs, stride_cb, stride_ckv, stride_co, stride_ch, stride_sb, stride_skv, stride_so, stride_sh,
    # meta
    HAS_Q: tl.constexpr, HAS_KV: tl.constexpr, ROTATE_K: tl.constexpr, HAS_SCALES: tl.constexpr,
    IS_INT: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    # rotate-half over the first 2 * HALF dims: dim d pairs with d + HALF (sign -) or d - HALF (sign +);
    # the dims past them pass through (cos 1, sin 0, the pair never read)
    first = offs_d < HALF
    is_rotated = offs_d < 2 * HALF
    angle = tl.where(first, offs_d, offs_d - HALF)
    partner = tl.where(is_rotated, tl.where(first, offs_d + HALF, offs_d - HALF), offs_d)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + angle, mask=is_rotated, other=1.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + angle, mask=is_rotated, other=0.0).to(tl.float32)
    cos, sin = cos[None, :], tl.where(first, -sin, sin)[None, :]
    if HAS_Q:
        offs_h = tl.arange(0, BLOCK_HQ)
        mask = (offs_h < H_Q)[:, None] & mask_d[None, :]
        y = _rotate(q_ptr + tok * stride_qt, offs_h, offs_d, mask, partner, cos, sin, stride_qh, True)
        out = q_out_ptr + tok * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
        tl.store(out, y.to(q_out_ptr.dtype.element_ty), mask=mask)
    if HAS_KV:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_HKV)
        # slot -1: a padding token, no head is stored
        num_stored = tl.where(slot >= 0, H_KV, 0)
        mask = (offs_h < num_stored)[:, None] & mask_d[None, :]
        block, offset = slot // block_size, slot % block_size
        dst = cache_ptr + block * stride_cb + offset * stride_co + offs_h[:, None] * stride_ch + offs_d[None, :]
        k = _rotate(k_ptr + tok * stride_kt, offs_h, offs_d, mask, partner, cos, sin, stride_kh, ROTATE_K)
        k = k.to(k_ptr.dtype.element_ty)  # round to k's dtype first (the reference rotates, then stores)
        v = _rotate(v_ptr + tok * stride_vt, offs_h, offs_d, mask, partner, cos, sin, stride_vh, False)
        if HAS_SCALES:
            mask_h = offs_h < num_stored
            scales = scale_ptr + block * stride_sb + offset * stride_so + offs_h * stride_sh
            k = _quantize(k.to(tl.float32), scales, mask_h, qmax, inv_qmax, IS_INT)
            v = _quantize(v, scales + stride_skv, mask_h, qmax, inv_qmax, IS_INT)
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def rope_kv_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_cache: KVCache,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """optc.core.ops.rope.rope_kv_store_ref: rotates q and k (the first cos_sin.shape[1] dims of each
    head), stores rotated k and v into `kv_cache`; returns rotated q."""
    # q: (T, H_q, D), k, v: (T, H_kv, D), kv_cache.data: (num_blocks, 2, block_size, H_kv, D)
    _check(q, positions, cos_sin)
    _check_kv(k, v, kv_cache, slot_mapping, q.shape[0], q.shape[2])
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _launch(q, k, v, q_out, positions, cos_sin, kv_cache, slot_mapping, rotate_k=True)
    return q_out


def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """optc.core.ops.rope.rope_ref: x: (T, H, D) rotated by the angles of `positions` (the first
    cos_sin.shape[1] dims of each head)."""
    _check(x, positions, cos_sin)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, None, None, out, positions, cos_sin, None, None, rotate_k=False)
    return out


def kv_store(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """optc.core.ops.attention.kv_store_ref: k, v: (T, H_kv, D) -> kv_cache at `slot_mapping`, in place."""
    _check_kv(k, v, kv_cache, slot_mapping, k.shape[0], k.shape[2])
    _launch(None, k, v, None, slot_mapping, None, kv_cache, slot_mapping, rotate_k=False)


def _check(x, positions, cos_sin):
    assert x.dim() == 3, f"expected (T, H, D), got {list(x.shape)}"
    assert x.shape[2] % 2 == 0, f"head dim {x.shape[2]} must be even"
    assert x.stride(2) == 1, "head dim must be contiguous"
    assert positions.shape == (x.shape[0],), f"positions {list(positions.shape)} != ({x.shape[0]},)"
    rotary = cos_sin.shape[-1]
    assert cos_sin.dim() == 2 and rotary % 2 == 0 and 0 < rotary <= x.shape[2], (
        f"cos_sin {list(cos_sin.shape)} must be (P, R) with R even and at most the head dim {x.shape[2]}"
    )
    assert cos_sin.stride(1) == 1, "cos_sin rows must be contiguous"


def _check_kv(k, v, cache: KVCache, slot_mapping, num_tokens, head_dim):
    kv_cache = cache.data
    assert k.shape == v.shape, f"k {list(k.shape)} != v {list(v.shape)}"
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim, f"k {list(k.shape)} mismatches q"
    assert k.stride(2) == 1 and v.stride(2) == 1, "k/v head dim must be contiguous"
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2, (
        f"kv_cache {list(kv_cache.shape)} must be (num_blocks, 2, block_size, H_kv, D)"
    )
    assert kv_cache.shape[3:] == k.shape[1:], f"kv_cache {list(kv_cache.shape)} mismatches k"
    assert kv_cache.stride(4) == 1, "kv_cache head dim must be contiguous"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {list(slot_mapping.shape)}"
    if cache.scales is not None:
        assert cache.scales.shape == kv_cache.shape[:4] and cache.scales.dtype == torch.float32, (
            f"scales {list(cache.scales.shape)} {cache.scales.dtype} must be fp32 {list(kv_cache.shape[:4])}"
        )


def _launch(q, k, v, q_out, positions, cos_sin, cache: KVCache | None, slot_mapping, rotate_k):
    x = q if q is not None else k
    num_tokens, head_dim = x.shape[0], x.shape[2]
    has_kv = cache is not None
    kv_cache = cache.data if has_kv else None
    scales = cache.scales if has_kv else None
    dummy = x  # never dereferenced: the kernel's HAS_Q / HAS_KV branches are compiled out
    qs = q.stride()[:2] if q is not None else (0, 0)
    os_ = q_out.stride()[:2] if q is not None else (0, 0)
    ks, vs = (k.stride()[:2], v.stride()[:2]) if has_kv else ((0, 0), (0, 0))
    cs = kv_cache.stride() if has_kv else (0,) * 5
    ss = scales.stride() if scales is not None else (0,) * 4
    h_q, h_kv = (q.shape[1] if q is not None else 0), (k.shape[1] if has_kv else 0)
    qmax = cache.qmax if has_kv else 0.0
    grid = lambda meta: (num_tokens,)
    _rope_kv_store_kernel[grid](
        q if q is not None else dummy, k if has_kv else dummy, v if has_kv else dummy,
        q_out if q is not None else dummy, positions,
        cos_sin if cos_sin is not None else dummy, kv_cache if has_kv else dummy,
        scales if scales is not None else dummy, slot_mapping if has_kv else positions,
        h_q, h_kv, head_dim, (cos_sin.shape[1] if cos_sin is not None else head_dim) // 2,
        kv_cache.shape[2] if has_kv else 1, qmax, 1.0 / qmax if qmax else 0.0,
        *qs, *ks, *vs, *os_,
        cos_sin.stride(0) if cos_sin is not None else 0, cs[0], cs[1], cs[2], cs[3], *ss,
        HAS_Q=q is not None, HAS_KV=has_kv, ROTATE_K=rotate_k, HAS_SCALES=scales is not None,
        IS_INT=has_kv and not kv_cache.dtype.is_floating_point,
        BLOCK_HQ=triton.next_power_of_2(max(h_q, 1)), BLOCK_HKV=triton.next_power_of_2(max(h_kv, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
        # no fused multiply-add: x * cos and pair * sin round apart, as the reference's torch ops do, so a
        # quantized store lands on the reference's int8 / fp8 values exactly (with the IEEE divisions above)
        enable_fp_fusion=False,
    )
