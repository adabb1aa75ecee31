"""CUDA graphs for decode steps: `Model.forward` captured once per batch-size bucket, replayed with
the batch padded to the bucket.

Used only for pure-decode steps (one query token per request, one logit row per request) whose
request count fits a bucket; every other step (prefill, mixed, speculative verification, a batch
larger than the largest bucket) runs eager. Not used on the CPU (`make_runner` returns None there:
the model runner runs eager), with `enforce_eager` (`optc bench --eager`), nor for an artifact built
without the `cuda_graphs` pass (its manifest plans no buckets).

How a capture stays valid for every replay:
- Static buffers sized for the largest bucket; bucket b reads their first b rows, so every graph
  reads the same memory and a replay only copies the step's batch into it. Padding rows hold input
  id 0 at position 0, slot -1 (the KV store skips it), seq_len 1 and a block-table row of zeros:
  they read one token of the null block, write nothing, and their logits are dropped.
- The model runner builds a decode step that will replay straight into the static buffers
  (`CudaGraphRunner.build`): the varying buffers are views of one device buffer, mirrored by one
  pinned host buffer; the step's rows and the bucket's padding rows are written on the host and
  copied in one host->device transfer, with no device-side copies or fills. Other steps are built
  by a `BatchBuilder` (one transfer too) and run eager.
- A model with several KV-cache groups (sliding-window layers) has a static block table and slot
  mapping per group, as wide as the others (a sliding group's released blocks are null entries).
- The static batch's `max_seq_len` is the engine's context capacity, not the step's: the decode
  kernel turns it into a split count (a Python int) that the graph bakes in, so it must cover the
  longest context a replay can see. Block tables are as wide as that capacity.
- Only graphs whose KV nodes are bound to Triton kernels are captured: their torch references sync
  with the host (`int(seq_lens.max())` in paged_attention_ref, boolean-mask indexing in
  kv_store_ref: `OpSpec.reference_syncs_host`), which a capture cannot contain; `capture_blockers`
  names such nodes and the runner refuses them (the model runner then warns and runs eager). Rebuild
  with `select_kernels`.
- Each bucket is run eagerly (warm-up) before its capture: Triton compiles per specialization and
  autotunes per key (the token count is part of both).
- One private memory pool serves every graph, captured largest bucket first so smaller graphs
  reuse its blocks. The logits a replay returns are a view of the graph's output: valid until the
  next replay of any bucket (the model runner samples from them before the next step).
- A model with LoRA slots (runtime/lora.py) captures its adapter kernels: each row's slot is one more
  static buffer (-1 on padding rows and rows without an adapter: the kernel adds nothing there), and
  the adapters' factors live in tables allocated once for every slot, which loading an adapter
  overwrites in place, so a graph captured before an adapter was loaded replays it.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from optc.core.ir import Graph
from optc.core.ops import host_syncing_nodes
from optc.core.settings import CUDA_GRAPH_BATCH_SIZES
from optc.runtime.batch import BatchBuilder, ForwardBatch, Packed, host_buffer, write_block_tables, write_group_tables
from optc.runtime.model import kv_windows

NUM_WARMUP_RUNS = 2


@dataclass(frozen=True)
class GraphConfig:
    batch_sizes: tuple[int, ...]  # sorted, unique, >= 1
    max_seq_len: int  # context capacity the decode kernel's split count is fixed for
    block_size: int
    max_blocks_per_request: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be non-empty ints >= 1, got {list(self.batch_sizes)}")
        if self.max_seq_len < 1 or self.block_size < 1:
            raise ValueError(f"max_seq_len and block_size must be >= 1, got {self.max_seq_len}, {self.block_size}")
        object.__setattr__(self, "batch_sizes", tuple(sorted(set(self.batch_sizes))))
        object.__setattr__(self, "max_blocks_per_request", -(-self.max_seq_len // self.block_size))

    @property
    def max_capture_size(self) -> int:
        return self.batch_sizes[-1]


def plan_batch_sizes(batch_sizes: Sequence[int] | None, max_num_seqs: int) -> tuple[int, ...]:
    """The manifest's buckets (None: the default ones) that a step of `max_num_seqs` can use."""
    sizes = CUDA_GRAPH_BATCH_SIZES if batch_sizes is None else batch_sizes
    return tuple(sorted({int(b) for b in sizes if 1 <= b <= max_num_seqs}))


