"""ForwardBatch: everything one model step needs, flattened over the scheduled requests.

The batch is plain data built by the model runner each step; the model reads it and nothing else (there is
no global forward context). It does not own the KV cache; the caller passes the per-layer caches.

Conventions (T = scheduled tokens in this step, B = requests in this step):
- tokens of request b are `input_ids[query_start_loc[b]:query_start_loc[b + 1]]`;
- `seq_lens[b]` counts every token of request b whose K/V exist after this step (context + new), so
  request b's new tokens sit at positions `seq_lens[b] - query_len_b ... seq_lens[b] - 1`;
- slot = block_id * block_size + offset; block 0 is the reserved null block, so block tables are
  padded with 0 and a slot of -1 means "do not store" (padding tokens of a CUDA-graph bucket);
- `logits_indices` selects the flattened token rows whose logits are returned (the last token of
  each request for plain decoding; several per request for speculative verification);
- a draft tree (`tree_parents[b]`: request b's new tokens are its last token, the root, then the nodes, each
  after its parent) keeps its slots consecutive (node j's K/V at the slot of position start + 1 + j) but
  rotates each row at start + its depth, and `tree_mask[t]` gives row t's visible rows of its request as
  bits (its ancestors and itself); the other requests of at most MAX_SPECULATIVE_TOKENS + 1 rows (decode
  rows, chains) get causal bits, longer ones (prefill chunks) none, which the attention op reads as causal and
  computes as a plain step would. Only one KV-cache group takes trees;
- a model with several KV-cache groups (sliding-window layers: optc/core/kv_cache.py) has one block
  table and one slot mapping per group (`group_tables`, `block_tables`/`slot_mapping` being group
  0's); request b's `block_ids[b]` then holds its groups' lists one after the other, all of one
  length (runtime/kv_cache_manager.py). A node reads its group's (`kv_group` attr, set at load).

`BatchBuilder` builds a step's batch on the model's device with one host->device copy: every array
is written into one (pinned, on CUDA) host buffer at 8-byte-aligned offsets (`Packed`), the used
bytes are copied in one transfer, and the batch's tensors are views of the device copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain

import numpy as np
import torch

from optc.core.settings import MAX_SPECULATIVE_TOKENS


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    query_start_loc: torch.Tensor  # (B + 1,) int32, cumulative query lengths
    seq_lens: torch.Tensor  # (B,) int32, context + new tokens per request
    block_tables: torch.Tensor  # (B, max_blocks_per_request) int32, padded with 0
    slot_mapping: torch.Tensor  # (T,) int64, -1 = do not store
    logits_indices: torch.Tensor  # (L,) int64, rows of the flattened tokens to return logits for
    max_query_len: int
    max_seq_len: int
    # per KV-cache group: (block_tables, slot_mapping) as above; () with one group (the fields above)
    group_tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    # (T,) int64 when some request's rows are a draft tree (the attention op's tree_mask); None: causal
    tree_mask: torch.Tensor | None = None
    # (T,) int64 LoRA adapter slot of each row (-1: none) when some request has an adapter; None: none has
    lora_slots: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens.shape[0])

    def to(self, device: torch.device | str) -> ForwardBatch:
        move = lambda t: t.to(device, non_blocking=True)
        return ForwardBatch(
            move(self.input_ids),
            move(self.positions),
            move(self.query_start_loc),
            move(self.seq_lens),
            move(self.block_tables),
            move(self.slot_mapping),
            move(self.logits_indices),
            self.max_query_len,
            self.max_seq_len,
            tuple((move(tables), move(slots)) for tables, slots in self.group_tables),
            None if self.tree_mask is None else move(self.tree_mask),
            None if self.lora_slots is None else move(self.lora_slots),
        )

    @staticmethod
    def build(
        token_ids: list[list[int]],
        num_computed: list[int],
        block_ids: list[list[int]],
        block_size: int,
        logits_per_request: list[int] | None = None,
        num_groups: int = 1,
        tree_parents: list[list[int] | None] | None = None,
        lora_slots: list[int] | None = None,
    ) -> ForwardBatch:
        """Build a batch (on the CPU) from per-request new tokens, their start positions and block lists.

        `token_ids[b]` are the new tokens of request b, starting at position `num_computed[b]`;
        `block_ids[b]` cover at least `num_computed[b] + len(token_ids[b])` tokens (in each of
        `num_groups` KV-cache groups, one group's list after the other);
        `logits_per_request[b]` (default 1) trailing tokens of request b get logits;
        `lora_slots[b]`: request b's LoRA adapter slot (-1: none).
        """
        return BatchBuilder("cpu", num_groups).build(token_ids, num_computed, block_ids, block_size,
                                                     logits_per_request, tree_parents, lora_slots)


@lru_cache(maxsize=256)
def batch_layout(num_tokens: int, num_logits: int, num_requests: int, width: int, num_groups: int = 1,
                 with_tree: bool = False, with_lora: bool = False) -> Packed:
    """The packed layout of a ForwardBatch's arrays (decode steps repeat a few shapes: cached); with
    several KV-cache groups, a block table and a slot mapping per group; with draft trees, their mask; with
    LoRA adapters, each row's slot."""
    i32, i64 = torch.int32, torch.int64
    groups = (num_groups,) if num_groups > 1 else ()
    tree = {"tree_mask": (i64, (num_tokens,))} if with_tree else {}
    lora = {"lora_slots": (i64, (num_tokens,))} if with_lora else {}
    return Packed({**tree, **lora, "input_ids": (i64, (num_tokens,)), "positions": (i64, (num_tokens,)),
                   "slot_mapping": (i64, (*groups, num_tokens)), "logits_indices": (i64, (num_logits,)),
                   "query_start_loc": (i32, (num_requests + 1,)), "seq_lens": (i32, (num_requests,)),
                   "block_tables": (i32, (*groups, num_requests, width))})


class Packed:
    """Named arrays laid out in one byte buffer, so one copy moves them all and each is a view of the
    buffer on either side of the copy: on the host as numpy arrays (`arrays`, written without torch
    ops), on the device as tensors (`views`). Arrays of one dtype share a region that starts at an
    8-byte-aligned offset, so each side needs one dtype view per region and a slice per array."""

    def __init__(self, fields: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self.regions: dict[torch.dtype, tuple[int, int, list[tuple[str, int, int, tuple[int, ...]]]]] = {}
        members: dict[torch.dtype, list] = {}
        for name, (dtype, shape) in fields.items():
            items = members.setdefault(dtype, [])
            start = items[-1][1] + items[-1][2] if items else 0
            items.append((name, start, math.prod(shape), shape))
        offset = 0
        for dtype, items in members.items():
            count = items[-1][1] + items[-1][2]
            self.regions[dtype] = (offset, count, items)
            offset += -(-count * dtype.itemsize // 8) * 8
        self.nbytes = offset

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each array as a tensor view of `buffer` (uint8, at least `nbytes`)."""
        out = {}
        for dtype, (offset, count, items) in self.regions.items():
            region = buffer[offset: offset + count * dtype.itemsize].view(dtype)
            for name, start, size, shape in items:
                view = region[start: start + size]
                out[name] = view.view(shape) if len(shape) > 1 else view
        return out

    def arrays(self, buffer: np.ndarray) -> dict[str, np.ndarray]:
        """Each array as a numpy view of `buffer` (uint8, at least `nbytes`)."""
        out = {}
        for dtype, (offset, count, items) in self.regions.items():
            region = buffer[offset: offset + count * dtype.itemsize].view(NUMPY[dtype])
            for name, start, size, shape in items:
                out[name] = region[start: start + size].reshape(shape)
        return out


NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 host buffer; pinned when `device` is a GPU, so a non-blocking copy from it is a real DMA."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


class BatchBuilder:
    """Builds ForwardBatches on `device` with one host->device copy per batch.

    The arrays are written into one host buffer (pinned on CUDA), reused from step to step and grown
    when a batch needs more, copied in one transfer, and the batch's tensors are views of the copy.
    Before the buffer is rewritten, the event recorded after the previous copy is waited on, which
    costs nothing once the runner has read that step's sampled tokens. On the CPU the same path runs
    (the copy is a memcpy of a few KB), so the CPU tests cover it."""

    def __init__(self, device: torch.device | str, num_groups: int = 1) -> None:
        self.device = torch.device(device)
        self.num_groups = num_groups  # KV-cache groups of the model: a block table and slot mapping each
        self._host = host_buffer(4096, self.device)
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None

    def build(
        self,
        token_ids: list[list[int]],
        num_computed: list[int],
        block_ids: list[list[int]],
        block_size: int,
        logits_per_request: list[int] | None = None,
        tree_parents: list[list[int] | None] | None = None,
        lora_slots: list[int] | None = None,
    ) -> ForwardBatch:
        """ForwardBatch.build's batch, on this builder's device."""
        num_requests, num_groups = len(token_ids), self.num_groups
        logits_per_request = logits_per_request or [1] * num_requests
        with_tree = tree_parents is not None and any(p is not None for p in tree_parents)
        if with_tree and num_groups > 1:
            raise ValueError("draft trees take one KV-cache group")
        positions, slots, logits_indices, starts, seq_lens, masks = [], [], [], [0], [], []
        for b in range(num_requests):
            n, start, blocks = len(token_ids[b]), num_computed[b], block_ids[b]
            pos = range(start, start + n)
            parents = tree_parents[b] if with_tree else None
            if parents is None:
                positions.extend(pos)
                if with_tree:
                    # causal bits (rows 0..i) where a plain step runs the decode row's attention, else none
                    masks.extend((2 << i) - 1 if n <= MAX_SPECULATIVE_TOKENS + 1 else 0 for i in range(n))
            else:
                depths, bits = tree_rows(parents[: n - 1])
                positions.extend(start + d for d in depths)
                masks.extend(bits)
            if num_groups == 1:  # with groups, the slots are computed from the tables below
                slots.extend(blocks[p // block_size] * block_size + p % block_size for p in pos)
            end = starts[-1] + n
            logits_indices.extend(range(end - logits_per_request[b], end))
            starts.append(end)
            seq_lens.append(start + n)
        lens = [len(b) // num_groups for b in block_ids]
        width = max(lens, default=0) or 1
        max_query_len, max_seq_len = max(map(len, token_ids), default=0), max(seq_lens, default=0)
        with_lora = lora_slots is not None and any(s >= 0 for s in lora_slots)
        layout = batch_layout(starts[-1], len(logits_indices), num_requests, width, num_groups, with_tree, with_lora)
        if self._copied is not None:
            self._copied.synchronize()  # the previous batch's copy has left the host buffer
        if self._host.numel() < layout.nbytes:
            self._host = host_buffer(max(layout.nbytes, 2 * self._host.numel()), self.device)
        arrays = layout.arrays(self._host.numpy())
        arrays["input_ids"][:] = list(chain.from_iterable(token_ids))
        arrays["positions"][:] = positions
        if with_tree:
            arrays["tree_mask"][:] = np.array(masks, dtype=np.uint64).view(np.int64)  # bit 63 is a sign bit
        arrays["logits_indices"][:] = logits_indices
        if with_lora:
            arrays["lora_slots"][:] = np.repeat(lora_slots, np.diff(starts))
        arrays["query_start_loc"][:] = starts
        arrays["seq_lens"][:] = seq_lens
        if num_groups == 1:
            arrays["slot_mapping"][:] = slots
            write_block_tables(arrays["block_tables"], block_ids, lens)
        else:
            write_group_tables(arrays["block_tables"], arrays["slot_mapping"], block_ids, lens,
                               np.diff(starts), arrays["positions"], block_size)
        device_bytes = self._host[: layout.nbytes].to(self.device, non_blocking=True, copy=True)  # the one copy
        if self._copied is not None:
            self._copied.record()
        views = layout.views(device_bytes)
        if num_groups > 1:
            tables, slot_mappings = views["block_tables"].unbind(), views["slot_mapping"].unbind()
            views |= {"block_tables": tables[0], "slot_mapping": slot_mappings[0],
                      "group_tables": tuple(zip(tables, slot_mappings, strict=True))}
        return ForwardBatch(**views, max_query_len=max_query_len, max_seq_len=max_seq_len)


def tree_rows(parents: list[int]) -> tuple[list[int], list[int]]:
    """The depth (root 0) and visible-row bits (ancestors and itself) of a tree's rows: row 0 the root, row
    j + 1 node j below `parents[j]` (-1: the root), parents before children."""
    depths, bits = [0], [1]
    for j, parent in enumerate(parents):
        depths.append(depths[parent + 1] + 1)
        bits.append(bits[parent + 1] | 1 << (j + 1))
    return depths, bits


def write_group_tables(tables: np.ndarray, slot_mappings: np.ndarray, block_ids: list[list[int]], lens: list[int],
                       query_lens: np.ndarray, positions: np.ndarray, block_size: int) -> None:
    """Each KV-cache group's block table (tables[g]: (n, width)) from the requests' lists (group after
    group, `lens[b]` blocks each) and the slot of every new token in it (slot_mappings[g]: (T,))."""
    for g in range(tables.shape[0]):
        write_block_tables(tables[g], [ids[g * n: (g + 1) * n] for ids, n in zip(block_ids, lens, strict=True)], lens)
    request = np.repeat(np.arange(len(lens)), query_lens)  # (T,)
    slot_mappings[:] = tables[:, request, positions // block_size] * block_size + positions % block_size


def write_block_tables(table: np.ndarray, block_ids: list[list[int]], lens: list[int]) -> None:
    """Rows of `table` (n, width) = each request's block ids, padded with 0 (block 0 is the null block)."""
    n = len(block_ids)
    table[:n] = 0
    if n and sum(lens):
        mask = np.arange(table.shape[1])[None, :] < np.asarray(lens)[:, None]
        table[:n][mask] = np.fromiter(chain.from_iterable(block_ids), dtype=table.dtype, count=sum(lens))
