"""DraftProposer: a second, cheaper model (an artifact with the target's tokenizer) proposes drafts.

The draft runs on its own `ModelRunner` (runtime/model_runner.py): its KV caches, CUDA graphs for its
one-token decode steps and one-copy batches, as the target's runner has. Its pool holds as many
blocks as the target's, sized from one shared budget (runtime/kv_sizing.py). It keeps its own block
bookkeeping (its own KVCacheManager, no prefix caching) and, per request,
the tokens whose K/V it has computed. Each `propose` first rolls a request back to the longest prefix
it shares with the request's tokens (the drafts the target rejected are dropped by bookkeeping, and
blocks past the new end are freed), then catches up on the tokens the target accepted in the same
forward that yields the first draft, then decodes one token per forward for the rest: k forwards for
k drafts, all requests batched. Greedy requests take the draft's argmax (a one-hot draft); sampled
ones draw from the draft's distribution shaped by the request's temperature / top-k / top-p with the
request's generator, and that distribution is kept for verification. A request the draft pool cannot
hold gets no drafts this step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from optc.runtime.kv_cache_manager import KVCacheManager
from optc.runtime.model import kv_windows
from optc.runtime.request import Request
from optc.runtime.verifier import target_probs


@dataclass(eq=False)
class _DraftRequest:
    """What the draft holds for one request (the KVCacheManager reads request_id and num_computed_tokens)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)  # tokens fed to the draft; K/V computed for all
    num_computed_tokens: int = 0
    num_verified: int = 0  # a prefix of token_ids known to equal the request's tokens


class DraftProposer:
    def __init__(self, runner: Any, num_blocks: int) -> None:
        """`runner`: the draft model's ModelRunner, its caches of `num_blocks` blocks."""
        self.runner = runner
        self.model = runner.model
        self.kv_manager = KVCacheManager(num_blocks, runner.block_size, enable_prefix_caching=False,
                                         windows=kv_windows(self.model))
        self._states: dict[str, _DraftRequest] = {}

    def propose(
        self, requests: Sequence[Request], num_tokens: Sequence[int]
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active, feeds = [], []  # indices of requests the draft runs, and their first forward's tokens
        for i, (request, k) in enumerate(zip(requests, num_tokens, strict=True)):
            state = self._states.setdefault(request.request_id, _DraftRequest(request.request_id))
            self._roll_back(state, request.token_ids)
            feed = request.token_ids[state.num_computed_tokens :]
            if state.num_computed_tokens + len(feed) + k > self.model.max_position_embeddings:
                continue
            if self.kv_manager.allocate_slots(state, len(feed) + k - 1) is None:
                self.release(request.request_id)  # recomputed from scratch when the pool has room
                continue
            active.append(i)
            feeds.append(feed)
        for step in range(max((num_tokens[i] for i in active), default=0)):
            if step > 0:  # one more token each: the previous draft
                feeds = [[drafts[i][-1]] for i in active]
            batch_states = [self._states[requests[i].request_id] for i in active]
            logits = self.runner.forward(  # (B, V); after the first, one-token steps: graph replays on a GPU
                feeds, [s.num_computed_tokens for s in batch_states],
                [self.kv_manager.block_ids(s.request_id) for s in batch_states])
            for state, feed in zip(batch_states, feeds, strict=True):
                state.token_ids.extend(feed)
                state.num_computed_tokens += len(feed)
                if step == 0:  # the request's own tokens: verified
                    state.num_verified = state.num_computed_tokens
            sampled = [requests[i] for i in active]
            token_ids, q = sample_drafts(logits, sampled)
            for j, i in enumerate(active):
                drafts[i].append(token_ids[j])
                if q is not None and not requests[i].params.is_greedy:  # greedy drafts are one-hot
                    probs[i].append(q[j])
            active = [i for i in active if len(drafts[i]) < num_tokens[i]]
        return drafts, [torch.stack(p) if p else None for p in probs]

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.kv_manager.free(state)

    def _roll_back(self, state: _DraftRequest, token_ids: list[int]) -> None:
        """Keep the longest prefix of the draft's tokens that the request's tokens share."""
        end = min(len(state.token_ids), len(token_ids))
        same = state.num_verified
        while same < end and state.token_ids[same] == token_ids[same]:
            same += 1
        # the first forward needs one token to read logits at: when the draft already computed all of the
        # request's tokens (it drafted beyond what the target verified and the bonus token matched), redo the last
        same = min(same, len(token_ids) - 1)
        del state.token_ids[same:]
        state.num_computed_tokens = same
        state.num_verified = same
        self.kv_manager.truncate(state, same)


def sample_drafts(logits: torch.Tensor, requests: Sequence[Request]) -> tuple[list[int], torch.Tensor | None]:
    """Draft tokens, and the distributions they were drawn from (None when every row is greedy)."""
    token_ids = logits.argmax(dim=-1)
    if all(r.params.is_greedy for r in requests):
        return token_ids.tolist(), None
    q = target_probs(logits, [r.params for r in requests])
    for j, request in enumerate(requests):
        if request.generator is not None:
            token_ids[j] = torch.multinomial(q[j], 1, generator=request.generator)[0]
    return token_ids.tolist(), q
