"""Tree verification alone (runtime/verifier.py's tree_rejection_sample): greedy rows follow the longest path of
drafts equal to the target's argmax, a chain tree is the chain sampler, and with several candidates per node
(drawn independently from one q, or deterministic top-k one-hot drafts) the first and second emitted tokens are
distributed as the target's p: chi-square tests at p < 1e-4 (a false alarm in 1 of 10,000 seed sets for a
correct sampler; the seeds are fixed, so each test is deterministic)."""

from __future__ import annotations

import pytest
import torch

from optc.runtime.verifier import rejection_sample, tree_rejection_sample

# root -> nodes 0, 1, 2; node 0 -> 3, 4; node 1 -> 5; node 3 -> 6
PARENTS = [-1, -1, -1, 0, 0, 1, 3]
NUM_SAMPLES = 40_000


def _one_hot(ids: list[int], vocab_size: int) -> torch.Tensor:
    return torch.zeros(len(ids), vocab_size).scatter_(-1, torch.tensor(ids)[:, None], 1.0)


def test_greedy_follows_the_longest_path_of_argmax_drafts():
    #            root  n0 n1 n2 n3 n4 n5 n6: the argmax after each
    argmax = [4, 7, 2, 0, 5, 1, 3, 6]
    p = _one_hot(argmax, 8)[None]
    # n0 (0) is not the root's argmax, n1 (4) is, and n5 (2) n1's; n5 has no child: emit the argmax after n5 (3)
    drafts = torch.tensor([[0, 4, 1, 0, 0, 2, 6]])
    path, num_accepted, final = tree_rejection_sample(p, PARENTS, drafts, None, torch.rand(1, 7), torch.rand(1))
    assert num_accepted.tolist() == [2] and path[0, :2].tolist() == [1, 5] and final.tolist() == [argmax[1 + 5]]
    # n0 matches and its child n3 too; n3's child n6 (1) is not the argmax after n3 (5): emit that
    drafts = torch.tensor([[4, 4, 4, 7, 2, 0, 1]])
    path, num_accepted, final = tree_rejection_sample(p, PARENTS, drafts, None, torch.rand(1, 7), torch.rand(1))
    assert path[0].tolist() == [0, 3, -1] and num_accepted.tolist() == [2] and final.tolist() == [argmax[1 + 3]]
    # nothing matches: the root's argmax
    drafts = torch.tensor([[0, 1, 2, 3, 4, 5, 6]])
    path, num_accepted, final = tree_rejection_sample(p, PARENTS, drafts, None, torch.rand(1, 7), torch.rand(1))
    assert num_accepted.tolist() == [0] and final.tolist() == [4]


def test_a_chain_tree_is_the_chain_sampler():
    g = torch.Generator().manual_seed(0)
    n, k, vocab_size = 5000, 3, 6
    p = (torch.randn(n, k + 1, vocab_size, generator=g) * 2).softmax(-1)
    q = (torch.randn(n, k, vocab_size, generator=g)).softmax(-1)
    drafts = torch.multinomial(q.view(-1, vocab_size), 1, generator=g).view(n, k)
    u, u_final = torch.rand(n, k, generator=g), torch.rand(n, generator=g)
    tokens, accepted = rejection_sample(p, drafts, torch.full((n,), k), q, u, u_final)
    path, num_accepted, final = tree_rejection_sample(p, [-1, 0, 1], drafts, q, u, u_final)
    assert torch.equal(num_accepted, accepted.long())
    assert torch.equal(final, tokens[torch.arange(n), accepted])
    assert all(path[i, :a].tolist() == list(range(a)) for i, a in enumerate(num_accepted.tolist()))


def _chi_square_p_value(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """The upper tail of the chi-square statistic of `tokens` against distribution p (rare cells pooled)."""
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    expected = p.double() * len(tokens)
    assert counts[p == 0].sum() == 0  # nothing outside the target's support
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    observed, expected = observed[expected > 0], expected[expected > 0]
    statistic = ((observed - expected) ** 2 / expected).sum()
    half_dof = torch.tensor((len(observed) - 1) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(half_dof, statistic / 2))


@pytest.mark.parametrize("drafts", ["sampled", "top-k"])
def test_the_emitted_tokens_are_distributed_as_p(drafts):
    g = torch.Generator().manual_seed(1 if drafts == "sampled" else 2)
    n, vocab_size, m = NUM_SAMPLES, 7, len(PARENTS)
    # one target distribution per tree position (as if the same context): row 0 at the root, j + 1 after node j
    p = (torch.randn(m + 1, vocab_size, generator=g) * 1.5).softmax(-1)
    p[:, 6] = 0  # a token the target never emits, which drafts may propose
    p = (p / p.sum(-1, keepdim=True))[None].expand(n, m + 1, vocab_size)
    if drafts == "sampled":  # siblings drawn independently from their parent's draft distribution
        q_at = (torch.randn(m + 1, vocab_size, generator=g)).softmax(-1)  # q_at[0]: the root's, [j + 1]: node j's
        q = torch.stack([q_at[parent + 1] for parent in PARENTS])[None].expand(n, m, vocab_size)
        ids = torch.multinomial(q.reshape(-1, vocab_size), 1, generator=g).view(n, m)
    else:  # each node's children: the draft's top tokens at that node (one context: the same in every row), one-hot
        q = None
        ranked = torch.randn(m + 1, vocab_size, generator=g).argsort(-1, descending=True)
        rank = [sum(1 for i in range(j) if PARENTS[i] == parent) for j, parent in enumerate(PARENTS)]
        ids = torch.stack([ranked[parent + 1, r] for parent, r in zip(PARENTS, rank, strict=True)]).expand(n, m)
    path, num_accepted, final = tree_rejection_sample(p, PARENTS, ids, q, torch.rand(n, m, generator=g),
                                                      torch.rand(n, generator=g))
    rows = torch.arange(n)
    first = torch.where(num_accepted > 0, ids[rows, path[:, 0].clamp(min=0)], final)
    assert _chi_square_p_value(first, p[0, 0]) > 1e-4
    # the second token, given that the first was root child c: distributed as p after c
    second = torch.where(num_accepted > 1, ids[rows, path[:, 1].clamp(min=0)], final)
    tested = 0
    for child in (j for j, parent in enumerate(PARENTS) if parent == -1):
        chosen = (num_accepted > 0) & (path[:, 0] == child)
        if chosen.sum() >= 200:  # a child the target rarely takes has too few samples to test
            assert _chi_square_p_value(second[chosen], p[0, child + 1]) > 1e-4, child
            tested += 1
    assert tested >= 2


def test_a_parent_after_its_child_is_refused():
    with pytest.raises(ValueError, match="parent 2 must be -1"):
        tree_rejection_sample(torch.ones(1, 4, 3) / 3, [-1, 2, 0], torch.zeros(1, 3, dtype=torch.long), None,
                              torch.rand(1, 3), torch.rand(1))