def bucket_for(batch_sizes: Sequence[int], num_requests: int) -> int | None:
    """The smallest bucket holding `num_requests` (sorted `batch_sizes`), None if none does."""
    i = bisect.bisect_left(batch_sizes, num_requests)
    return batch_sizes[i] if i < len(batch_sizes) and num_requests >= 1 else None


def is_pure_decode(batch: ForwardBatch) -> bool:
    """One new token and one logit row per request (read off shapes and ints: no device sync)."""
    n = batch.num_requests
    return n >= 1 and batch.max_query_len == 1 and batch.num_tokens == n and batch.logits_indices.shape[0] == n


def capture_blockers(graph: Graph) -> list[str]:
    """KV nodes bound to torch references that sync with the host, which no graph can capture."""
    return [f"{n.name} ({n.op})" for n in host_syncing_nodes(graph)]


class StaticBatch:
    """The input buffers every graph reads, sized for the largest bucket; padding rows by default. `with_lora`:
    also each row's LoRA adapter slot (-1: none, and every padding row), read by the captured adapter kernels."""

    def __init__(self, config: GraphConfig, device: torch.device | str = "cpu", num_groups: int = 1,
                 with_lora: bool = False) -> None:
        rows, width = config.max_capture_size, config.max_blocks_per_request
        i32, i64 = torch.int32, torch.int64
        device = torch.device(device)
        groups = (num_groups,) if num_groups > 1 else ()  # KV-cache groups: a table and slot mapping each
        # the buffers a step changes: views of one device buffer, written from one host mirror
        lora = {"lora_slots": (i64, (rows,))} if with_lora else {}
        layout = Packed({"input_ids": (i64, (rows,)), "positions": (i64, (rows,)),
                         "slot_mapping": (i64, (*groups, rows)), "seq_lens": (i32, (rows,)),
                         "block_tables": (i32, (*groups, rows, width)), **lora})
        self._device_bytes = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        self._host_bytes = host_buffer(layout.nbytes, device)
        self._host = layout.arrays(self._host_bytes.numpy())
        views = layout.views(self._device_bytes)
        self.input_ids, self.positions, self.seq_lens = views["input_ids"], views["positions"], views["seq_lens"]
        self.lora_slots: torch.Tensor | None = views.get("lora_slots")
        self.num_groups = num_groups
        # per group (block_tables (rows, width), slot_mapping (rows,)); the fields are group 0's
        self._groups = (list(zip(views["block_tables"].unbind(), views["slot_mapping"].unbind(), strict=True))
                        if groups else [(views["block_tables"], views["slot_mapping"])])
        self.block_tables, self.slot_mapping = self._groups[0]
        self._pad(0, rows)
        self._device_bytes.copy_(self._host_bytes)
        self.query_start_loc = torch.arange(rows + 1, dtype=i32, device=device)  # one token per row
        self.logits_indices = torch.arange(rows, dtype=i64, device=device)
        self.max_seq_len = config.max_seq_len
        self._views: dict[int, ForwardBatch] = {}
        self._prefixes: dict[int, ForwardBatch] = {}
        self._num_dirty = 0  # rows [num_dirty, rows) hold padding
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def view(self, bucket: int) -> ForwardBatch:
        """The first `bucket` rows as a ForwardBatch (built once per bucket)."""
        if bucket not in self._views:
            self._views[bucket] = self._rows(bucket)
        return self._views[bucket]

    def _rows(self, n: int) -> ForwardBatch:
        """The first `n` rows as a ForwardBatch of views."""
        groups = tuple((tables[:n], slots[:n]) for tables, slots in self._groups) if self.num_groups > 1 else ()
        return ForwardBatch(
            self.input_ids[:n], self.positions[:n], self.query_start_loc[: n + 1], self.seq_lens[:n],
            self.block_tables[:n], self.slot_mapping[:n], self.logits_indices[:n], max_query_len=1,
            max_seq_len=self.max_seq_len, group_tables=groups,
            lora_slots=None if self.lora_slots is None else self.lora_slots[:n],
        )

    def holds(self, batch: ForwardBatch) -> bool:
        """Whether `batch` is a view of these buffers (from `write` or `view`)."""
        return batch.input_ids.data_ptr() == self.input_ids.data_ptr()

    def write(self, token_ids: list[list[int]], num_computed: list[int], block_ids: list[list[int]],
              block_size: int, bucket: int, lora_slots: list[int] | None = None) -> ForwardBatch:
        """A pure-decode step (one new token per request) written into rows [0, n), with rows
        [n, bucket) padding, in one host->device copy; the batch of its n rows, a view of the buffers.
        `lora_slots[b]`: request b's adapter slot (None: no adapters; needs `with_lora` otherwise)."""
        n, lens = len(token_ids), [len(b) // self.num_groups for b in block_ids]
        if not n <= bucket <= self.input_ids.shape[0] or max(lens, default=0) > self.block_tables.shape[1]:
            raise ValueError(f"a batch of {n} requests x {max(lens, default=0)} blocks does not fit bucket "
                             f"{bucket} ({list(self.block_tables.shape)} static block table)")
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host buffer
        host = self._host
        host["input_ids"][:n] = [t[0] for t in token_ids]
        host["positions"][:n] = num_computed
        host["seq_lens"][:n] = [p + 1 for p in num_computed]
        if self.lora_slots is not None:
            host["lora_slots"][:n] = -1 if lora_slots is None else lora_slots
        elif lora_slots is not None:
            raise ValueError("LoRA slots for static buffers built without them (with_lora=False)")
        if self.num_groups == 1:
            host["slot_mapping"][:n] = [blocks[p // block_size] * block_size + p % block_size
                                        for p, blocks in zip(num_computed, block_ids, strict=True)]
            write_block_tables(host["block_tables"], block_ids, lens)
        else:
            write_group_tables(host["block_tables"], host["slot_mapping"][:, :n], block_ids, lens, np.ones(n, int),
                               host["positions"][:n], block_size)
        self._pad(n, bucket)
        self._device_bytes.copy_(self._host_bytes, non_blocking=True)  # the one copy
        if self._copied is not None:
            self._copied.record()
        self._num_dirty = self.input_ids.shape[0]  # rows past the bucket hold whatever the host had
        if n not in self._prefixes:
            self._prefixes[n] = self._rows(n)
        return self._prefixes[n]

    def _pad(self, start: int, stop: int) -> None:
        host = self._host
        host["input_ids"][start:stop] = 0
        host["positions"][start:stop] = 0
        host["seq_lens"][start:stop] = 1
        host["slot_mapping"][..., start:stop] = -1
        host["block_tables"][..., start:stop, :] = 0
        if self.lora_slots is not None:
            host["lora_slots"][start:stop] = -1

    def fill(self, batch: ForwardBatch, bucket: int) -> None:
        """Copy a pure-decode batch into rows [0, n) and make rows [n, bucket) padding again."""
        n, width = batch.num_requests, batch.block_tables.shape[1]
        if not n <= bucket <= self.input_ids.shape[0] or width > self.block_tables.shape[1]:
            raise ValueError(f"a batch of {n} requests x {width} blocks does not fit bucket {bucket} "
                             f"({list(self.block_tables.shape)} static block table)")
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        if self.lora_slots is not None:
            if batch.lora_slots is None:
                self.lora_slots[:n].fill_(-1)
            else:
                self.lora_slots[:n].copy_(batch.lora_slots, non_blocking=True)
        elif batch.lora_slots is not None:
            raise ValueError("a batch with LoRA slots for static buffers built without them (with_lora=False)")
        for (tables, slots), (new_tables, new_slots) in zip(
                self._groups, batch.group_tables or [(batch.block_tables, batch.slot_mapping)], strict=True):
            slots[:n].copy_(new_slots, non_blocking=True)
            tables[:n, :width].copy_(new_tables, non_blocking=True)
            tables[:n, width:].zero_()  # entries of earlier, longer requests
        stale = min(self._num_dirty, bucket)
        if stale > n:  # rows a larger earlier batch filled: back to padding
            self.input_ids[n:stale].zero_()
            self.positions[n:stale].zero_()
            self.seq_lens[n:stale].fill_(1)
            if self.lora_slots is not None:
                self.lora_slots[n:stale].fill_(-1)
            for tables, slots in self._groups:
                slots[n:stale].fill_(-1)
                tables[n:stale].zero_()
        self._num_dirty = self._num_dirty if self._num_dirty > bucket else n


class CudaGraphRunner:
    """`forward(batch, kv_caches)` like Model's: a graph replay for pure-decode batches that fit a
    bucket (on the KV caches it was captured with), eager otherwise."""

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], config: GraphConfig) -> None:
        blockers = capture_blockers(model.graph)
        if blockers:
            raise ValueError(
                f"cannot capture CUDA graphs: {len(blockers)} node(s) run on torch references that sync "
                f"with the host ({', '.join(blockers[:3])}{', ...' if len(blockers) > 3 else ''}); "
                "rebuild the artifact with select_kernels (target cuda) or run with enforce_eager"
            )
        self.model, self.kv_caches, self.config = model, kv_caches, config
        device = torch.device(model.device)
        num_groups = len(kv_windows(model))
        # a model with adapter slots captures its LoRA kernels, reading each row's slot from the static buffer
        self.with_lora = getattr(model, "lora", None) is not None
        self.static = StaticBatch(config, device, num_groups, self.with_lora)
        self.builder = BatchBuilder(device, num_groups)
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> (CUDAGraph, its logits)
        self._capture(device)

    def bucket(self, batch: ForwardBatch) -> int | None:
        """The bucket a batch replays in, None if it runs eager."""
        if not is_pure_decode(batch) or batch.max_seq_len > self.config.max_seq_len:
            return None
        if batch.block_tables.shape[1] > self.config.max_blocks_per_request:
            return None
        return bucket_for(self.config.batch_sizes, batch.num_requests)

    def build(self, token_ids: list[list[int]], num_computed: list[int], block_ids: list[list[int]],
              block_size: int, logits_per_request: list[int] | None = None,
              lora_slots: list[int] | None = None) -> ForwardBatch:
        """BatchBuilder.build's batch; a pure-decode step that fits a bucket is written straight into the
        static buffers (one host->device copy) and `forward` replays it as it is. `lora_slots` as BatchBuilder's
        (a runner `with_lora` only)."""
        n, config = len(token_ids), self.config
        bucket = bucket_for(config.batch_sizes, n)
        if (bucket is not None and block_size == config.block_size and all(len(t) == 1 for t in token_ids)
                and (logits_per_request is None or all(k == 1 for k in logits_per_request))
                and max(num_computed) < config.max_seq_len
                and max(len(b) for b in block_ids) // self.static.num_groups <= config.max_blocks_per_request):
            return self.static.write(token_ids, num_computed, block_ids, block_size, bucket, lora_slots)
        return self.builder.build(token_ids, num_computed, block_ids, block_size, logits_per_request,
                                  lora_slots=lora_slots)

    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """float32 logits (num_requests, vocab) for a pure-decode batch; Model.forward's otherwise."""
        if kv_caches is self.kv_caches and self.static.holds(batch):  # from `build`: already in place
            graph, logits = self._graphs[bucket_for(self.config.batch_sizes, batch.num_requests)]
            graph.replay()
            return logits[: batch.num_requests]
        bucket = self.bucket(batch)
        if bucket is None or kv_caches is not self.kv_caches or (batch.lora_slots is not None and not self.with_lora):
            return self.model.forward(batch, kv_caches)
        self.static.fill(batch, bucket)
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits[: batch.num_requests]

    def _capture(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a cuda device; the model is on {device} (run eager)")
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.config.batch_sizes):  # largest first: the pool grows once
            batch = self.static.view(bucket)  # all padding rows: warm-up writes no KV
            for _ in range(NUM_WARMUP_RUNS):  # compile and autotune the Triton kernels outside capture
                self.model.forward(batch, self.kv_caches)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.model.forward(batch, self.kv_caches)
            except RuntimeError as e:
                raise RuntimeError(f"CUDA graph capture of the decode bucket {bucket} failed ({e}); "
                                   "run with enforce_eager (--eager)") from e
            self._graphs[bucket] = (graph, logits)
        torch.cuda.synchronize(device)


def make_runner(model: Any, kv_caches: list[torch.Tensor], *, enforce_eager: bool,
                batch_sizes: Sequence[int] | None, max_num_seqs: int, max_seq_len: int,
                block_size: int) -> CudaGraphRunner | None:
    """A model runner's graph runner, or None (eager): on the CPU, with enforce_eager, with no usable
    bucket, or (with a warning) when the graph has nodes no capture can hold."""
    if enforce_eager or torch.device(model.device).type != "cuda":
        return None
    sizes = plan_batch_sizes(batch_sizes, max_num_seqs)
    blockers = capture_blockers(model.graph)
    if blockers:
        warnings.warn(f"CUDA graphs off: {len(blockers)} KV node(s) run on torch references that sync with "
                      f"the host (e.g. {blockers[0]}); rebuild with select_kernels to enable them", stacklevel=2)
    if blockers or not sizes:
        return None
    return CudaGraphRunner(model, kv_caches, GraphConfig(sizes, max_seq_len, block_size))
