"""Speculative verification: which drafted tokens a request keeps, as pure functions of the target's
logits, the drafted tokens and their draft probabilities, the sampling params and random numbers.

Rejection sampling (Leviathan et al. 2023, Chen et al. 2023). A request drafted x_1..x_k from the
draft distributions q_1..q_k; the target's distributions at the same positions are p_1..p_{k+1}. For
i = 1..k in order:

    accept x_i if u_i < p_i(x_i) / q_i(x_i)          (u_i ~ U[0, 1): probability min(1, p/q))
    else emit one token from norm(max(p_i - q_i, 0)) and stop;

if all k are accepted, emit a bonus token from p_{k+1}. Every emitted token is then distributed as p
exactly (lossless), whatever q is. A draft without probabilities (n-gram lookup, an argmax draft) has
a one-hot q: accept with probability p_i(x_i), else resample from p_i with x_i removed. Greedy
requests use the one-hot p of the target's argmax, which makes the test "accept while the draft
equals the argmax, then emit the argmax": no randomness, and the same tokens as plain decoding.

A draft tree (several candidates per position, `tree_rejection_sample`) runs the same test child by child,
carrying the residual across siblings: lossless too, and greedy rows take the longest path of drafts equal to
the argmax. Its target forward attends each node to its ancestors only (kernels/cpu_ext's tree_attention).

Not here: proposing drafts (runtime/speculative.py, runtime/draft.py) or the KV rollback (engine).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from optc.runtime.sampler import SamplingParams, apply_top_k_top_p


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from. logits: (R, V) float32; returns (R, V) float32.

    Greedy rows are one-hot at the argmax; the others are softmax(top-k/top-p(logits / temperature)),
    the distribution `sampler.sample` draws from.
    """
    probs = torch.zeros_like(logits)
    greedy = [r for r, p in enumerate(params) if p.is_greedy]
    if greedy:
        index = torch.tensor(greedy, device=logits.device)
        probs[index] = torch.zeros_like(probs[index]).scatter_(-1, logits[index].argmax(-1, keepdim=True), 1.0)
    rows = [r for r, p in enumerate(params) if not p.is_greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        temperature = torch.tensor([params[r].temperature for r in rows], device=logits.device)
        top_k = torch.tensor([params[r].top_k for r in rows], device=logits.device)
        top_p = torch.tensor([params[r].top_p for r in rows], device=logits.device)
        shaped = apply_top_k_top_p(logits[index] / temperature[:, None], top_k, top_p)
        probs[index] = shaped.softmax(dim=-1)
    return probs


def rejection_sample(
    p: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    u_accept: torch.Tensor,
    u_resample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify N requests' drafts at once.

    p: (N, K + 1, V) target probabilities; draft_token_ids: (N, K) int64; num_draft_tokens: (N,) the
    valid drafts per row (k_n <= K, the rest is padding); q: (N, K, V) draft probabilities, or None for
    one-hot drafts; u_accept: (N, K) and u_resample: (N,) uniforms in [0, 1).
    Returns (token_ids (N, K + 1), num_accepted (N,)): row n emits token_ids[n, : num_accepted[n] + 1],
    its accepted drafts followed by the resampled (or bonus) token.
    """
    num_rows, k, _ = q.shape if q is not None else (*draft_token_ids.shape, 0)
    positions = torch.arange(k, device=p.device)
    is_draft = positions[None, :] < num_draft_tokens[:, None]  # (N, K)
    ids = draft_token_ids.clamp(min=0)[..., None]
    p_x = p[:, :k].gather(-1, ids)[..., 0]  # (N, K): p_i(x_i)
    q_x = q.gather(-1, ids)[..., 0] if q is not None else torch.ones_like(p_x)
    # accept if u < p/q, written u * q < p so that q(x) = 0 (never drafted) cannot divide by zero
    accepted = (u_accept * q_x < p_x) & is_draft
    num_accepted = accepted.int().cumprod(dim=-1).sum(dim=-1)  # (N,): accepted drafts before the first rejection
    # the row's final token comes from position a = num_accepted: norm(max(p_a - q_a, 0)) after a
    # rejection (a < k_n), or p_{k_n + 1} itself when every draft was accepted (q is 0 past the drafts)
    rows = torch.arange(num_rows, device=p.device)
    p_final = p[rows, num_accepted]  # (N, V)
    rejected = num_accepted < num_draft_tokens
    at = num_accepted.clamp(max=max(k - 1, 0))
    if k == 0:
        residual = p_final
    elif q is not None:
        residual = torch.where(rejected[:, None], (p_final - q[rows, at]).clamp(min=0.0), p_final)
    else:  # one-hot q: max(p - onehot(x), 0) is p with x removed
        drop = torch.zeros_like(p_final, dtype=torch.bool).scatter_(-1, ids[rows, at], True) & rejected[:, None]
        residual = p_final.masked_fill(drop, 0.0)
    total = residual.sum(dim=-1, keepdim=True)
    # p == q leaves no residual mass; a rejection then has probability 0, so fall back to p
    residual = torch.where(total > 0, residual, p_final)
    final = _inverse_cdf(residual, u_resample)
    token_ids = torch.cat([draft_token_ids.clamp(min=0), torch.zeros_like(final)[:, None]], dim=-1)
    token_ids[rows, num_accepted] = final
    return token_ids, num_accepted


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row with probability weights / row sum (weights >= 0); u: (N,) in [0, 1).

    The first index whose cumulative weight exceeds u * total: a zero-weight index is never picked.
    """
    cdf = weights.cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target, right=True)[:, 0]
    # u * total can round up to total: then take the last index with weight
    last = ((weights > 0) * torch.arange(weights.shape[-1], device=weights.device)).argmax(dim=-1)
    return torch.minimum(index, last)


def tree_rejection_sample(
    p: torch.Tensor,
    parents: Sequence[int],
    draft_token_ids: torch.Tensor,
    q: torch.Tensor | None,
    u_accept: torch.Tensor,
    u_resample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify N draft trees of one shape at once (EAGLE's and SpecInfer's multi-candidate rejection sampling).

    The tree: nodes 0..m-1, node j drafted below `parents[j]` (-1: the root, the request's last token), parents
    before their children, siblings in the order they are tried. p: (N, m + 1, V) target probabilities, row 0
    at the root, row j + 1 after node j; draft_token_ids: (N, m); q: (N, m, V), the distribution node j was
    drawn from given the siblings tried before it (siblings drawn independently from one q share its row), or
    None for one-hot drafts (top-k siblings, n-gram); u_accept: (N, m), u_resample: (N,) uniforms in [0, 1).

    From the root, each child x of the current node in turn:

        accept x if u * q(x) < r(x), r the current residual (first p at the node)   (probability min(1, r/q))
        else r = norm(max(r - q, 0))   (one-hot q: r with x removed) and try the next sibling;

    an accepted child becomes the current node (r = p after it); when every child is rejected, or the node has
    none, emit one token from r and stop. Each step is the chain's rejection sampler with the residual carried
    across siblings, so every emitted token is distributed as p (lossless); greedy rows (one-hot p) follow the
    longest path of drafts equal to the target's argmax and then emit the argmax, as plain decoding does.

    Returns (path (N, depth) node ids of the accepted drafts, -1 past num_accepted; num_accepted (N,); final
    token (N,)): row n emits draft_token_ids[n, path[n, :num_accepted[n]]], then its final token.
    """
    num_rows, num_nodes = draft_token_ids.shape
    depth = _depths(parents)
    rows = torch.arange(num_rows, device=p.device)
    current = torch.full((num_rows,), -1, dtype=torch.long, device=p.device)
    residual = p[:, 0].clone()
    num_accepted = torch.zeros(num_rows, dtype=torch.long, device=p.device)
    path = torch.full((num_rows, max(depth, default=0)), -1, dtype=torch.long, device=p.device)
    for j, parent in enumerate(parents):
        tried = current == parent  # (N,): rows at node j's parent, no sibling before it accepted
        x = draft_token_ids[:, j]
        q_x = q[rows, j, x] if q is not None else torch.ones_like(residual[:, 0])
        accepted = tried & (u_accept[:, j] * q_x < residual[rows, x])
        rejected = tried & ~accepted
        if q is not None:
            reduced = (residual - q[:, j]).clamp(min=0.0)
        else:
            reduced = residual.scatter(-1, x[:, None], 0.0)
        total = reduced.sum(-1, keepdim=True)
        # no residual mass left (r == q): that rejection had probability 0; keep r
        reduced = torch.where(total > 0, reduced / total.clamp(min=torch.finfo(reduced.dtype).tiny), residual)
        residual = torch.where(rejected[:, None], reduced, torch.where(accepted[:, None], p[:, j + 1], residual))
        path[accepted, depth[j] - 1] = j
        current = torch.where(accepted, j, current)
        num_accepted += accepted.long()
    return path, num_accepted, _inverse_cdf(residual, u_resample)


def verify_tree(
    logits: torch.Tensor, parents: Sequence[int], draft_token_ids: Sequence[int], params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[list[int], list[int]]:
    """One request's draft tree of one-hot drafts (top-k picks): the accepted path's node ids and the tokens
    it emits (the path's drafts, then one more). logits: (m + 1, V) float32, row 0 after the root.

    Greedy: from the root, follow the child whose draft equals the target's argmax after the current node
    while there is one, then emit that argmax (plain decoding's tokens, no randomness). Sampled:
    `tree_rejection_sample` with q = None, one uniform per node and one for the final token."""
    if params.is_greedy:
        best = logits.argmax(-1).tolist()  # (m + 1,)
        children: dict[int, list[int]] = {}
        for j, parent in enumerate(parents):
            children.setdefault(parent, []).append(j)
        path, current = [], -1
        while True:
            match = next((j for j in children.get(current, ()) if draft_token_ids[j] == best[current + 1]), None)
            if match is None:
                return path, [draft_token_ids[j] for j in path] + [best[current + 1]]
            path.append(match)
            current = match
    m = len(parents)
    p = target_probs(logits, [params] * (m + 1))[None]
    u = torch.rand(m + 1, generator=generator, device=generator.device).to(logits.device)
    ids = torch.tensor([list(draft_token_ids)], device=logits.device)
    path, num_accepted, final = tree_rejection_sample(p, parents, ids, None, u[None, :m], u[m:])
    accepted = path[0, : int(num_accepted[0])].tolist()
    return accepted, [draft_token_ids[j] for j in accepted] + [int(final[0])]


def _depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (a root child: 1); parents must come before their children."""
    depth: list[int] = []
    for j, parent in enumerate(parents):
        if not -1 <= parent < j:
            raise ValueError(f"tree node {j}'s parent {parent} must be -1 (the root) or an earlier node")
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return depth
