"""Logits shaping before sampling and speculative verification: penalties, logit_bias, min_tokens and structured
outputs' grammar masks, as pure functions of a row's logits and the tokens before it.

A request whose SamplingParams `shapes_logits` gets its rows shaped (a copy: logprobs stay the model's own,
as OpenAI and vLLM report them); every other row passes untouched. For each row, in this order (the -inf
steps commute with the others):

    repetition (CTRL, HF, vLLM):  l[t] = l[t] / r if l[t] > 0 else l[t] * r     for t in prompt or output
    presence / frequency (OpenAI): l[t] -= presence * [count(t) > 0] + frequency * count(t)   over the output
    logit_bias:                    l[t] += bias[t]
    min_tokens:                    l[eos and stop_token_ids] = -inf   while the output is shorter than it
    grammar:                       l[t] = -inf   for every t the grammar's bitmask leaves out

"The output" of a speculative row includes the drafts before it (`RowTokens.drafts`), so that verification
scores each draft with the logits plain decoding would have sampled it from: greedy output is the same with
and without speculation. The grammar's bitmasks are filled by runtime/grammar.py's `Masks` beside the forward;
here they are only applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from optc.runtime.grammar import masked
from optc.runtime.request import Request


@dataclass(frozen=True)
class RowTokens:
    """The tokens a logits row follows: its request's, then `drafts` (a speculative row's drafts before it)."""

    request: Request
    drafts: Sequence[int] = ()


def row_histories(request: Request, tree_parents: Sequence[int] | None) -> list[list[int]]:
    """The drafts before each of a request's verification rows: a chain's `[], [d1], ..., [d1..dk]`; a tree's
    root `[]` and each node's path from the root (`tree_parents[j]`: node j's parent, -1 the root)."""
    drafts = request.draft_token_ids
    if tree_parents is None:
        return [list(drafts[:i]) for i in range(len(drafts) + 1)]
    paths: list[list[int]] = [[]]
    for j, parent in enumerate(tree_parents):
        paths.append(paths[parent + 1] + [drafts[j]])
    return paths


def shape(logits: torch.Tensor, rows: Sequence[RowTokens], eos_token_ids: Sequence[int],
          bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """Shaped copy of `logits` (R, V) float32, row i following rows[i]; `bitmask` (R, W) int32: the grammar's
    masks of the rows (all bits set where a request has no grammar)."""
    out = logits.clone() if bitmask is None else masked(logits, bitmask)  # -inf commutes with every step below
    device, vocab_size = logits.device, logits.shape[-1]
    for i, row in enumerate(rows):
        params, x = row.request.params, out[i]
        num_output = row.request.num_output_tokens + len(row.drafts)
        if num_output < params.min_tokens:
            banned = [t for t in (*eos_token_ids, *params.stop_token_ids) if t < vocab_size]
            x[torch.tensor(banned, dtype=torch.long, device=device)] = float("-inf")
        if not (params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
                or params.logit_bias):
            continue  # a grammar alone: its mask below; the output is not copied (O(length) a token)
        output = row.request.output_token_ids + list(row.drafts)
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.request.prompt_token_ids) | set(output)), device=device)
            values = x[seen]
            x[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        if (params.presence_penalty or params.frequency_penalty) and output:
            ids, counts = torch.tensor(output, device=device).unique(return_counts=True)
            x[ids] -= params.frequency_penalty * counts.float() + params.presence_penalty
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], device=device)
            x[ids] += torch.tensor([b for _, b in params.logit_bias], device=device)
    return out
