"""EngineConfig: how an engine serves an artifact: the artifact's runtime settings (optc/core/settings.py),
its KV block size, and what only a running engine decides (pool size, prefix caching, CUDA graphs,
seeds, the tensor-parallel backend and collective timeout, references instead of kernels). Not here:
the settings' defaults and validation (optc/core/settings.py) or the KV spec (optc/core/kv_cache.py).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from optc.core.artifact import Manifest
from optc.core.errors import InputError
from optc.core.kv_cache import DEFAULT_BLOCK_SIZE
from optc.core.settings import RuntimeSettings

# the EngineConfig fields of tensor and pipeline parallelism (their command-line options: optc/commands/parallel.py)
PARALLEL_OPTIONS = ("tensor_parallel_size", "pipeline_parallel_size", "distributed_backend", "nnodes", "node_rank",
                    "master_addr", "master_port")


class DistributedBackend(enum.StrEnum):
    NCCL = "nccl"  # CUDA
    GLOO = "gloo"  # the CPU


@dataclass(frozen=True)
class EngineConfig(RuntimeSettings):
    """The artifact's RuntimeSettings (optc/core/settings.py) and what only a running engine decides."""

    block_size: int = DEFAULT_BLOCK_SIZE  # the manifest's KV spec's, unless overridden
    num_blocks: int | None = None  # KV pool size in blocks (null block included); None = from memory
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs
    cuda_graph_batch_sizes: tuple[int, ...] | None = None  # decode buckets; None = the default plan, () = none
    seed: int | None = None  # seeds the generators of requests without a seed
    distributed_backend: DistributedBackend | str | None = None  # tensor parallelism: None = nccl on CUDA, gloo
    collective_timeout_s: float = 60.0  # a collective waiting longer fails: a rank died or hung
    # pipeline parallelism cuts a step into micro-batches of at least this many tokens (runtime/pipeline.py): on
    # this repository's 2-core CPU, 2 stages gain 1.3x on 2048-token prefill steps and 1.18x on 256-request
    # decode steps from 2 micro-batches, break even at 64 requests and lose 1.2x at 16 (docs/PERF.md)
    pipeline_micro_batch_tokens: int = 64
    # several machines without torchrun (runtime/distributed.py): each node runs the same command with its
    # node_rank; its ranks are node_rank * R .. + R - 1 (R = ranks / nnodes), met at master_addr:master_port
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # None: 127.0.0.1 on one node (a free port), required with nnodes > 1
    master_port: int | None = None
    use_references: bool = False  # every node runs its op's torch reference (optc eval -tp), not its kernel
    max_loras: int = 0  # LoRA adapter slots (adapters loaded at once); 0: no adapters
    max_lora_rank: int = 64  # the largest adapter rank the slots hold

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.distributed_backend is not None:
            try:
                object.__setattr__(self, "distributed_backend", DistributedBackend(self.distributed_backend))
            except ValueError:
                allowed = [b.value for b in DistributedBackend]
                raise InputError(f"distributed backend (--distributed-backend) must be one of {allowed}, "
                                 f"got {self.distributed_backend!r}") from None
        self._check_nodes()
        if self.pipeline_micro_batch_tokens < 1:
            raise InputError(f"pipeline_micro_batch_tokens must be >= 1, got {self.pipeline_micro_batch_tokens}")
        if self.collective_timeout_s <= 0:
            raise InputError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise InputError(f"max_loras must be >= 0 and max_lora_rank >= 1, got {self.max_loras} and "
                             f"{self.max_lora_rank}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise InputError(f"num_blocks must be >= 2, got {self.num_blocks}")

    def _check_nodes(self) -> None:
        ranks = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise InputError(f"--node-rank must be in [0, --nnodes), got node_rank {self.node_rank} of nnodes "
                             f"{self.nnodes}")
        if ranks % self.nnodes:
            raise InputError(f"--nnodes {self.nnodes} does not divide the {ranks} ranks (tensor_parallel_size "
                             f"{self.tensor_parallel_size} x pipeline_parallel_size {self.pipeline_parallel_size}): "
                             "every node runs as many ranks")
        if self.nnodes > 1 and (self.master_addr is None or self.master_port is None):
            raise InputError("--nnodes > 1 needs --master-addr and --master-port: where node 0's rank 0 listens")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise InputError(f"--master-port must be in [1, 65535], got {self.master_port}")

    @classmethod
    def from_manifest(cls, manifest: Manifest, **overrides: Any) -> EngineConfig:
        """Runtime settings of an artifact's manifest, then the caller's overrides. An artifact built
        without the cuda_graphs pass has no decode buckets: it runs eager."""
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - allowed)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; allowed: {sorted(allowed)}")
        plan = manifest.cuda_graphs or {}
        values = {**manifest.runtime.to_json(), "block_size": manifest.kv_layout.block_size,
                  "cuda_graph_batch_sizes": tuple(plan.get("batch_sizes") or ())}
        return cls(**{**values, **overrides})
