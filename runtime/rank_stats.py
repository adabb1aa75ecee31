"""`RankStats`: one tensor-parallel rank's counters. Its own module because both sides use it: the
model runner reports them (runtime/model_runner.py) and the tensor-parallel group gathers them from every
rank (runtime/distributed.py), and the group's worker loop drives a model runner, so neither of the two
may import the other for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankStats:
    """One rank's counters, as it reports them (`TensorParallelGroup.rank_stats`)."""

    rank: int
    num_forwards: int  # forwards this rank's model runner ran
    num_kv_blocks: int  # blocks in this rank's KV pool, the null block included
