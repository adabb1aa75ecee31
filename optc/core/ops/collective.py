"""The collectives of a tensor-parallel graph: `all_reduce` (sum the partial outputs of a
row-parallel linear or a vocab-parallel embedding) and `all_gather` (concatenate vocab-parallel
logits). Torch references over `torch.distributed` and their op specs.

They appear only in the graph of one rank, which optc/core/ops/sharding.py derives from the artifact's
graph at load; an artifact never holds them. They run over `step.group`, the tensor-parallel process
group the runtime passes in the step (NCCL on CUDA, gloo on the CPU); with no group (one rank) they
are the identity. Neither syncs with the host: NCCL collectives are captured into CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from optc.core.ops.spec import OpSpec, no_params

# one all_gather into a single tensor: torch 2.13 names it all_gather_single, older ones all_gather_into_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce_ref(x: torch.Tensor, group) -> torch.Tensor:
    """Sum x over the ranks of `group`, in place (x is the producer's private output)."""
    # x: (T, F) partial sums -> (T, F) on every rank
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


def all_gather_ref(x: torch.Tensor, group, num_features: int) -> torch.Tensor:
    """Concatenate every rank's features in rank order, cut to `num_features`.

    Each rank holds ceil(num_features / N) features but the last, which may hold fewer: shards are
    padded to the common width so one all_gather_into_tensor moves them."""
    # x: (T, F_r) -> (T, num_features)
    if group is None:
        return x
    size = dist.get_world_size(group)
    width = -(-num_features // size)
    shard = F.pad(x, (0, width - x.shape[-1])).contiguous()
    out = x.new_empty((size * shard.shape[0], width))  # the shards stacked along rows: (N * T, width)
    _ALL_GATHER(out, shard, group=group)
    return out.view(size, -1, width).permute(1, 0, 2).reshape(x.shape[0], size * width)[:, :num_features]


def _all_reduce_call(fn, node, inputs, params, step):
    # all_reduce(x) -> sum over the tensor-parallel ranks
    return [fn(inputs[0], getattr(step, "group", None))]


def _all_gather_call(fn, node, inputs, params, step):
    # all_gather(x) {num_features} -> the ranks' features concatenated
    return [fn(inputs[0], getattr(step, "group", None), node.attrs["num_features"])]


ALL_REDUCE = OpSpec(1, 1, (), (), no_params, all_reduce_ref, _all_reduce_call)
ALL_GATHER = OpSpec(1, 1, ("num_features",), (), no_params, all_gather_ref, _all_gather_call)
