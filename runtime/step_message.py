"""The message a step travels in from rank 0 to the other ranks (runtime/distributed.py): the block copies
and the forward's arguments (new token ids, start positions, block ids, logits rows per request) flattened
into one int64 tensor body, announced by a 4-number int64 header that gives the body's size. A header whose
first number (the request count) is STOP or QUERY comes without a body: the workers exit, or answer with
their RankStats. Only encoding here; the sending, receiving and waiting are distributed.py's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

STOP = -1  # a header's request count that tells workers to exit
QUERY = -2  # a header's request count that asks every rank for its RankStats
StepArgs = tuple[list[tuple[int, int]], list[list[int]], list[int], list[list[int]], list[int]]


def encode_step(block_copies: Sequence[tuple[int, int]], token_ids: list[list[int]], starts: list[int],
                block_ids: list[list[int]], num_rows: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step as (header, body) int64 tensors.

    header: [B requests, C copies, T tokens, K block ids];
    body: copies (2C) | starts (B) | logits rows (B) | tokens per request (B) | blocks per request (B) |
    tokens (T) | block ids (K)."""
    num_rows = num_rows or [1] * len(token_ids)
    flat: list[int] = [x for pair in block_copies for x in pair]
    flat += starts
    flat += num_rows
    flat += [len(t) for t in token_ids]
    flat += [len(b) for b in block_ids]
    for t in token_ids:
        flat += t
    for b in block_ids:
        flat += b
    num_tokens, num_blocks = sum(map(len, token_ids)), sum(map(len, block_ids))
    header = torch.tensor([len(token_ids), len(block_copies), num_tokens, num_blocks], dtype=torch.int64)
    return header, torch.tensor(flat, dtype=torch.int64)


def body_size(header: torch.Tensor) -> int:
    b, c, t, k = header.tolist()
    return 2 * c + 4 * b + t + k


def decode_step(header: torch.Tensor, body: torch.Tensor) -> StepArgs:
    """The inverse of encode_step."""
    b, c, _, _ = header.tolist()
    flat = body.tolist()
    copies = [(flat[2 * i], flat[2 * i + 1]) for i in range(c)]
    at = 2 * c
    starts, num_rows, token_lens, block_lens = (flat[at + i * b: at + (i + 1) * b] for i in range(4))
    at += 4 * b
    token_ids, block_ids = [], []
    for n in token_lens:
        token_ids.append(flat[at: at + n])
        at += n
    for n in block_lens:
        block_ids.append(flat[at: at + n])
        at += n
    return copies, token_ids, starts, block_ids, num_rows
