"""What a first call of the weight-only quantized linears compiles on a cold cache (kernels/_splitk.py
`prune`, `first_call_compiles`), counted on the CPU. Each config Triton times it first compiles, ~1.5-2 s
for sm_90; an int8 end-to-end test on random:tiny spent > 90 s compiling on an H200 (2026-11-26), 72
configs and specializations by this count before `prune` dropped the tiles past the problem."""

import pytest

from optc.kernels import _splitk, w4a16, w8a16
from optc.kernels._splitk import config, first_call_compiles, prune

# random:tiny's linears (N, K): qkv, o, gate_up, down, and an int8 lm_head
TINY = [(128, 64), (64, 64), (256, 64), (64, 128), (256, 64)]
LLAMA = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # Llama-3-8B: qkv, o, gate_up, down


def _rule_one(configs, args, k_multiples):
    return [c for c in configs if all(args[a] % c.kwargs["BLOCK_K"] == 0 for a in k_multiples)]


def test_prune_drops_tiles_past_the_problem_and_pipelining_past_the_k_loop():
    configs = [config(16, n, k, 4, s) for n in (32, 64, 128) for k in (64, 128) for s in (2, 4)]
    # N = 40: BLOCK_N up to 64; K = 64 (one split): BLOCK_K 64 only, one K tile, so stages 2 and 4 are one
    kept = prune(configs, {"M": 3, "N": 40, "K": 64, "k_per_split": 128}, ("k_per_split",))
    assert [(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages) for c in kept] == [(32, 64, 2), (64, 64, 2)]
    # K = 4096 in splits of 512: eight 64-wide K tiles, four 128-wide: every depth pipelines something
    kept = prune(configs, {"M": 3, "N": 40, "K": 4096, "k_per_split": 512}, ("k_per_split",))
    assert len(kept) == 8 and {c.num_stages for c in kept} == {2, 4}
    # a lone config always survives (each config alone is how every config gets tested)
    lone = [config(128, 256, 128, 8, 4)]
    assert prune(lone, {"M": 2, "N": 3, "K": 64, "k_per_split": 64}, ()) == lone
    # the GEMM at M = 32: the 128-row tiles go, the 64-row ones stay; tl.dot's 16 rows are never cut
    gemm = [config(m, 64, 64, 4, 3) for m in (64, 128)]
    assert [c.kwargs["BLOCK_M"] for c in prune(gemm, {"M": 32, "N": 4096, "K": 4096, "k_per_split": 4096}, ())] == [64]
    assert prune(configs[:1], {"M": 1, "N": 4096, "K": 4096, "k_per_split": 512}, ()) == configs[:1]


def _count(module, shapes, ms, k_align, heuristic, k_multiples, **sizes) -> int:
    return len(first_call_compiles(module._KERNELS, [(m, n, k) for m in ms for n, k in shapes], k_align, heuristic,
                                   k_multiples, **sizes))


def test_int8_first_calls_at_random_tiny_shapes_compile_at_most_30_configs(monkeypatch):
    """The end-to-end tests' shapes, M = 1 .. 32 (chunked prefill of 32 tokens, decode of up to 5 requests):
    30 compiles, ~1 minute at 2 s each, where unpruned they were 72."""
    args = (w8a16, TINY, range(1, 33), w8a16.SPLIT_ALIGN, w8a16._split_k, ("k_per_split",))
    assert _count(*args) <= 30
    monkeypatch.setattr(_splitk, "prune", _rule_one)  # BLOCK_K dividing the split: the pruning before
    assert _count(*args) == 72


def test_int4_first_calls_at_random_tiny_shapes_compile_fewer(monkeypatch):
    def heuristic(n, k):
        return w4a16._split_k(n, k, 32)

    args = (w4a16, TINY, range(1, 33), 32, heuristic, ("group_size", "k_per_split"))
    assert _count(*args, group_size=32) <= 25
    monkeypatch.setattr(_splitk, "prune", _rule_one)
    assert _count(*args, group_size=32) == 35


@pytest.mark.parametrize("m", [1, 8, 512])
def test_decode_and_prefill_at_llama_shapes_keep_their_whole_search(m):
    """Where speed is measured (Llama-3-8B at M = 1, 8, 512) the pruning removes nothing the autotuner
    could have picked: every config that fits the K split stays."""
    for module, k_multiples, sizes, align, heuristic in (
            (w8a16, ("k_per_split",), {}, w8a16.SPLIT_ALIGN, w8a16._split_k),
            (w4a16, ("group_size", "k_per_split"), {"group_size": 128}, 128, lambda n, k: w4a16._split_k(n, k, 128))):
        tuner = module._KERNELS.for_rows(m)
        for n, k in LLAMA:
            _, k_per_split = _splitk.splits(m, n, k, None, align, heuristic)
            args = {"M": m, "N": n, "K": k, "k_per_split": k_per_split, **sizes}
            assert prune(tuner.configs, args, k_multiples) == _rule_one(tuner.configs, args, k_multiples)
