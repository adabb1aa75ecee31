"""Speculative decoding: the n-gram proposer and the `Speculator` the engine and its model runner
drive (the config, `SpeculativeConfig`, lives in optc/core/settings.py with the other runtime settings).

Each step, before scheduling, the speculator gives every running request that is decoding (one
token behind) up to k draft tokens (`Request.draft_token_ids`); the scheduler runs them as more
query tokens of their request and the target returns logits at each of them plus one. After the
forward, `verify` keeps the accepted prefix and one more token (runtime/verifier.py: rejection
sampling, lossless; the model runner calls it) and the engine rolls the request's computed count
back over the rejected ones.

Proposers share one small interface: `propose(requests, num_tokens) -> (draft ids, draft probs)`,
probabilities None for one-hot drafts, and `release(request_id)` when a request leaves or is
preempted; a proposer that drafts from the target's features (EAGLE) also has `observe(request,
start, features)`, which the model runner feeds after every forward. `NgramProposer` (prompt lookup)
is here; the draft-model proposer is runtime/draft.py, the EAGLE head's runtime/eagle.py.

Draft trees (an `eagle-tree` config, where the target's runner allows them: `allow_trees`). The EAGLE
proposer's `propose_tree` gives each request a tree (node tokens, parents before children), the
request's draft tokens are its nodes in node order, and the runner verifies them in one forward under
an ancestor mask (runtime/batch.py); `verify` takes, per tree, the greedy argmax path or
tree_rejection_sample's path (runtime/verifier.py `verify_tree`), and the runner moves that path's K/V
to consecutive positions (`accepted_path`) and hands the path's features to the proposer. The scheduler
may keep a prefix of a tree's nodes (its budget): a prefix in node order is a tree. Acceptance counts per
depth: a tree's drafted count is its depth, the most it can accept. Where trees cannot run (a target
kernel without the mask, sliding-window or MLA attention, tensor parallelism, CUDA graphs), the config
drafts chains of its depth.

Adaptive. Speculation costs target compute for tokens that may be rejected, so (1) a step whose
batch holds more than `disable_above_num_requests` running requests does not speculate (a large
batch already keeps the device busy: measured in benchmarks/speculative.py, docs/PERF.md), and (2) each request
picks k from its measured acceptance rate a (a decayed count of accepted over tried drafts): the k
in 0..K that maximizes expected tokens per step over its relative cost,
(1 + a + a^2 + ... + a^k) / (1 + token_cost * k); for a tree of depth k (a the per-depth rate) the cost is
1 + (TREE_NODE_COST * nodes + TREE_DEPTH_COST * k) * token_cost / eagle's default token_cost (nodes: top_k +
(k - 1) top_k^2 at most, within NODES): a node costs a verification row, a depth a head forward. A request
whose k drops to 0 drifts back to the prior rate while it does not speculate, so it probes again later; a request
not yet measured drafts one token even where the prior says 0 (a costly draft model is measured before it is
judged: a draft that is always accepted pays at any cost below a step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from optc.core.errors import InputError
from optc.core.settings import (
    DEFAULT_TOKEN_COST,
    TREE_DEPTH_COST,
    TREE_NODE_COST,
    SpeculativeConfig,
    SpeculativeMethod,
)
from optc.runtime.batch import tree_rows
from optc.runtime.request import Request
from optc.runtime.verifier import rejection_sample, target_probs, verify_tree

PRIOR_ACCEPTANCE = 0.6  # the acceptance rate assumed before a request has any measurement
DECAY = 0.8  # weight of the past in a request's acceptance counts


def load_draft(config: SpeculativeConfig, artifact: Any, model: Any, tokenizer: Any, verify: bool = True) -> Any:
    """The draft model of a `draft` config, on the target `model`'s device; a draft whose vocabulary or
    tokenizer differs from the target's (read from `artifact`) is refused (InputError naming both)."""
    from transformers import AutoTokenizer

    from optc.core.artifact import read
    from optc.runtime.loader import load_model

    draft = read(config.draft, verify=verify, device=model.device.type)
    draft_model = load_model(draft, str(model.device))
    draft_vocab = AutoTokenizer.from_pretrained(draft.tokenizer_dir).get_vocab()
    if draft_model.vocab_size != model.vocab_size or draft_vocab != tokenizer.get_vocab():
        raise InputError(
            f"draft {config.draft} (vocab_size {draft_model.vocab_size}, tokenizer of {len(draft_vocab)} tokens) "
            f"does not share the vocabulary of target {artifact.path} (vocab_size {model.vocab_size}, tokenizer "
            f"of {len(tokenizer.get_vocab())} tokens); use a draft built from the same model family"
        )
    return draft_model


