"""Rotary position embedding (rotate-half / NeoX form, as in HF Llama), and rope fused with the
KV-cache store: torch references and op specs.

`cos_sin`: (max_positions, D) fp32, [cos(p * inv_freq) | sin(p * inv_freq)] per position p, built
once at load time from the model's rope parameters (see optc.core.rope). Math is fp32, cast on store.
Rotated k is rounded to k's dtype and then to the cache dtype. The fused op's reference stores
through a boolean mask of the slot mapping: it syncs with the device (no CUDA-graph capture).
"""

from __future__ import annotations

import torch

from optc.core.kv_cache import KVCache
from optc.core.ops.attention import ATTENTION_ATTRS, kv_store_ref
from optc.core.ops.spec import OpSpec, heads, no_params


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    # x: (T, H, D), positions: (T,), cos_sin: (P, D)
    half = x.shape[-1] // 2
    cs = cos_sin[positions].unsqueeze(1)  # (T, 1, D)
    cos, sin = cs[..., :half], cs[..., half:]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_kv_store_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_cache: KVCache,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotates q and k, stores rotated k and v into `kv_cache` through `slot_mapping`; returns q.
    q and k rotate as one (T, H_q + H_kv, D) tensor when they share a dtype: the same per-element math,
    half the ops per layer (the decode step's host time is mostly per-op overhead)."""
    # q: (T, H_q, D), k, v: (T, H_kv, D)
    if q.dtype != k.dtype:
        kv_store_ref(rope_ref(k, positions, cos_sin), v, kv_cache, slot_mapping)
        return rope_ref(q, positions, cos_sin)
    rotated = rope_ref(torch.cat((q, k), dim=1), positions, cos_sin)  # (T, H_q + H_kv, D)
    kv_store_ref(rotated[:, q.shape[1]:], v, kv_cache, slot_mapping)
    return rotated[:, : q.shape[1]]


def _rope_call(fn, node, inputs, params, step):
    # rope(q, k, positions) {heads} -> rotated q, rotated k (the positions come from the step)
    a = node.attrs
    q, k = heads(inputs[0], a["num_heads"], a["head_dim"]), heads(inputs[1], a["num_kv_heads"], a["head_dim"])
    return [fn(q, step.positions, step.cos_sin).flatten(1), fn(k, step.positions, step.cos_sin).flatten(1)]


def _rope_kv_store_call(fn, node, inputs, params, step):
    # rope_kv_store(q, k, v, positions) {layer, heads} -> rotated q; rotated k and v go to the layer's cache
    a = node.attrs
    q = heads(inputs[0], a["num_heads"], a["head_dim"])
    k, v = (heads(t, a["num_kv_heads"], a["head_dim"]) for t in inputs[1:3])
    cache = step.kv_cache(a["layer"])
    return [fn(q, k, v, step.positions, step.cos_sin, cache, step.batch.slot_mapping).flatten(1)]


ROPE = OpSpec(3, 2, ("num_heads", "num_kv_heads", "head_dim"), (), no_params, rope_ref, _rope_call)
ROPE_KV_STORE = OpSpec(4, 1, ATTENTION_ATTRS, (), no_params, rope_kv_store_ref, _rope_kv_store_call,
                       touches_kv_cache=True, reference_syncs_host=True)
