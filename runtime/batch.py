"""ForwardBatch: everything one model step needs, flattened over the scheduled requests.

The batch is plain data built by the engine each step; the model reads it and nothing else (there is
no global forward context). It does not own the KV cache; the caller passes the per-layer caches.

Conventions (T = scheduled tokens in this step, B = requests in this step):
- tokens of request b are `input_ids[query_start_loc[b]:query_start_loc[b + 1]]`;
- `seq_lens[b]` counts every token of request b whose K/V exist after this step (context + new), so
  request b's new tokens sit at positions `seq_lens[b] - query_len_b ... seq_lens[b] - 1`;
- slot = block_id * block_size + offset; block 0 is the reserved null block, so block tables are
  padded with 0 and a slot of -1 means "do not store" (padding tokens of a CUDA-graph bucket);
- `logits_indices` selects the flattened token rows whose logits are returned (the last token of
  each request for plain decoding; several per request for speculative verification).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        )

    @staticmethod
    def build(
        token_ids: list[list[int]],
        num_computed: list[int],
        block_ids: list[list[int]],
        block_size: int,
        logits_per_request: list[int] | None = None,
    ) -> ForwardBatch:
        """Build a batch from per-request new tokens, their start positions and block lists.

        `token_ids[b]` are the new tokens of request b, starting at position `num_computed[b]`;
        `block_ids[b]` cover at least `num_computed[b] + len(token_ids[b])` tokens;
        `logits_per_request[b]` (default 1) trailing tokens of request b get logits.
        """
        num_requests = len(token_ids)
        logits_per_request = logits_per_request or [1] * num_requests
        input_ids, positions, slots, logits_indices, starts, seq_lens = [], [], [], [], [0], []
        for b in range(num_requests):
            new, start, blocks = token_ids[b], num_computed[b], block_ids[b]
            pos = range(start, start + len(new))
            input_ids.extend(new)
            positions.extend(pos)
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in pos)
            end = starts[-1] + len(new)
            logits_indices.extend(range(end - logits_per_request[b], end))
            starts.append(end)
            seq_lens.append(start + len(new))
        width = max((len(b) for b in block_ids), default=0) or 1
        table = torch.tensor([blocks + [0] * (width - len(blocks)) for blocks in block_ids] or [[0]],
                             dtype=torch.int32)[:num_requests]  # one tensor, not one per row
        query_lens = [len(t) for t in token_ids]
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )
