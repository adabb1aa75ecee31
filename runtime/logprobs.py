"""Logprobs in the engine step: which logits rows a step returns, and where their logprobs go.

A request normally needs the logits of its last token only. One that asks for prompt logprobs
(`SamplingParams.prompt_logprobs`) needs, while its prompt runs through the model, the logits of
every new token: the row at position p scores prompt token p + 1. Such requests skip the prefix
cache (cached positions would have no logits). Output-token logprobs come from the same row the
sampler reads (the model runner computes them). The math is `sampler.compute_logprobs`; this module
only maps rows to requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from optc.runtime.request import Request
from optc.runtime.sampler import compute_logprobs


def num_logits_rows(request: Request, start: int, num_new: int) -> int:
    """Logits rows a step needs for `num_new` tokens of `request` starting at position `start`."""
    if request.params.prompt_logprobs is None or start >= request.num_prompt_tokens - 1:
        return 1
    return num_new


def record_prompt_logprobs(
    requests: Sequence[Request], starts: Sequence[int], num_rows: Sequence[int], logits: torch.Tensor
) -> list[int]:
    """Store the prompt logprobs these rows give (logits: (sum(num_rows), V)); return the row of
    each request's last scheduled token (the row its next token is sampled from)."""
    last_rows, end = [], 0
    for request, start, n in zip(requests, starts, num_rows, strict=True):
        end += n
        last_rows.append(end - 1)
        num_top = request.params.prompt_logprobs
        count = min(start + n, request.num_prompt_tokens - 1) - start  # rows that score a prompt token
        if num_top is None or count <= 0:
            continue
        if len(request.prompt_logprobs) != request.num_prompt_tokens:
            request.prompt_logprobs = [None] * request.num_prompt_tokens
        targets = torch.tensor(request.prompt_token_ids[start + 1 : start + 1 + count])
        request.prompt_logprobs[start + 1 : start + 1 + count] = compute_logprobs(
            logits[end - n : end - n + count], targets, num_top
        )
    return last_rows

