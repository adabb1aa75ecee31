"""Prefix-affinity routing of `optc serve --data-parallel-size N`: a Ray Serve RequestRouter (Ray's hook for
custom routing, used by every DeploymentHandle of the engine replicas) that sends a prompt to the replica whose
prefix cache most likely holds its first KV blocks.

A prompt's key is the chain of its first `max_blocks` full KV blocks (the artifact's block size), each block's
hash covering every token before it, as the engine's prefix cache hashes them. The router remembers which
replica each chain hash was last sent to (a bounded LRU table); a prompt goes to the replica of its longest
remembered chain, so the requests of one prefix land on the replica that cached it. A prompt with no remembered
block (or shorter than a block) goes to the least loaded replica (ties broken by a hash of its first block and
the replica's id), and is remembered there.

Load-aware fallback: where the preferred replica's queue (Ray's cached count of requests in flight on it) is
longer than the shortest by more than `imbalance` requests, or full (`max_ongoing_requests`), the request goes to
the least loaded replica instead, which then owns the prefix. Ray's machinery probes queue lengths, backs off
while every replica is full and drops replicas that died; this module only ranks the candidates.

A request whose kwargs hold `replica=ID` goes to that replica only (the ingress's broadcasts: /metrics, LoRA
loads). `replica_ids()` lists the replicas the router in this process currently routes to.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

MAX_BLOCKS = 8  # blocks of a prompt's prefix that count for affinity
TABLE_SIZE = 65536  # chain hashes remembered (least recently used dropped)

_routers: dict[str, PrefixAffinityRouter] = {}  # deployment name -> the router of this process's handles


def prefix_chain(token_ids: Sequence[int], block_size: int, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """Hashes of the first `max_blocks` full blocks of `token_ids`, each covering every token before it."""
    chain, parent = [], 0
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        chain.append(parent)
    return chain


def replica_ids(deployment: str) -> list[str]:
    """The unique ids of the replicas of `deployment` the router in this process routes to (none before its
    first request)."""
    router = _registry().get(deployment)
    return sorted(r.replica_id.unique_id for r in router.curr_replicas.values()) if router else []


def _registry() -> dict[str, PrefixAffinityRouter]:
    """`_routers` of this module as imported: Ray pickles a router class by value, module globals included, so the
    class Ray instantiates sees copies of them."""
    return importlib.import_module(__name__)._routers


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, block_size: int = 16, imbalance: int = 16, max_blocks: int = MAX_BLOCKS,
                         affinity: bool = True) -> None:
        """Ray passes RequestRouterConfig.request_router_kwargs here. Without `affinity`, requests go by load alone
        (benchmarks/serve_data_parallel.py's baseline)."""
        self.affinity = affinity
        self.block_size = block_size
        self.imbalance = imbalance
        self.max_blocks = max_blocks
        self.table: OrderedDict[int, ReplicaID] = OrderedDict()
        _registry()[self._deployment_id.name] = self

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks of replicas, best first: the prefix's replica, then the others by queue length."""
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every replica was tried: back off
        kwargs = pending_request.kwargs if pending_request is not None else {}
        pinned = kwargs.get("replica")
        if pinned is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pinned]]
        prompt_ids = kwargs.get("prompt_ids") or ()
        chain = prefix_chain(prompt_ids, self.block_size, self.max_blocks)
        key = chain[0] if chain else hash(tuple(prompt_ids))  # spreads new prefixes over equally loaded replicas
        by_load = sorted(candidate_replicas, key=lambda r: (self._queue_len(r), hash((key, r.replica_id.unique_id))))
        if not by_load:
            return []
        preferred = self._remembered(chain) if self.affinity else None
        if preferred is None or not self._has_room(preferred, by_load[0]):
            return [by_load]
        return [[preferred], [r for r in by_load if r is not preferred]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """Remember the replica of the request's prefix blocks (Ray calls this once a replica took it)."""
        if pending_request.kwargs.get("replica") is not None:
            return
        for key in prefix_chain(pending_request.kwargs.get("prompt_ids") or (), self.block_size, self.max_blocks):
            self.table[key] = replica_id
            self.table.move_to_end(key)
        while len(self.table) > TABLE_SIZE:
            self.table.popitem(last=False)

    def _remembered(self, chain: list[int]) -> RunningReplica | None:
        """The live replica of the longest remembered block chain of a prompt."""
        for key in reversed(chain):
            replica = self._replicas.get(self.table.get(key))
            if replica is not None:
                self.table.move_to_end(key)
                return replica
        return None

    def _queue_len(self, replica: RunningReplica) -> int:
        known = self.replica_queue_len_cache.get(replica.replica_id)
        return 0 if known is None else known

    def _has_room(self, replica: RunningReplica, least_loaded: RunningReplica) -> bool:
        load = self._queue_len(replica)
        return load < replica.max_ongoing_requests and load - self._queue_len(least_loaded) <= self.imbalance
