"""Pipeline parallelism: one rank's part of a step when the model is cut into P stages
(optc/core/ops/stages.py), each stage split over T tensor-parallel ranks (P x T ranks in all; rank r
is stage r // T, tensor-parallel rank r % T).

Every rank receives the whole step from rank 0 (runtime/distributed.py) and cuts it the same way
into micro-batches: consecutive requests, balanced by tokens, up to P of them and no more than the step's
tokens over `pipeline_micro_batch_tokens` (EngineConfig): a stage reads all its weights once per micro-batch,
so cutting a small step (a decode step of a few requests, bound by reading the weights) costs more
than the overlap gains (docs/PERF.md measures both sides). A stage runs its
layers on each micro-batch in turn and hands the values the next stage reads (the residual stream,
(T, hidden) per value) to the rank of the same tensor-parallel rank in the next stage, without
waiting for it to arrive; the next stage starts on micro-batch 1 while this one runs micro-batch 2.
The last stage's tensor-parallel rank 0 sends each micro-batch's logits to rank 0, which samples.
So within one step, stage 0 runs micro-batch 2 while stage 1 runs micro-batch 1 (P = 2); steps do not
overlap each other (rank 0 samples a step before it schedules the next).

Each stage holds its layers' KV caches only; the block tables are the same on every rank (rank 0's
KV manager assigns every block). The transfers run over a group of every rank on the device backend
(NCCL on CUDA, gloo on the CPU), each bounded by the collective timeout: a dead or hung stage fails
the step on rank 0 as a dead tensor-parallel rank does.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from optc.runtime.batch import BatchBuilder


class Pipeline:
    def __init__(self, group: Any, model: Any, batch_builder: BatchBuilder, block_size: int,
                 micro_batch_tokens: int) -> None:
        """`group`: this rank's TensorParallelGroup (runtime/distributed.py) with pipeline_size > 1;
        `model`: its stage's Model; `micro_batch_tokens`: the fewest tokens a micro-batch gets."""
        self.group, self.model, self.batch_builder, self.block_size = group, model, batch_builder, block_size
        t, stage, last = group.tensor_size, group.stage, group.pipeline_size - 1
        self.previous = (stage - 1) * t + group.tp_rank if stage > 0 else None
        self.next = (stage + 1) * t + group.tp_rank if stage < last else None
        self.last_rank = last * t  # the rank that sends rank 0 the logits
        self.num_micro_batches, self.micro_batch_tokens = group.pipeline_size, micro_batch_tokens
        self.timeout = datetime.timedelta(seconds=group.timeout_s)
        self.hidden_size = model.graph.config.hidden_size
        self.sends = model.graph.outputs

    def forward(self, token_ids: list[list[int]], starts: list[int], block_ids: list[list[int]],
                num_rows: list[int], kv_caches: list) -> torch.Tensor | None:
        """Run this stage over the step's micro-batches: rank 0 returns the step's float32 logits
        (sum(num_rows), V), every other rank None."""
        parts = micro_batches([len(t) for t in token_ids], self.num_micro_batches, self.micro_batch_tokens)
        sent: list[Any] = []
        for a, b in parts:
            batch = self.batch_builder.build(token_ids[a:b], starts[a:b], block_ids[a:b], self.block_size,
                                             num_rows[a:b])
            received = self._receive(batch.num_tokens) if self.previous is not None else {}
            out = self.model.run_stage(batch, kv_caches, received)
            if self.next is not None:
                sent.append(dist.isend(self._pack(out, batch.num_tokens), self.next, group=self.group.pipe_group))
            elif self.group.rank == self.last_rank:
                sent.append(dist.isend(out["logits"].float().contiguous(), 0, group=self.group.pipe_group))
        logits = self._receive_logits(parts, num_rows) if self.group.rank == 0 else None
        for work in sent:
            work.wait(self.timeout)
        return logits

    def _pack(self, out: dict[str, torch.Tensor], num_tokens: int) -> torch.Tensor:
        """The values this stage sends, side by side: (T, len(sends) * hidden)."""
        for name in self.sends:
            if tuple(out[name].shape) != (num_tokens, self.hidden_size):
                raise RuntimeError(f"pipeline stage {self.group.stage} sends {name} of shape {tuple(out[name].shape)}, "
                                   f"not (tokens, hidden) = ({num_tokens}, {self.hidden_size})")
        return torch.cat([out[name] for name in self.sends], dim=1).contiguous()

    def _receive(self, num_tokens: int) -> dict[str, torch.Tensor]:
        names = self.model.receives
        buffer = torch.empty((num_tokens, len(names) * self.hidden_size), dtype=self.model.dtype,
                             device=self.model.device)
        dist.irecv(buffer, self.previous, group=self.group.pipe_group).wait(self.timeout)
        return {name: x.contiguous() for name, x in zip(names, buffer.split(self.hidden_size, dim=1), strict=True)}

    def _receive_logits(self, parts: list[tuple[int, int]], num_rows: list[int]) -> torch.Tensor:
        """Rank 0: every micro-batch's logits from the last stage, in order."""
        rows = [sum(num_rows[a:b]) for a, b in parts]
        logits = torch.empty((sum(rows), self.model.vocab_size), dtype=torch.float32, device=self.model.device)
        works = [dist.irecv(chunk, self.last_rank, group=self.group.pipe_group)
                 for chunk in logits.split(rows)]
        for work in works:
            work.wait(self.timeout)
        return logits


def micro_batches(num_tokens: Sequence[int], most: int, min_tokens: int = 1) -> list[tuple[int, int]]:
    """Up to `most` runs [a, b) of consecutive requests, each non-empty, whose token counts are as even
    as cuts between requests make them (each cut at the request boundary nearest its share); no more runs
    than `min_tokens` go into the step's tokens (at least one)."""
    count = max(1, min(most, len(num_tokens), sum(num_tokens) // min_tokens))
    prefix = [0]
    for n in num_tokens:
        prefix.append(prefix[-1] + n)
    cuts = [0]
    for k in range(1, count):
        share = prefix[-1] * k / count
        lo, hi = cuts[-1] + 1, len(num_tokens) - (count - k)  # leave a request for each later run
        cuts.append(min(range(lo, hi + 1), key=lambda i: (abs(prefix[i] - share), i)))
    return list(zip(cuts, [*cuts[1:], len(num_tokens)], strict=True))
