"""ModelRunner: one model on one device with its KV caches; runs one scheduled step and returns the
tokens it sampled.

It owns what touches tensors: the per-layer KV caches (allocated from the model's KV spec), the
CUDA-graph runner (decode steps replay a captured graph; None on the CPU or with `enforce_eager`),
the batch builder (one host->device copy per eager step), the block copies the scheduler asks for,
sampling, speculative verification and logprobs. `execute(out)` is the one call per step: scheduler
output in, `RunnerOutput` (the tokens each finished-prefill request emits, with their logprobs) out.
`forward` is the lower-level call a draft proposer drives its own runner with. The engine keeps
scheduling and output processing (appending tokens, stops, detokenization); the runner never
changes a request's tokens or its computed count. With tensor parallelism (runtime/distributed.py)
every rank has a runner over its shard: rank 0's sends each forward's arguments (and block copies)
to the others before running it, the others run what they receive; all end with the whole logits.

Rows. A request gets one logits row per step (its last scheduled token), or one per new prompt
token while it asks for prompt logprobs (runtime/logprobs.py), plus one per draft token: a request
with k drafts is verified on its last k + 1 rows. A request whose drafts are a tree (the speculator's
`tree_parents`) has one row per node in node order; after verification the runner moves its accepted
path's K/V to consecutive slots and hands the path's features to the speculator (runtime/speculative.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from optc.core.errors import UserError
from optc.runtime import logits_processors, logprobs
from optc.runtime.batch import BatchBuilder
from optc.runtime.cuda_graphs import make_runner
from optc.runtime.grammar import Masks
from optc.runtime.model import kv_windows
from optc.runtime.pipeline import Pipeline
from optc.runtime.rank_stats import RankStats
from optc.runtime.sampler import Logprobs, compute_logprobs, sample
from optc.runtime.scheduler import SchedulerOutput


@dataclass
class RunnerOutput:
    """What one step produced, by index into the scheduler output's requests."""

    ready: list[int] = field(default_factory=list)  # requests whose computed count reaches their token count
    token_ids: dict[int, list[int]] = field(default_factory=dict)  # ready requests that generate, in batch order
    logprobs: dict[int, list[Logprobs]] = field(default_factory=dict)  # per emitted token, for requests that ask


