"""Multi-head Latent Attention (DeepSeek-V2) over a latent KV cache: `mla_attention` {layer, num_heads,
num_kv_heads, head_dim, kv_lora_rank, qk_nope_head_dim, v_head_dim, scale, eps}, its torch reference and op spec.

Inputs: q (T, H * (Dn + Dr)) (each head's no-rope part then its rope part, from q_proj or q_b_proj) and kv_a
(T, R + Dr) (kv_a_proj_with_mqa: the latent then one rope key shared by the heads). Params: `kv_norm` (R,)
(kv_a_layernorm) and `kv_b` (H * (Dn + Dv), R) (kv_b_proj: per head, Dn rows of W_UK then Dv rows of W_UV).
Dr is the model's `head_dim` (transformers' qk_rope_head_dim).

    c = rms_norm(kv_a[:, :R]) * kv_norm                (T, R)   the latent
    k_pe = rope(kv_a[:, R:]), q_pe = rope(q[..., Dn:])          interleaved pairs (x[2i], x[2i+1]) rotate by
                                                                frequency i: DeepSeek's complex form
    cache[slot] = [c | k_pe]                           (R + Dr) values per token per layer, one copy for all heads
    prefill (expanded):  k = [c @ W_UK[h]^T | k_pe], v = c @ W_UV[h]^T; softmax(q k^T * scale) v
    decode (absorbed):   q_lat[h] = q_nope[h] @ W_UK[h]          (H, R): W_UK folded into the query
                         s[h] = (q_lat[h] . c + q_pe[h] . k_pe) * scale over the cached tokens
                         o[h] = (softmax(s[h]) @ c) @ W_UV[h]^T  attention in latent space, W_UV after it
so a decode step reads only the latent cache. Both are the same function of the cache (tests hold them
equal) and transformers' DeepseekV2Attention. Math is fp32, cast on store and on output. An int8 / fp8 cache
stores the row through `KVCache.encode` with one absmax scale per token (latent and rope key together).

Cache layout: `KVCacheSpec.block_shape` of an MLA model, (1, block_size, 1, R + Dr) per layer (scales
(1, block_size, 1)), slot s at block s // block_size, offset s % block_size (slot -1: padding, not stored).
This reference is the specification `triton.mla_decode` (kernels/mla_decode.py) is tested against. Not here:
the tensor-parallel split (optc/core/ops/sharding.py: heads split, latent replicated).
"""

from __future__ import annotations

import torch

from optc.core.kv_cache import KVCache, dequantize
from optc.core.ops.norm import rms_norm_ref
from optc.core.ops.spec import OpSpec, heads
from optc.core.rope import GLOBAL

MLA_ATTRS = ("layer", "num_heads", "num_kv_heads", "head_dim", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
             "scale", "eps")


