"""The verification step alone (runtime/verifier.py): rejection sampling emits tokens distributed as the
target's p whatever the draft's q (dense or one-hot), greedy rows accept exactly while the draft equals
the argmax, and the bookkeeping of accepted counts and bonus tokens is exact."""

import pytest
import torch

from optc.runtime.sampler import SamplingParams
from optc.runtime.verifier import rejection_sample, target_probs

NUM_SAMPLES = 1_000_000


def tv_distance(token_ids: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(token_ids, minlength=p.numel()).double()
    return 0.5 * (counts / counts.sum() - p.double()).abs().sum().item()


def random_dist(g: torch.Generator, vocab_size: int, sharpness: float = 2.0) -> torch.Tensor:
    return (torch.randn(vocab_size, generator=g) * sharpness).softmax(-1)


@pytest.mark.parametrize("vocab_size", [5, 32])
@pytest.mark.parametrize("draft", ["dense", "one-hot", "one-hot-unlikely"])
def test_first_token_is_distributed_as_p(vocab_size, draft):
    g = torch.Generator().manual_seed(vocab_size)
    p1, p2, q1 = random_dist(g, vocab_size), random_dist(g, vocab_size), random_dist(g, vocab_size, 1.0)
    n = NUM_SAMPLES
    p = torch.stack([p1, p2])[None].expand(n, 2, vocab_size)
    if draft == "dense":  # x ~ q: accept with min(1, p/q), else the residual
        draft_ids = torch.multinomial(q1, n, replacement=True, generator=g)[:, None]
        q = q1[None, None].expand(n, 1, vocab_size)
    else:  # n-gram drafts: whatever token, a one-hot q
        q = None
        token = int(p1.argmax()) if draft == "one-hot" else int(p1.argmin())
        draft_ids = torch.full((n, 1), token)
    u_accept, u_resample = torch.rand(n, 1, generator=g), torch.rand(n, generator=g)
    token_ids, num_accepted = rejection_sample(p, draft_ids, torch.ones(n, dtype=torch.int64), q, u_accept, u_resample)
    assert tv_distance(token_ids[:, 0], p1) < 0.01
    # after an accepted draft the bonus token is drawn from the next position's p
    accepted = num_accepted == 1
    assert accepted.any()
    if accepted.sum() >= 100_000:  # enough samples for the bound (an unlikely one-hot draft is rarely accepted)
        assert tv_distance(token_ids[accepted, 1], p2) < 0.01
    if draft == "dense":  # the acceptance rate is sum_x min(p(x), q(x))
        assert accepted.double().mean().item() == pytest.approx(torch.minimum(p1, q1).sum().item(), abs=3e-3)


def test_later_positions_and_ragged_rows():
    """Two drafts per row: the second emitted token (given the first was accepted) is distributed as p_2;
    rows with 0 drafts just sample p_1."""
    g = torch.Generator().manual_seed(3)
    vocab_size, n = 6, NUM_SAMPLES
    ps = torch.stack([random_dist(g, vocab_size) for _ in range(3)])
    qs = torch.stack([random_dist(g, vocab_size, 1.0) for _ in range(2)])
    draft_ids = torch.stack([torch.multinomial(qs[i], n, replacement=True, generator=g) for i in range(2)], -1)
    num_drafts = torch.where(torch.arange(n) % 4 == 0, 0, 2)
    token_ids, num_accepted = rejection_sample(
        ps[None].expand(n, 3, vocab_size), draft_ids, num_drafts, qs[None].expand(n, 2, vocab_size),
        torch.rand(n, 2, generator=g), torch.rand(n, generator=g))
    assert (num_accepted <= num_drafts).all() and (num_accepted[num_drafts == 0] == 0).all()
    assert tv_distance(token_ids[:, 0], ps[0]) < 0.01
    second = num_accepted >= 1
    assert tv_distance(token_ids[second, 1], ps[1]) < 0.01
    assert (token_ids[second, 0] == draft_ids[second, 0]).all()


def test_greedy_accepts_while_the_draft_is_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 9.0]])
    p = target_probs(logits, [SamplingParams()] * 3)  # one-hot: 1, 0, 3
    assert p.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]]
    p = p[None]
    cases = [([1, 0], 2, [1, 0, 3]), ([1, 2], 1, [1, 0]), ([3, 0], 0, [1]), ([1], 1, [1, 0])]
    for drafts, accepted, emitted in cases:
        for q in (None, torch.full((1, 2, 4), 0.25)):  # q does not matter for a one-hot p
            ids = torch.tensor([drafts + [-1] * (2 - len(drafts))])
            u = torch.rand(1, 2)
            token_ids, num_accepted = rejection_sample(p, ids, torch.tensor([len(drafts)]), q, u, torch.rand(1))
            assert num_accepted.item() == accepted
            assert token_ids[0, : accepted + 1].tolist() == emitted


def test_equal_p_and_q_never_rejects_and_never_divides_by_zero():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])
    q = p[:, :1].clone()
    for token in (0, 1):
        token_ids, num_accepted = rejection_sample(
            p, torch.tensor([[token]]), torch.tensor([1]), q, torch.tensor([[0.999]]), torch.tensor([0.999]))
        assert num_accepted.item() == 1 and token_ids.tolist() == [[token, 2]]
    # a drafted token the target rules out (p = 0) is always rejected and never re-emitted
    token_ids, num_accepted = rejection_sample(
        p, torch.tensor([[2]]), torch.tensor([1]), None, torch.tensor([[0.0]]), torch.tensor([0.999]))
    assert num_accepted.item() == 0 and token_ids[0, 0].item() in (0, 1)


def test_target_probs_match_the_sampler():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.5, top_k=3), SamplingParams(temperature=1.0, top_p=0.5), SamplingParams()]
    probs = target_probs(logits, params)
    assert (probs[0] > 0).sum() == 3 and probs[0].sum().item() == pytest.approx(1.0)
    assert torch.allclose(probs[0][probs[0] > 0], (logits[0] / 0.5).topk(3).values.softmax(-1).sort(descending=True)
                          .values.gather(0, probs[0][probs[0] > 0].argsort(descending=True).argsort()))
    assert probs[2].tolist() == torch.nn.functional.one_hot(logits[2].argmax(), 10).float().tolist()