def make_speculator(
    config: SpeculativeConfig | None, draft_model: Any, engine_config: Any, num_blocks: int, max_model_len: int,
    draft_head: Any = None, vocab_size: int | None = None,
) -> Speculator | None:
    """The speculator of `config` (None: no speculation). A draft model runs on its own ModelRunner with
    `num_blocks` blocks (the target's count: both pools come from one budget) and CUDA graphs for up to
    the speculation cut-off's requests; an `eagle` config drafts with `draft_head` (runtime/eagle.py's
    load_eagle_head) over the target's `vocab_size` tokens."""
    if config is None:
        return None
    if config.method is SpeculativeMethod.NGRAM:
        return Speculator(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))
    if config.method is SpeculativeMethod.EAGLE:
        from optc.runtime.eagle import EagleProposer

        if draft_head is None or vocab_size is None:
            raise ValueError(f"speculative config {config.describe()} needs the draft head (load_eagle_head)")
        return Speculator(config, EagleProposer(draft_head, vocab_size))
    from optc.runtime.draft import DraftProposer
    from optc.runtime.model_runner import ModelRunner

    if draft_model is None:
        raise ValueError(f"speculative config {config.describe()} needs its draft model (load_draft)")
    max_len = min(max_model_len, draft_model.max_position_embeddings)
    runner = ModelRunner(draft_model, engine_config, num_blocks, max_len,
                         max_num_requests=min(engine_config.max_num_seqs, config.disable_above_num_requests))
    return Speculator(config, DraftProposer(runner, num_blocks))


