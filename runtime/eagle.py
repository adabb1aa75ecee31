"""EagleProposer: drafts from the artifact's EAGLE head (optc/core/eagle.py) over the target's features.

The target's model runner hands every step's features (the lm_head's input at each computed token,
`observe`) to this proposer, which keeps per request the features not yet in the head's sequence.
Features past a request's computed count belong to drafts the target rejected and are dropped at the
next `propose`. `propose` first extends the head's sequence (its own K/V, plain tensors per request:
one layer, a few hundred entries) with the pending real entries in one head forward, then drafts k
tokens with k - 1 more one-entry forwards on throwaway K/V: chain drafting. Greedy requests take
the head's argmax (a one-hot draft); sampled ones draw from its distribution under the request's
temperature / top-k / top-p with the request's generator, kept for verification.

A request whose features do not continue the head's sequence (a prefix-cache hit leaves the cached
positions without features; a recomputation after preemption starts again) restarts the head's
sequence at the first feature it gets: drafts then see less context, verification keeps the output
exact. Not here: the head's math, or training it (passes/train_draft_head.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from optc.core.eagle import EagleHead, EagleHeadConfig
from optc.core.errors import InputError
from optc.core.formats import part_name
from optc.core.ops import Param
from optc.runtime.draft import sample_drafts
from optc.runtime.request import Request


@dataclass(eq=False)
class _HeadState:
    start: int  # the position of the head's first entry
    keys: torch.Tensor | None = None  # (L, H_kv, D): entries start .. start + L - 1, all from real features
    values: torch.Tensor | None = None
    pending: torch.Tensor | None = None  # features of positions end, end + 1, ... not yet entries
    next_feature: torch.Tensor | None = None  # (H,) the head's prediction for position `end`

    @property
    def end(self) -> int:
        return self.start + (0 if self.keys is None else self.keys.shape[0])

    def restart(self, start: int, features: torch.Tensor) -> None:
        self.start, self.keys, self.values, self.pending, self.next_feature = start, None, None, features, None


def load_eagle_head(artifact: Any, model: Any) -> EagleHead:
    """The artifact's draft head on `model`'s device, with the target's embedding and lm_head rows read
    whole from the artifact (a tensor-parallel rank's own copies are slices); InputError when the artifact
    has none."""
    section = artifact.manifest.draft_head
    if section is None:
        raise InputError(f"artifact {artifact.path} has no draft head, which --speculative eagle needs: build it "
                         "with a recipe whose passes include train_draft_head or import_draft_head")
    config = EagleHeadConfig.from_json(section["config"])
    dtype = torch.float32 if model.device.type == "cpu" else model.dtype  # CPU matmuls: fp32 is the fast kind

    def dense(name: str, as_dtype: torch.dtype | None = None) -> torch.Tensor:
        fmt = artifact.graph.tensors[name].format
        parts = {role: artifact.store.get(part_name(name, role, fmt)).to(model.device)
                 for role in fmt.part_shapes(artifact.graph.tensors[name].shape)}
        return Param(parts, fmt).dense(as_dtype)

    weights = {name: dense(name, dtype) for name in config.tensor_shapes()}
    nodes = {n.op: n for n in artifact.graph.nodes if n.op in ("embedding", "lm_head")}
    vocab_ids = torch.tensor(config.vocab_ids, device=model.device)
    lm_rows = dense(nodes["lm_head"].params["weight"], dtype)[vocab_ids]
    return EagleHead(config, weights, dense(nodes["embedding"].params["weight"]), lm_rows)


class EagleProposer:
    def __init__(self, head: EagleHead, vocab_size: int) -> None:
        self.head = head
        self.vocab_size = vocab_size
        self.device = head.lm_rows.device
        self.vocab_ids = torch.tensor(head.config.vocab_ids, device=self.device)
        self._states: dict[str, _HeadState] = {}

    def observe(self, request: Request, start: int, features: torch.Tensor) -> None:
        """The target computed positions start .. start + len(features) - 1 of the request: (T, H) features."""
        state = self._states.get(request.request_id)
        features = features.clone()  # a slice of the step's batch: do not keep the whole batch alive
        if state is None:
            self._states[request.request_id] = _HeadState(start, pending=features)
            return
        pending_end = state.end + (0 if state.pending is None else state.pending.shape[0])
        if not state.end <= start <= pending_end:  # a gap, or a recomputation of entries: restart
            state.restart(start, features)
            return
        keep = start - state.end
        state.pending = features if state.pending is None or keep == 0 else torch.cat([state.pending[:keep], features])

    @torch.inference_mode()
    def propose(
        self, requests: Sequence[Request], num_tokens: Sequence[int]
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        drafts: list[list[int]] = []
        probs: list[torch.Tensor | None] = []
        for request, k in zip(requests, num_tokens, strict=True):
            draft, q = self._propose_one(request, k)
            drafts.append(draft)
            probs.append(q)
        return drafts, probs

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _propose_one(self, request: Request, k: int) -> tuple[list[int], torch.Tensor | None]:
        state = self._states.get(request.request_id)
        if state is None:
            return [], None
        n = request.num_computed_tokens  # features are the target's for positions < n only
        if state.pending is not None:
            state.pending = state.pending[: max(0, n - state.end)]
            if state.pending.shape[0]:
                self._extend(state, request.token_ids)
            state.pending = None
        if state.end != n or state.next_feature is None:
            return [], None
        head, feature = self.head, state.next_feature
        cache = (state.keys, state.values)
        draft, q_rows = [], []
        for j in range(k):
            logits = head.logits(feature[None])  # (1, N)
            token, q = self._sample(logits, request)
            draft.append(token)
            if q is not None:
                q_rows.append(q)
            if j + 1 < k:  # entry n + j: the predicted feature with the token just drafted
                out, (keys, values) = head.forward(
                    torch.tensor([token], device=self.device), feature[None],
                    torch.tensor([n + j], device=self.device), cache)
                cache = (torch.cat([cache[0], keys]), torch.cat([cache[1], values]))
                feature = out[0]
        return draft, torch.stack(q_rows) if q_rows else None

    def _extend(self, state: _HeadState, token_ids: list[int]) -> None:
        """Make the pending features entries: entry p pairs feature p with token p + 1."""
        end, num = state.end, state.pending.shape[0]
        tokens = torch.tensor(token_ids[end + 1 : end + num + 1], device=self.device)
        positions = torch.arange(end, end + num, device=self.device)
        cache = None if state.keys is None else (state.keys, state.values)
        out, (keys, values) = self.head.forward(tokens, state.pending, positions, cache)
        state.keys = keys if state.keys is None else torch.cat([state.keys, keys])
        state.values = values if state.values is None else torch.cat([state.values, values])
        state.next_feature = out[-1]

    def _sample(self, logits: torch.Tensor, request: Request) -> tuple[int, torch.Tensor | None]:
        """A draft token from the head's (1, N) logits, and its (V,) distribution for a sampled request."""
        if request.params.is_greedy:
            return int(self.vocab_ids[logits[0].argmax()]), None
        full = torch.full((1, self.vocab_size), float("-inf"), device=self.device)
        full[0, self.vocab_ids] = logits[0]
        token_ids, q = sample_drafts(full, [request])
        return token_ids[0], q[0]
