"""Rotary position embedding (rotate-half / NeoX form, as in HF Llama), and rope fused with the
KV-cache store: torch references and op specs.

`cos_sin`: (max_positions, R) fp32, [cos(p * inv_freq) | sin(p * inv_freq)] per position p, built
once at load time from the model's rope parameters (see optc.core.rope); the step holds one table per
name and a node reads the one its `rope_table` attr names (default: the global one). R is the rotary
width: with partial rotary (R < D, attr `rotary_dim`) the first R dims of each head rotate and the rest
pass through. Math is fp32, cast on store.
Rotated k is rounded to k's dtype and then to the cache dtype. The fused op's reference stores
through a boolean mask of the slot mapping: it syncs with the device (no CUDA-graph capture).
"""

from __future__ import annotations

import torch

from optc.core.kv_cache import KVCache
from optc.core.ops.attention import ATTENTION_ATTRS, kv_store_ref
from optc.core.ops.spec import OpSpec, heads, no_params
from optc.core.rope import GLOBAL


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    # x: (T, H, D), positions: (T,), cos_sin: (P, R) with R <= D
    rotary = cos_sin.shape[-1]
    half = rotary // 2
    cs = cos_sin[positions].unsqueeze(1)  # (T, 1, R)
    cos, sin = cs[..., :half], cs[..., half:]
    x1, x2 = x[..., :half].float(), x[..., half:rotary].float()
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return rotated if rotary == x.shape[-1] else torch.cat((rotated, x[..., rotary:]), dim=-1)


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


def rope_table(node, step) -> torch.Tensor:
    """The rotary table a rope node reads: the one its `rope_table` attr names, else the global one."""
    return step.cos_sin[node.attrs.get("rope_table", GLOBAL)]


def _rope_call(fn, node, inputs, params, step):
    # rope(q, k, positions) {heads, rope_table?, rotary_dim?} -> rotated q, rotated k (positions: the step's)
    a, table = node.attrs, rope_table(node, step)
    q, k = heads(inputs[0], a["num_heads"], a["head_dim"]), heads(inputs[1], a["num_kv_heads"], a["head_dim"])
    return [fn(q, step.positions, table).flatten(1), fn(k, step.positions, table).flatten(1)]


def _rope_kv_store_call(fn, node, inputs, params, step):
    # rope_kv_store(q, k, v, positions) {layer, heads, rope_table?, rotary_dim?} -> rotated q; rotated k and v
    # go to the layer's cache
    a = node.attrs
    q = heads(inputs[0], a["num_heads"], a["head_dim"])
    k, v = (heads(t, a["num_kv_heads"], a["head_dim"]) for t in inputs[1:3])
    cache = step.kv_cache(a["layer"])
    group = a.get("kv_group")  # a model with several KV-cache groups: the slot mapping of the node's
    slot_mapping = step.batch.slot_mapping if group is None else step.batch.group_tables[group][1]
    return [fn(q, k, v, step.positions, rope_table(node, step), cache, slot_mapping).flatten(1)]


ROPE = OpSpec(3, 2, ("num_heads", "num_kv_heads", "head_dim"), (), no_params, rope_ref, _rope_call)
ROPE_KV_STORE = OpSpec(4, 1, ATTENTION_ATTRS, (), no_params, rope_kv_store_ref, _rope_kv_store_call,
                       touches_kv_cache=True, reference_syncs_host=True)