class ModelRunner:
    def __init__(
        self, model: Any, config: Any, num_blocks: int, max_model_len: int, speculator: Any = None,
        max_num_requests: int | None = None, group: Any = None, stage_group: Any = None,
    ) -> None:
        """`config`: an EngineConfig; `max_num_requests`: the most requests a decode step of this runner
        holds (the engine's max_num_seqs by default; a draft's the speculation cut-off); `group`: rank
        0's TensorParallelGroup, which every forward is sent through first; `stage_group`: any rank's
        group when `model` is a pipeline stage (runtime/pipeline.py runs its forwards)."""
        self.model = model
        self.group = group
        if stage_group is not None and speculator is not None and speculator.needs_features:
            raise UserError("EAGLE speculation reads the last layer's features on rank 0: pipeline parallelism "
                            "does not run it (use ngram or draft speculation)")
        self.device = torch.device(model.device)
        self.block_size = config.block_size
        self.kv_caches = model.allocate_kv_caches(num_blocks, config.block_size)
        # the pool's tensors, once each (KV-cache groups share them): what a block copy copies
        self._pool_caches = list({id(c): c for c in self.kv_caches if c is not None}.values())
        # a speculator that drafts from the target's features (EAGLE) reads them from every step: eager steps
        self._with_features = speculator is not None and speculator.needs_features
        self._features: torch.Tensor | None = None
        self.graph_runner = make_runner(  # None on the CPU, with enforce_eager or without a plan: eager steps
            model, self.kv_caches, enforce_eager=config.enforce_eager or self._with_features or stage_group is not None,
            batch_sizes=config.cuda_graph_batch_sizes,
            max_num_seqs=max_num_requests or config.max_num_seqs, max_seq_len=max_model_len,
            block_size=config.block_size)
        self.batch_builder = BatchBuilder(self.device, len(kv_windows(model)))
        self.pipeline = (Pipeline(stage_group, model, self.batch_builder, config.block_size,
                                  config.pipeline_micro_batch_tokens)
                         if stage_group is not None else None)
        self.speculator = speculator
        if speculator is not None:  # draft trees: a mask every attention takes, one rank, eager steps
            speculator.allow_trees(getattr(model, "takes_tree_mask", False) and group is None
                                   and self.graph_runner is None)
        self.num_blocks = num_blocks
        self.num_forwards = 0  # what tensor-parallel ranks compare: each runs every forward of rank 0
        self.eos_token_ids = tuple(model.eos_token_ids)  # banned by min_tokens
        self._masks: Masks | None = None  # structured outputs' bitmask worker, from the first constrained step

    @property
    def cuda_graph_batch_sizes(self) -> tuple[int, ...] | None:
        return self.graph_runner.config.batch_sizes if self.graph_runner is not None else None

    def forward(
        self, token_ids: list[list[int]], starts: list[int], block_ids: list[list[int]],
        num_rows: list[int] | None = None, block_copies: Sequence[tuple[int, int]] = (),
        tree_parents: list[list[int] | None] | None = None, lora_slots: list[int] | None = None,
        on_built: Callable[[], object] | None = None,
    ) -> torch.Tensor:
        """float32 logits (sum(num_rows), V): request b's new `token_ids[b]` from position `starts[b]`,
        its last `num_rows[b]` (default 1) rows, after the block copies. A pure-decode step that fits a
        bucket replays a graph, built straight into the graph's buffers; the logits are valid until the
        next step. `tree_parents[b]`: request b's drafts are a tree (ForwardBatch's; one rank, eager only).
        `lora_slots[b]`: request b's LoRA adapter slot, -1 for none (one rank). `on_built` runs
        once the batch is built, just before the model: work started there on another thread (the grammar's
        masks) runs while the model's kernels have dropped the GIL, not while this thread builds the batch."""
        if self.group is None:
            return self._forward(token_ids, starts, block_ids, num_rows, block_copies, tree_parents, lora_slots,
                                 on_built)
        with self.group.guard():  # a dead or hung rank: a TensorParallelError naming it
            self.group.send_step(block_copies, token_ids, starts, block_ids, num_rows)
            return self._forward(token_ids, starts, block_ids, num_rows, block_copies, on_built=on_built)

    def _forward(self, token_ids, starts, block_ids, num_rows, block_copies, tree_parents=None,
                 lora_slots=None, on_built=None) -> torch.Tensor:
        self.num_forwards += 1
        self.copy_blocks(block_copies)
        if self.pipeline is not None:  # rank 0 gets the logits, every other rank None
            return self.pipeline.forward(token_ids, starts, block_ids, num_rows or [1] * len(token_ids),
                                         self.kv_caches)
        with_lora = lora_slots is not None and any(s >= 0 for s in lora_slots)
        # eager where a captured graph cannot hold the step: draft trees, LoRA deltas where none were captured
        runner = self.graph_runner
        if tree_parents is not None or (with_lora and runner is not None and not runner.with_lora):
            runner = None
        if runner is None:
            batch = self.batch_builder.build(token_ids, starts, block_ids, self.block_size, num_rows, tree_parents,
                                             lora_slots if with_lora else None)
        else:
            batch = runner.build(token_ids, starts, block_ids, self.block_size, num_rows,
                                 lora_slots if with_lora else None)
        if on_built is not None:
            on_built()
        if self._with_features:
            logits, self._features = self.model.forward(batch, self.kv_caches, with_features=True)
            return logits
        return (runner or self.model).forward(batch, self.kv_caches)

    def rank_stats(self) -> list[RankStats]:
        """Every tensor-parallel rank's counters (forwards run, KV pool size), asked over the control
        group; one entry with one rank."""
        if self.group is None:
            return [RankStats(0, self.num_forwards, self.num_blocks)]
        return self.group.rank_stats(self.num_forwards, self.num_blocks)

    def _move_tree_paths(self, requests: list, starts: list[int], block_ids: list[list[int]]) -> None:
        """Move each verified tree's accepted path to the slots after its root, so that its cache holds what
        plain decoding writes: node j's K/V sit at position start + 1 + j, a path node at depth d belongs at
        start + d. Moves go to lower slots, gathered before they are written."""
        sources, destinations = [], []
        for request, start, blocks in zip(requests, starts, block_ids, strict=True):
            path = self.speculator.accepted_path(request)
            for depth, j in enumerate(path or (), start=1):
                if j + 1 != depth:
                    for pos, slots in ((start + 1 + j, sources), (start + depth, destinations)):
                        slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
        if not sources:
            return
        src, dst = torch.tensor(sources, device=self.device), torch.tensor(destinations, device=self.device)
        for cache in self._pool_caches:
            cache.copy_slots(src, dst)

    def _shape(self, logits: torch.Tensor, requests: list, histories: list[list[list[int]]],
               bitmasks: list[torch.Tensor | None]) -> torch.Tensor:
        """A shaped copy of the rows of `requests` (each request's rows one after another, following its
        `histories`: runtime/logits_processors.py); a request without a grammar gets all-allowed masks."""
        rows = [logits_processors.RowTokens(r, d) for r, h in zip(requests, histories, strict=True) for d in h]
        bitmask = None
        if any(m is not None for m in bitmasks):
            width = next(m for m in bitmasks if m is not None).shape[1]
            bitmask = torch.cat([m if m is not None else torch.full((len(h), width), -1, dtype=torch.int32)
                                 for m, h in zip(bitmasks, histories, strict=True)])
        return logits_processors.shape(logits, rows, self.eos_token_ids, bitmask)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        for source, destination in copies:
            for cache in self._pool_caches:
                cache.copy_block(source, destination)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run the scheduled step: copy blocks, forward, record prompt logprobs, then sample (or verify
        the drafts of) every request that reaches its last token."""
        requests = out.requests
        starts = [r.num_computed_tokens for r in requests]
        num_drafts = [len(r.draft_token_ids) for r in requests]
        # drafts run only in decode (one row for logprobs): one more logits row per draft token
        num_rows = [logprobs.num_logits_rows(r, s, n - d) + d
                    for r, s, n, d in zip(requests, starts, out.num_new_tokens, num_drafts, strict=True)]
        token_ids = [r.query_token_ids(n) for r, n in zip(requests, out.num_new_tokens, strict=True)]
        trees = None
        if self.speculator is not None and self.speculator.use_tree:
            trees = [self.speculator.tree_parents(r) for r in requests]
            trees = trees if any(t is not None for t in trees) else None
        ends = [s + n for s, n in zip(starts, out.num_new_tokens, strict=True)]
        result = RunnerOutput(ready=[b for b, r in enumerate(requests) if ends[b] >= r.num_tokens])
        ready = [b for b in result.ready if requests[b].params.max_tokens > 0]  # max_tokens 0: scored only
        shaped = {b: logits_processors.row_histories(requests[b], trees[b] if trees else None)
                  for b in ready if requests[b].params.shapes_logits}
        constrained = [b for b in shaped if requests[b].matcher is not None]
        masks: list[Future] = []  # the grammar's masks: started once the batch is built (grammar.Masks)
        if constrained:
            self._masks = self._masks or Masks(beside=self.device.type != "cpu"
                                               or torch.get_num_threads() < len(os.sched_getaffinity(0)))

        def start_masks() -> None:
            masks.append(self._masks.start([(requests[b].matcher, shaped[b]) for b in constrained]))
        lora_slots = [r.lora_slot for r in requests]
        logits = self.forward(token_ids, starts, out.block_ids, num_rows, out.block_copies, trees,
                              lora_slots if any(s >= 0 for s in lora_slots) else None,
                              start_masks if constrained else None)  # (sum(num_rows), V)
        last_rows = logprobs.record_prompt_logprobs(requests, starts, num_rows, logits)
        bitmasks = (_split(masks[0].result(), [len(shaped[b]) for b in constrained], constrained)
                    if constrained else {})
        plain = [b for b in ready if num_drafts[b] == 0]
        spec = [b for b in ready if num_drafts[b] > 0]
        first_rows = {b: last_rows[b] - num_drafts[b] for b in ready}  # the row of each request's first new token
        new_tokens: dict[int, list[int]] = {}
        if plain:
            rows = [last_rows[b] for b in plain]
            selected = logits if rows == list(range(logits.shape[0])) else logits[rows]  # no gather: no index copy
            if any(b in shaped for b in plain):
                selected = self._shape(selected, [requests[b] for b in plain], [[[]] for _ in plain],
                                       [bitmasks.get(b) for b in plain])
            sampled = sample(selected, [requests[b].params for b in plain], [requests[b].generator for b in plain])
            new_tokens.update((b, [t]) for b, t in zip(plain, sampled.tolist(), strict=True))
        if spec:
            rows = [logits[first_rows[b] : last_rows[b] + 1] for b in spec]
            rows = [self._shape(x, [requests[b]], [shaped[b]], [bitmasks.get(b)]) if b in shaped else x
                    for b, x in zip(spec, rows, strict=True)]
            verified = self.speculator.verify([requests[b] for b in spec], rows)
            new_tokens.update(zip(spec, verified, strict=True))
            if trees is not None:
                self._move_tree_paths([requests[b] for b in spec], [starts[b] for b in spec],
                                      [out.block_ids[b] for b in spec])
        if self._with_features:  # every computed token's feature (a tree's: its accepted path's)
            self.speculator.observe(requests, starts, out.num_new_tokens, self._features)
            self._features = None
        result.token_ids = {b: new_tokens[b] for b in ready}  # in batch order, as the engine processes them
        for b in ready:
            num_top = requests[b].params.logprobs
            if num_top is not None:
                path = self.speculator.accepted_path(requests[b]) if trees is not None else None
                rows = (logits[first_rows[b] : first_rows[b] + len(result.token_ids[b])] if path is None
                        else logits[[first_rows[b], *(first_rows[b] + 1 + j for j in path)]])  # a tree: its path's
                result.logprobs[b] = compute_logprobs(rows, torch.tensor(result.token_ids[b]), num_top)
        return result


def _split(bitmask: torch.Tensor, num_rows: list[int], keys: list[int]) -> dict[int, torch.Tensor]:
    """Rows of a stacked bitmask, by request: `num_rows[i]` rows for keys[i], in order."""
    return dict(zip(keys, bitmask.split(num_rows), strict=True))