def rope_interleaved_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, Dr) with pairs (x[2i], x[2i+1]) rotated by frequency i (cos_sin: (P, Dr) [cos | sin])."""
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions].unsqueeze(1)  # (T, 1, Dr)
    cos, sin = cs[..., :half], cs[..., half:]
    pairs = x.float().unflatten(-1, (half, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


def mla_attention_ref(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_norm: torch.Tensor,
    kv_b: torch.Tensor,
    kv_cache: KVCache,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    eps: float,
    qk_nope_head_dim: int,
    v_head_dim: int,
    absorb: bool | None = None,
) -> torch.Tensor:
    """Store the tokens' latents, then attend over each request's cached context. `absorb` None: a decode
    step (one query per request) runs the absorbed form, any other batch the expanded one; True/False
    forces one (the tests compare them)."""
    # q: (T, H, Dn + Dr), kv_a: (T, R + Dr) -> (T, H * Dv)
    num_tokens, num_heads, _ = q.shape
    dn, dr = qk_nope_head_dim, cos_sin.shape[-1]
    rank = kv_a.shape[-1] - dr
    q_nope, q_pe = store_latents(q, kv_a, positions, cos_sin, kv_norm, kv_cache, slot_mapping, eps, dn)

    num_requests = seq_lens.shape[0]
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    if num_tokens == 0 or num_requests == 0:
        return q.new_empty((num_tokens, num_heads * v_head_dim))
    max_query = int(query_lens.max())
    block_size = kv_cache.block_size
    num_blocks = -(-int(seq_lens.max()) // block_size)
    table = block_tables[:, :num_blocks].long()
    scales = None if kv_cache.scales is None else kv_cache.scales[table]
    # (B, L, R + Dr): the cached latents, a quantized cache's read back as value * scale
    cached = dequantize(kv_cache.data[table], scales, torch.float32).reshape(num_requests, -1, rank + dr)
    c, kr = cached[..., :rank], cached[..., rank:]  # (B, L, R), (B, L, Dr)
    w = kv_b.float().view(num_heads, dn + v_head_dim, rank)
    w_uk, w_uv = w[:, :dn], w[:, dn:]  # (H, Dn, R), (H, Dv, R)

    dev = q.device
    request = torch.repeat_interleave(torch.arange(num_requests, device=dev), query_lens)  # (T,)
    row = torch.arange(num_tokens, device=dev) - query_start_loc[request].long()
    qn = q_nope.new_zeros((num_requests, max_query, num_heads, dn))
    qr = q_pe.new_zeros((num_requests, max_query, num_heads, dr))
    qn[request, row], qr[request, row] = q_nope, q_pe
    rope_scores = torch.einsum("bqhd,bld->bhql", qr, kr)  # (B, H, Lq, L)
    absorbed = max_query == 1 if absorb is None else absorb
    if absorbed:
        q_lat = torch.einsum("bqhd,hdr->bqhr", qn, w_uk)  # (B, Lq, H, R): W_UK folded into the query
        scores = torch.einsum("bqhr,blr->bhql", q_lat, c) + rope_scores
    else:
        k_nope = torch.einsum("blr,hdr->bhld", c, w_uk)  # (B, H, L, Dn): the keys expanded per head
        scores = torch.einsum("bqhd,bhld->bhql", qn, k_nope) + rope_scores
    query_pos = (seq_lens.long() - query_lens)[:, None] + torch.arange(max_query, device=dev)  # (B, Lq)
    masked = torch.arange(c.shape[1], device=dev)[None, None, :] > query_pos[:, :, None]  # (B, Lq, L)
    probs = (scores * scale).masked_fill_(masked[:, None], float("-inf")).softmax(-1)
    if absorbed:
        out = torch.einsum("bhqr,hvr->bqhv", probs @ c[:, None], w_uv)  # attention in latent space, then W_UV
    else:
        v = torch.einsum("blr,hvr->bhlv", c, w_uv)  # (B, H, L, Dv)
        out = (probs @ v).transpose(1, 2)  # (B, Lq, H, Dv)
    return out[request, row].flatten(1).to(q.dtype)


def store_latents(q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                  kv_norm: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor, eps: float,
                  qk_nope_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens' [latent | rotated k_pe] into the cache; returns the queries' q_nope and rotated q_pe in fp32
    (the step a kernel shares with the reference)."""
    # q: (T, H, Dn + Dr), kv_a: (T, R + Dr) -> (T, H, Dn), (T, H, Dr)
    dn, dr = qk_nope_head_dim, cos_sin.shape[-1]
    rank = kv_a.shape[-1] - dr
    latent = rms_norm_ref(kv_a[:, :rank], kv_norm, eps)  # (T, R)
    k_pe = rope_interleaved_ref(kv_a[:, None, rank:], positions, cos_sin)[:, 0]  # (T, Dr)
    _store(torch.cat((latent, k_pe), dim=-1), kv_cache, slot_mapping)
    return q[..., :dn].float(), rope_interleaved_ref(q[..., dn:], positions, cos_sin).float()


def _store(latent: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    # latent: (T, R + Dr) -> kv_cache.data[slot // bs, 0, slot % bs, 0]
    keep = slot_mapping >= 0
    if not bool(keep.all()):  # padding rows (slot -1) are not stored
        slot_mapping, latent = slot_mapping[keep], latent[keep]
    blocks, offsets = slot_mapping // kv_cache.block_size, slot_mapping % kv_cache.block_size
    values, scales = kv_cache.encode(latent[:, None])  # (T, 1, R + Dr), a quantized cache's scales (T, 1)
    kv_cache.data[blocks, 0, offsets] = values
    if scales is not None:
        kv_cache.scales[blocks, 0, offsets] = scales


def _mla_call(fn, node, inputs, params, step):
    # mla_attention(q, kv_a, positions) {MLA_ATTRS, kv_group?} [kv_norm, kv_b] -> out (T, H * Dv)
    a, b = node.attrs, step.batch
    group = a.get("kv_group")
    block_tables, slot_mapping = (b.block_tables, b.slot_mapping) if group is None else b.group_tables[group]
    q = heads(inputs[0], a["num_heads"], a["qk_nope_head_dim"] + a["head_dim"])
    return [fn(q, inputs[1], step.positions, step.cos_sin[GLOBAL], params["kv_norm"].dense(), params["kv_b"].dense(),
               step.kv_cache(a["layer"]), slot_mapping, block_tables, b.seq_lens, b.query_start_loc, a["scale"],
               a["eps"], a["qk_nope_head_dim"], a["v_head_dim"])]


def _mla_shapes(node, cfg) -> dict:
    a = node.attrs
    return {"kv_norm": (a["kv_lora_rank"],),
            "kv_b": (a["num_heads"] * (a["qk_nope_head_dim"] + a["v_head_dim"]), a["kv_lora_rank"])}


def check_mla(node, formats) -> str | None:
    """Why an mla_attention node cannot run (its kv_b quantized: the absorbed form reads it per head), or None."""
    if formats["kv_b"].is_quantized:
        return f"kv_b {node.params['kv_b']} is {formats['kv_b'].kind.value}: MLA's kv_b_proj stays float"
    return None


MLA_ATTENTION = OpSpec(3, 1, MLA_ATTRS, ("kv_norm", "kv_b"), _mla_shapes, mla_attention_ref, _mla_call,
                       touches_kv_cache=True, reference_syncs_host=True, check=check_mla)
