"""The attention op's Triton launcher: the KV store, then decode or prefill attention over the paged,
GQA-aware KV cache (optc.core.ops.attention describes the layout and the reference, `attention_ref`).

A batch whose requests each bring one query token runs `paged_decode` (splits long contexts across
programs); any other batch (prefill, chunked prefill, mixed) runs `paged_prefill`. Both take a layer's
soft cap (Gemma 2) and sliding window (Gemma 2 and 3); a sliding layer reads only the blocks its
window reaches.
"""

from __future__ import annotations

import torch

from optc.core.kv_cache import KVCache
from optc.kernels.paged_decode import paged_decode
from optc.kernels.paged_prefill import paged_prefill
from optc.kernels.rope import kv_store


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    kv_cache: KVCache,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    softcap: float | None = None,
    window: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """optc.core.ops.attention.attention_ref: stores k, v (None: stored already), then attends (causal,
    soft-capped by `softcap`, within `window` when given; draft trees under `tree_mask`, in paged_prefill:
    a batch of single rows is causal whatever its bits).

    `max_query_len` and `max_seq_len` size the grids; without them the launchers read the tensors (a
    device sync). A CUDA-graph capture passes its context capacity as `max_seq_len`: the decode
    kernel's split count is baked into the graph.
    """
    # q: (T, H_q, D), k, v: (T, H_kv, D), kv_cache.data: (num_blocks, 2, block_size, H_kv, D) -> (T, H_q, D)
    if k is not None:
        kv_store(k, v, kv_cache, slot_mapping)
    args = (q, kv_cache.data, block_tables, seq_lens, query_start_loc, scale, kv_cache.scales)
    scores = {"softcap": softcap, "window": window}
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if q.shape[0] else 0
    if max_query_len == 1 and q.shape[0] == seq_lens.shape[0]:
        return paged_decode(*args, max_seq_len=max_seq_len, **scores)
    return paged_prefill(*args, max_query_len=max_query_len, tree_mask=tree_mask, **scores)