class Proposer(Protocol):
    def propose(
        self, requests: Sequence[Request], num_tokens: Sequence[int]
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Up to num_tokens[i] draft ids for each request, and their (k_i, V) probabilities (None = one-hot)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget the request (finished, aborted or preempted)."""
        ...


class NgramProposer:
    """Prompt lookup: the longest suffix (prompt_lookup_max down to _min tokens) of a request's tokens
    that occurred earlier in them proposes what followed its latest earlier occurrence. No model."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(
        self, requests: Sequence[Request], num_tokens: Sequence[int]
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        pairs = zip(requests, num_tokens, strict=True)
        drafts = [ngram_lookup(r.token_ids, self.min_n, self.max_n, k) for r, k in pairs]
        return drafts, [None] * len(drafts)

    def release(self, request_id: str) -> None:
        pass


def ngram_lookup(token_ids: Sequence[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """What followed the latest earlier occurrence of the longest suffix of token_ids (n in max_n..min_n)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length - n - 1: every earlier n-gram, the suffix itself excluded
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + num_tokens].tolist()
    return []


@dataclass
class _Acceptance:
    accepted: float = 2 * PRIOR_ACCEPTANCE  # decayed counts, starting at the prior
    tried: float = 2.0
    measured: bool = False  # a verification of its drafts has been recorded

    @property
    def rate(self) -> float:
        return self.accepted / self.tried


@dataclass
class SpeculativeStats:
    num_drafts: int = 0  # verifications of a request with >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at i

    def to_fields(self) -> dict[str, Any]:
        """The EngineStats fields of speculative decoding."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_position": tuple(self.num_accepted_tokens_per_position),
            "spec_acceptance_rate": self.num_accepted_tokens / max(1, self.num_draft_tokens),
            "spec_mean_acceptance_length": 1 + self.num_accepted_tokens / max(1, self.num_drafts),
        }


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.stats = SpeculativeStats(num_accepted_tokens_per_position=[0] * config.num_speculative_tokens)
        self._acceptance: dict[str, _Acceptance] = {}
        self._draft_probs: dict[str, torch.Tensor | None] = {}
        k = config.num_speculative_tokens
        self._gain_denominators = [1.0 + config.cost * i for i in range(k + 1)]
        if config.is_tree:  # depth i: top_k nodes at depth 1, top_k^2 below each later depth, NODES at most
            top_k, scale = config.tree_top_k, config.cost / DEFAULT_TOKEN_COST[SpeculativeMethod.EAGLE.value]
            self._tree_denominators = [1.0] + [
                1.0 + scale * (TREE_NODE_COST * min(config.tree_num_nodes, top_k * (1 + (i - 1) * top_k))
                               + TREE_DEPTH_COST * i) for i in range(1, k + 1)]
        self.needs_features = hasattr(proposer, "observe")  # the model runner then hands it every step's
        self.use_tree = False  # draft trees: set by the target's model runner where its model takes them
        self._tree_parents: dict[str, list[int]] = {}  # this step's trees (request id -> parent of each node)
        self._paths: dict[str, list[int]] = {}  # this step's accepted tree paths (node ids, by depth)

    def allow_trees(self, allowed: bool) -> None:
        """Whether the target's steps can verify draft trees (runtime/model.py `takes_tree_mask`, one rank, eager);
        a tree config drafts chains of its depth where they cannot. The adaptive depth then weighs a tree's
        nodes as the cost of a step."""
        self.use_tree = allowed and self.config.is_tree
        if self.use_tree:
            self._gain_denominators = self._tree_denominators

    def tree_parents(self, request: Request) -> list[int] | None:
        """The parents of the request's draft nodes (as many as its drafts the scheduler kept); None: a chain."""
        parents = self._tree_parents.get(request.request_id)
        return None if parents is None else parents[: len(request.draft_token_ids)]

    def accepted_path(self, request: Request) -> list[int] | None:
        """The node ids of the request's accepted tree path in this step's verification (None: not a tree)."""
        return self._paths.get(request.request_id)

    def observe(self, requests: Sequence[Request], starts: Sequence[int], num_new_tokens: Sequence[int],
                features: torch.Tensor) -> None:
        """A step's features (sum(num_new_tokens), H), request after request, for the proposer."""
        row = 0
        for request, start, n in zip(requests, starts, num_new_tokens, strict=True):
            path = self._paths.get(request.request_id)
            if path is None:
                self.proposer.observe(request, start, features[row : row + n])
            else:  # a tree's rows are its nodes: the root's and the accepted path's features continue the request
                self.proposer.observe(request, start, features[[row, *(row + 1 + j for j in path)]])
            row += n

    def propose(self, running: Sequence[Request]) -> None:
        """Give each decoding request its draft tokens for this step (none in a large batch)."""
        self._draft_probs.clear()
        self._tree_parents.clear()
        self._paths.clear()
        for request in running:  # drafts of a request the last step's budget left out are stale
            request.draft_token_ids = []
        if len(running) > self.config.disable_above_num_requests:
            return
        requests, num_tokens = [], []
        for request in running:
            if request.num_computed_tokens != request.num_tokens - 1:
                continue  # still prefilling
            params = request.params
            room = min(params.max_tokens - request.num_output_tokens, request.max_num_tokens - request.num_tokens)
            k = min(self._choose_k(request.request_id), room - 1)  # k + 1 tokens may be emitted
            if k > 0:
                requests.append(request)
                num_tokens.append(k)
        if not requests:
            return
        if self.use_tree:  # node budgets: the slots past a request are its capacity's, like a chain's k
            budgets = [min(self.config.tree_num_nodes, r.max_num_tokens - r.num_tokens - 1) for r in requests]
            trees = self.proposer.propose_tree(requests, num_tokens, self.config.tree_top_k, budgets)
            for request, (draft, parents) in zip(requests, trees, strict=True):
                if draft:
                    request.draft_token_ids = draft
                    self._tree_parents[request.request_id] = parents
            return
        drafts, probs = self.proposer.propose(requests, num_tokens)
        for request, draft, prob in zip(requests, drafts, probs, strict=True):
            if draft:
                request.draft_token_ids = list(draft)
                self._draft_probs[request.request_id] = prob

    def verify(self, requests: Sequence[Request], logits: Sequence[torch.Tensor]) -> list[list[int]]:
        """The tokens each request emits: its accepted drafts, then one resampled or bonus token.

        logits[i]: (len(drafts_i) + 1, V) float32, the target's logits after each query position (a tree's:
        after the root, then after each node). A tree's accepted path is `accepted_path` afterwards.
        """
        out: list[list[int]] = [[] for _ in requests]
        chain = [i for i, r in enumerate(requests) if self.tree_parents(r) is None]
        for i in sorted(set(range(len(requests))) - set(chain)):
            request = requests[i]
            parents = self.tree_parents(request)
            path, out[i] = verify_tree(logits[i], parents, request.draft_token_ids, request.params, request.generator)
            self._paths[request.request_id] = path
            self._record(request.request_id, max(tree_rows(parents)[0]), len(path))
            request.draft_token_ids = []
        if chain:
            for i, tokens in zip(chain, self._verify_chain([requests[i] for i in chain], [logits[i] for i in chain]),
                                 strict=True):
                out[i] = tokens
        return out

    def _verify_chain(self, requests: Sequence[Request], logits: Sequence[torch.Tensor]) -> list[list[int]]:
        k = max(len(r.draft_token_ids) for r in requests)
        num_rows, vocab_size = len(requests), logits[0].shape[-1]
        device = logits[0].device
        row_params = [r.params for r in requests for _ in range(k + 1)]
        padded = torch.zeros(num_rows, k + 1, vocab_size, device=device)
        for i, rows in enumerate(logits):
            padded[i, : len(rows)] = rows
        p = target_probs(padded.view(-1, vocab_size), row_params).view(num_rows, k + 1, vocab_size)
        draft_ids = torch.full((num_rows, k), -1, dtype=torch.int64)
        num_drafts = torch.tensor([len(r.draft_token_ids) for r in requests])
        probs = [self._draft_probs.get(r.request_id) for r in requests]
        q = None
        if any(x is not None for x in probs):
            q = torch.zeros(num_rows, k, vocab_size, device=device)
        u_accept, u_resample = torch.zeros(num_rows, k), torch.zeros(num_rows)
        for i, request in enumerate(requests):
            n = len(request.draft_token_ids)
            draft_ids[i, :n] = torch.tensor(request.draft_token_ids)
            if q is not None:
                q[i, :n] = probs[i][:n] if probs[i] is not None else torch.zeros(n, vocab_size).scatter_(
                    -1, draft_ids[i, :n, None], 1.0)
            if request.generator is not None:  # greedy rows need no randomness (see verifier)
                u = torch.rand(n + 1, generator=request.generator, device=request.generator.device).cpu()
                u_accept[i, :n], u_resample[i] = u[:n], u[n]
        token_ids, num_accepted = rejection_sample(
            p, draft_ids.to(device), num_drafts.to(device), q, u_accept.to(device), u_resample.to(device))
        token_ids, num_accepted = token_ids.tolist(), num_accepted.tolist()
        out = []
        for i, request in enumerate(requests):
            n, a = len(request.draft_token_ids), num_accepted[i]
            self._record(request.request_id, n, a)
            out.append(token_ids[i][: a + 1])
            request.draft_token_ids = []
        return out

    def release(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
        self._draft_probs.pop(request_id, None)
        self._tree_parents.pop(request_id, None)
        self._paths.pop(request_id, None)
        self.proposer.release(request_id)

    def _choose_k(self, request_id: str) -> int:
        k = self.config.num_speculative_tokens
        if not self.config.adaptive:
            return k
        state = self._acceptance.setdefault(request_id, _Acceptance())
        rate, best, best_gain, expected = state.rate, 0, 1.0, 1.0
        for i in range(1, k + 1):
            expected += rate**i
            gain = expected / self._gain_denominators[i]
            if gain > best_gain:
                best, best_gain = i, gain
        if best == 0 and not state.measured:  # unmeasured: one draft token, so that a costly method gets measured
            return 1
        if best == 0:  # not speculating: drift back towards the prior so that it probes again
            state.accepted = DECAY * state.accepted + (1 - DECAY) * 2 * PRIOR_ACCEPTANCE
            state.tried = DECAY * state.tried + (1 - DECAY) * 2
        return best

    def _record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            stats.num_accepted_tokens_per_position[i] += 1
        state = self._acceptance.setdefault(request_id, _Acceptance())
        # accepted drafts are successes, the first rejected one a failure; later drafts were never tried
        state.accepted = DECAY * state.accepted + num_accepted
        state.tried = DECAY * state.tried + num_accepted + (num_accepted < num_drafted)
        state.measured = True
