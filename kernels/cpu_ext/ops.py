"""Launchers for ops.cpp (kernels/cpu_ext): a decode step's norms, gated activation, rotary + KV store and
decode attention, each one C++ call instead of the reference's 5-15 eager torch ops.

At batch 1 the CPU step's non-matmul ops cost more in dispatch than in arithmetic (docs/PERF.md, "the decode
step's host cost"): compiling each reference with torch.compile made the step slower (its guards cost more per
call than the ops it fused), so these are plain C++ loops with the references' math and roundings. Each launcher
has its op reference's signature and runs the reference for what ops.cpp does not take (a quantized KV cache,
prefill attention, an activation other than silu, a dtype other than bfloat16 / float32), and wherever the
extension cannot be built (kernels/cpu_ext `load`), so an artifact bound to them runs everywhere.
"""

from __future__ import annotations

import torch

from optc.core.kv_cache import KVCache
from optc.core.ops.attention import attention_ref, kv_store_ref
from optc.core.ops.elementwise import gated_act_ref
from optc.core.ops.norm import add_rms_norm_ref, rms_norm_ref
from optc.core.ops.rope import rope_kv_store_ref
from optc.kernels import cpu_ext

DTYPES = (torch.bfloat16, torch.float32)


def _ext(x: torch.Tensor):
    """ops.cpp's module for CPU tensors (a CPU artifact loaded on another device runs the references)."""
    return cpu_ext.load_ops() if x.device.type == "cpu" else None


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


def _float_cache(kv_cache: KVCache, dtype: torch.dtype) -> bool:
    return kv_cache.scales is None and kv_cache.data.dtype == dtype and kv_cache.data.is_contiguous()


def rope_kv_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                  kv_cache: KVCache, slot_mapping: torch.Tensor) -> torch.Tensor:
    ext = _ext(q)
    if (ext is None or q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype
            or not _float_cache(kv_cache, q.dtype) or cos_sin.dtype != torch.float32):
        return rope_kv_store_ref(q, k, v, positions, cos_sin, kv_cache, slot_mapping)
    return ext.rope_kv_store(q.contiguous(), k.contiguous(), v.contiguous(), positions.long().contiguous(),
                             cos_sin.contiguous(), kv_cache.data, slot_mapping.long().contiguous())


def attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: KVCache,
              slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              query_start_loc: torch.Tensor, scale: float, max_query_len: int | None = None,
              max_seq_len: int | None = None, softcap: float | None = None, window: int | None = None) -> torch.Tensor:
    """attention_ref; a decode step (one query per request, as the batch says with `max_query_len` 1) over a
    float cache of q's dtype runs ops.cpp's decode_attention, everything else the reference."""
    ext = _ext(q)
    decoding = max_query_len == 1 and q.shape[0] == seq_lens.shape[0] > 0
    if ext is None or not decoding or q.dtype not in DTYPES or not _float_cache(kv_cache, q.dtype):
        return attention_ref(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
                             max_query_len, max_seq_len, softcap, window)
    if k is not None:
        kv_store_ref(k, v, kv_cache, slot_mapping)
    return ext.decode_attention(q.contiguous(), kv_cache.data, block_tables.int().contiguous(),
                                seq_lens.int().contiguous(), scale, softcap or 0.0, window or 0)
