"""EagleProposer: drafts from the artifact's EAGLE head (optc/core/eagle.py) over the target's features.

The target's model runner hands every step's features (the lm_head's input at each computed token,
`observe`) to this proposer, which keeps per request the features not yet in the head's sequence.
Features past a request's computed count belong to drafts the target rejected and are dropped at the
next `propose`. `propose` first extends the head's sequence (its own K/V, plain tensors per request:
one layer, a few hundred entries) with the pending real entries in one head forward, then drafts k
tokens with k - 1 more one-entry forwards on throwaway K/V: chain drafting. Greedy requests take
the head's argmax (a one-hot draft); sampled ones draw from its distribution under the request's
temperature / top-k / top-p with the request's generator, kept for verification.

`propose_tree` drafts a tree instead (EAGLE-2's dynamic tree): the root's top_k tokens by the head's
probability, then at each depth the top_k nodes of that depth by cumulative probability (the product of
the draft probabilities along the path) expanded in one head forward (each entry sees the real entries and
its ancestors' entries, a mask), top_k children each, down to depth D; of all the nodes drafted the
`budget` most probable are kept (an ancestor is at least as probable as its descendants, so the kept set is
a tree), parents before children. The nodes are top-k picks, deterministic given the context, so a sampled
request verifies them as one-hot drafts (tree_rejection_sample with q = None stays lossless); top_k 1 is
the greedy chain.

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
import torch.nn.functional as F

from optc.core.eagle import EagleHead, EagleHeadConfig
from optc.core.errors import InputError
from optc.core.formats import part_name
from optc.core.ops import Param
from optc.core.ops.linear import onednn_bf16_gemm
from optc.kernels import cpu_ext
from optc.kernels.cpu_ext.bf16dot import dense_linear
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
    # on the CPU the head's small matmuls are fastest in bfloat16 on bf16dot (one pass over a weight for a tree's
    # rows, AVX-512 or AVX2), else where oneDNN runs them (AVX-512 with BF16), else in float32
    cpu = model.device.type == "cpu"
    on_bf16dot = cpu and model.dtype == torch.bfloat16 and cpu_ext.bf16_isa() is not None
    slow_bf16 = cpu and not on_bf16dot and not (model.dtype == torch.bfloat16 and onednn_bf16_gemm())
    dtype = torch.float32 if slow_bf16 else model.dtype

    def dense(name: str, as_dtype: torch.dtype | None = None) -> torch.Tensor:
        fmt = artifact.graph.tensors[name].format
        parts = {role: artifact.store.get(part_name(name, role, fmt)).to(model.device)
                 for role in fmt.part_shapes(artifact.graph.tensors[name].shape)}
        return Param(parts, fmt).dense(as_dtype)

    weights = {name: dense(name, dtype) for name in config.tensor_shapes()}
    nodes = {n.op: n for n in artifact.graph.nodes if n.op in ("embedding", "lm_head")}
    vocab_ids = torch.tensor(config.vocab_ids, device=model.device)
    lm_rows = dense(nodes["lm_head"].params["weight"], dtype)[vocab_ids]
    return EagleHead(config, weights, dense(nodes["embedding"].params["weight"]), lm_rows,
                     dense_linear if on_bf16dot else F.linear)


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

    @torch.inference_mode()
    def propose_tree(
        self, requests: Sequence[Request], depths: Sequence[int], top_k: int, budgets: Sequence[int]
    ) -> list[tuple[list[int], list[int]]]:
        """Each request's draft tree of at most depths[i] levels and budgets[i] nodes: (token ids, parents)
        in node order, parent -1 the root (the request's last token); empty when the head has no state."""
        trees = []
        for request, depth, budget in zip(requests, depths, budgets, strict=True):
            state = self._current_state(request)
            trees.append(([], []) if state is None else self._draft_tree(state, request.num_computed_tokens,
                                                                          depth, top_k, budget))
        return trees

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _current_state(self, request: Request) -> _HeadState | None:
        """The request's head state extended with its pending real features; None when it cannot draft."""
        state = self._states.get(request.request_id)
        if state is None:
            return None
        n = request.num_computed_tokens  # features are the target's for positions < n only
        if state.pending is not None:
            state.pending = state.pending[: max(0, n - state.end)]
            if state.pending.shape[0]:
                self._extend(state, request.token_ids)
            state.pending = None
        if state.end != n or state.next_feature is None:
            return None
        return state

    def _draft_tree(self, state: _HeadState, n: int, depth: int, top_k: int,
                    budget: int) -> tuple[list[int], list[int]]:
        head = self.head
        logp = head.logits(state.next_feature[None]).log_softmax(-1)  # (1, N)
        scores, parents, tokens = [], [], []  # per node: cumulative log-probability, parent node, head vocab index
        sources: list[torch.Tensor] = []  # per node: the feature its logits came from (its entry's input)
        ancestry: dict[int, int] = {}  # expanded node -> its own and its ancestors' entries in the tree's K/V, as bits
        layer = self._children(logp, [-1], [0.0], state.next_feature[None], scores, parents, tokens, sources, top_k)
        keys, values = state.keys, state.values
        num_real = keys.shape[0]
        for d in range(2, depth + 1):
            expand = sorted(layer, key=lambda i: (-scores[i], i))[:top_k]
            t = len(expand)
            first = len(ancestry)  # the tree's entries so far; this depth's follow, one per expanded node
            mask = torch.zeros(t, num_real + first + t, dtype=torch.bool, device=self.device)
            mask[:, :num_real] = True  # every real entry, then its ancestors' entries and its own
            for row, i in enumerate(expand):
                ancestry[i] = ancestry.get(parents[i], 0) | 1 << (first + row)  # a root child's parent: -1, none
                mask[row, num_real:] = torch.tensor([(ancestry[i] >> e) & 1 for e in range(first + t)],
                                                    dtype=torch.bool)
            out, (k, v) = head.forward(self.vocab_ids[torch.tensor([tokens[i] for i in expand])],
                                       torch.stack([sources[i] for i in expand]),
                                       torch.full((t,), n + d - 2, device=self.device), (keys, values), mask)
            keys, values = torch.cat([keys, k]), torch.cat([values, v])
            layer = self._children(head.logits(out).log_softmax(-1), expand, [scores[i] for i in expand], out,
                                   scores, parents, tokens, sources, top_k)
        kept = sorted(sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:budget])  # parents first
        index = {node: j for j, node in enumerate(kept)}
        token_ids = self.vocab_ids[torch.tensor([tokens[i] for i in kept], dtype=torch.long)].tolist()
        return token_ids, [index[parents[i]] if parents[i] >= 0 else -1 for i in kept]

    @staticmethod
    def _children(logp: torch.Tensor, nodes: list[int], base: list[float], features: torch.Tensor, scores: list,
                  parents: list, tokens: list, sources: list, top_k: int) -> list[int]:
        """Add each node's top_k children (logp: (len(nodes), N) the head's log-probabilities after it)."""
        values, ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
        added = []
        for row, (node, score) in enumerate(zip(nodes, base, strict=True)):
            for value, token in zip(values[row].tolist(), ids[row].tolist(), strict=True):
                added.append(len(scores))
                scores.append(score + value)
                parents.append(node)
                tokens.append(token)
                sources.append(features[row])
        return added

    def _propose_one(self, request: Request, k: int) -> tuple[list[int], torch.Tensor | None]:
        state = self._current_state(request)
        if state is None:
            return [], None
        n = request.num_computed_tokens
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
