"""Sampler: greedy, top-k / top-p masks, seeded and batch-independent sampling, params, stop strings."""

import math

import pytest
import torch

from optc.core.errors import InputError
from optc.runtime.sampler import SamplingParams, apply_top_k_top_p, sample

NEG_INF = float("-inf")


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_and_uses_no_randomness():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 4.9]])
    params = [SamplingParams(), SamplingParams(temperature=0.0, top_k=1, seed=3)]
    assert sample(logits, params, [None, None]).tolist() == [1, 0]


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert out.tolist() == [[NEG_INF, 4.0, NEG_INF, 3.0]]
    out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([1.0]))
    assert out.tolist() == logits.tolist()
    out = apply_top_k_top_p(logits, torch.tensor([9]), torch.tensor([1.0]))  # k > vocab: all kept
    assert out.tolist() == logits.tolist()


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    kept = lambda p: (apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([p])) > NEG_INF).tolist()[0]
    assert kept(0.75) == [True, True, False, False]  # 0.5 + 0.25 reaches 0.75
    assert kept(0.8) == [True, True, True, False]  # ties: the lower index first
    assert kept(0.1) == [True, False, False, False]  # the most likely token always survives
    assert kept(1.0) == [True, True, True, True]


def test_top_k_then_top_p_on_the_renormalized_survivors():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top-k 2 leaves 0.4 / 0.7 and 0.3 / 0.7; top-p 0.5 keeps only the first (4/7 >= 0.5).
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.5]))
    assert (out > NEG_INF).tolist() == [[True, False, False, False]]


def test_rows_have_their_own_masks():
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    out = apply_top_k_top_p(logits, torch.tensor([1, 0]), torch.tensor([1.0, 1.0]))
    assert (out > NEG_INF).tolist() == [[False, False, True], [True, True, True]]


def test_seeded_sampling_is_reproducible_and_batch_independent():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0.8, top_k=20, seed=7),
        SamplingParams(),
        SamplingParams(temperature=1.3, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, seed=2),
    ]

    def draws(rows: list[int], n: int = 8) -> list[list[int]]:
        gens = [generator(params[b].seed) if params[b].seed is not None else None for b in rows]
        return [sample(logits[rows], [params[b] for b in rows], gens).tolist() for _ in range(n)]

    together = draws([0, 1, 2, 3])
    alone = draws([0])
    assert [d[0] for d in together] == [d[0] for d in alone]
    assert [d[2] for d in together] == [d[0] for d in draws([2])]
    assert together == draws([0, 1, 2, 3])
    assert len({d[0] for d in together}) > 1  # it does sample


def test_sampling_never_picks_a_masked_token():
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0, -1.0]]).repeat(3, 1)
    params = [SamplingParams(temperature=2.0, top_k=2), SamplingParams(temperature=5.0, top_p=0.3)] * 2
    gens = [generator(i) for i in range(3)]
    seen = [set(), set(), set()]
    for _ in range(200):
        for b, t in enumerate(sample(logits, params[:3], gens).tolist()):
            seen[b].add(t)
    assert seen[0] == {0, 3} and seen[2] == {0, 3}
    assert seen[1] <= {0, 3} and 3 in seen[1]


def test_temperature_flattens_the_distribution():
    logits = torch.tensor([[math.log(0.9), math.log(0.1)]])
    count = lambda t: sum(
        sample(logits, [SamplingParams(temperature=t)], [g]).item() for g in [generator(0)] for _ in range(500)
    )
    assert count(0.5) < count(1.0) < count(4.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be finite and >= 0"),
        ({"temperature": float("inf")}, "temperature must be finite and >= 0"),
        ({"temperature": float("nan")}, "temperature must be finite and >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"stop": ("",)}, "non-empty strings"),
        ({"seed": 2**63}, r"seed must be in \[-9223372036854775808, 9223372036854775807\]"),
        ({"seed": -2**63 - 1}, r"seed must be in \[-9223372036854775808, 9223372036854775807\]"),
    ],
)
def test_invalid_params_raise_clear_errors(kwargs, message):
    with pytest.raises(InputError, match=message) as error:
        SamplingParams(**kwargs)
    assert error.value.field == next(iter(kwargs))  # what the server's 400 names as `param`


def test_a_temperature_too_small_to_divide_by_is_greedy():
    """logits / 2e-240 overflows to inf and softmax to NaN (multinomial raised): below GREEDY_BELOW is argmax."""
    from optc.runtime.sampler import GREEDY_BELOW

    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, 0.1, 0.2]])
    tiny = [SamplingParams(temperature=t, seed=1) for t in (2.07e-240, GREEDY_BELOW / 2)]
    assert all(p.is_greedy for p in tiny) and not SamplingParams(temperature=GREEDY_BELOW).is_greedy
    assert sample(logits, tiny, [None, None]).tolist() == [1, 0]


def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token():
    """top_p 5e-324 is 0 in float32: every token's mass before it reached it, so every token was dropped."""
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    kept = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([5e-324]))
    assert kept.isfinite().tolist() == [[False, True, False]]
    params = [SamplingParams(temperature=1.0, top_p=5e-324, seed=0)]
    assert sample(logits, params, [torch.Generator().manual_seed(0)]).tolist() == [1]


def test_params_defaults_and_stop_normalization():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.max_tokens, p.stop) == (0.0, 0, 1.0, None, 16, ())
    assert p.is_greedy
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
