"""Triton paged_prefill / paged_decode with the family attributes against paged_attention_ref
(interpreter on the CPU): soft-capped scores (Gemma 2), sliding windows shorter and longer than a
block (Gemma 2 and 3), both together, GQA groups, int8 / fp8 caches, and head dims that are not a
power of two (Phi-3's 96, here 24) or the largest tile (Gemma's 256).

A sliding layer's blocks wholly before the window start of a request's first query hold the null
block (id 0) in its table, as the runtime leaves them once it frees them. The kernels read a cache
whose null block is NaN: any read of it that reached the output, even multiplied by a zero
probability, would show. The reference reads the same tables over a finite null block (it gathers
every block and masks).
"""

import pytest
import torch

from optc.core.ops.attention import paged_attention_ref
from optc.kernels.paged_decode import paged_decode
from optc.kernels.paged_prefill import paged_prefill
from tests.test_kernels_attention import TOL, _case, _launched_programs, _quantized, assert_close

# a prompt, a chunk after 40 context tokens, a decode, nothing scheduled; request 0 has more queries
# than one step of keys (32) plus the window, so a prefill tile's later rows see no key in its first step
SEQ_LENS, QUERY_LENS = [50, 57, 70, 9], [50, 17, 1, 0]
DECODE_LENS = [1, 37, 150, 64]
SCORES = [(None, None), (2.0, None), (None, 5), (None, 40), (2.0, 5), (3.0, 40)]  # (softcap, window)
IDS = ["plain", "softcap", "window5", "window40", "softcap-window5", "softcap-window40"]


def _freed(args, window, query_lens):
    """`args` with the blocks wholly before each request's window start (its first query's) set to the
    null block in a copy of the tables, and, for the kernels, a copy of the cache whose null block is NaN.
    Returns (kernel args, reference args)."""
    q, cache, tables, seq_lens, starts, *scales = args
    tables = tables.clone()
    block_size = cache.shape[2]
    if window is not None:
        for b, (s, n) in enumerate(zip(seq_lens.tolist(), query_lens, strict=True)):
            first = max(s - n - window + 1, 0)  # the first key the request's first query sees
            tables[b, : first // block_size] = 0
    poisoned = cache.clone()
    if poisoned.dtype.is_floating_point:
        poisoned[0] = float("nan")
    else:  # an int8 cache: its scales carry the NaN
        scales = [scales[0].clone()]
        scales[0][0] = float("nan")
    ref_scales = args[5:]
    return (q, poisoned, tables, seq_lens, starts, *scales), (q, cache, tables, seq_lens, starts, *ref_scales)


def _prefill_and_ref(args, scale, softcap, window, query_lens=QUERY_LENS):
    kernel_args, ref_args = _freed(args, window, query_lens)
    q, cache, tables, seq_lens, starts, *scales = kernel_args
    out = paged_prefill(q, cache, tables, seq_lens, starts, scale, *scales, softcap=softcap, window=window)
    q, cache, tables, seq_lens, starts, *scales = ref_args
    return out, paged_attention_ref(q, cache, tables, seq_lens, starts, scale, *(scales or [None]), softcap=softcap,
                                    window=window)


def _decode_and_ref(args, scale, softcap, window, **kwargs):
    kernel_args, ref_args = _freed(args, window, [1] * args[3].shape[0])
    q, cache, tables, seq_lens, starts, *scales = kernel_args
    out = paged_decode(q, cache, tables, seq_lens, starts, scale, *scales, softcap=softcap, window=window, **kwargs)
    q, cache, tables, seq_lens, starts, *scales = ref_args
    return out, paged_attention_ref(q, cache, tables, seq_lens, starts, scale, *(scales or [None]), softcap=softcap,
                                    window=window)


@pytest.mark.parametrize("softcap,window", SCORES, ids=IDS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)])
def test_paged_prefill_softcap_and_window_match_ref(softcap, window, num_heads, num_kv_heads):
    args = _case(SEQ_LENS, QUERY_LENS, num_heads, num_kv_heads, 32, 16, torch.float32, seed=11)
    out, ref = _prefill_and_ref(args, 0.5, softcap, window)
    assert_close(out, ref, TOL[torch.float32])


@pytest.mark.parametrize("softcap,window", SCORES, ids=IDS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_softcap_and_window_match_ref(softcap, window, num_splits):
    args = _case(DECODE_LENS, [1] * 4, 8, 2, 32, 16, torch.float32, seed=12)
    out, ref = _decode_and_ref(args, 0.5, softcap, window, num_splits=num_splits)
    assert_close(out, ref, TOL[torch.float32])


def test_the_soft_cap_bounds_the_scores_it_changes():
    # large scores (scale 4): capped at 2 they attend almost evenly, uncapped almost one-hot; the kernel
    # follows the capped reference, which differs from the uncapped one
    args = _case([40], [40], 4, 2, 32, 16, torch.float32, seed=13)
    out, ref = _prefill_and_ref(args, 4.0, 2.0, None, [40])
    assert_close(out, ref, TOL[torch.float32])
    assert (ref - paged_attention_ref(*args, 4.0)).abs().max() > 0.5


def test_paged_decode_splits_only_the_window(monkeypatch):
    # batch 1, 2 KV heads, 700 tokens, a 64-token window: one split of one step, not 11 over the context
    from optc.kernels.paged_decode import MIN_SPLIT_TOKENS

    grids = _launched_programs(monkeypatch)
    args = _case([700], [1], 8, 2, 16, 16, torch.float32, seed=14)
    out, ref = _decode_and_ref(args, 0.2, None, MIN_SPLIT_TOKENS, max_seq_len=700)
    assert_close(out, ref, TOL[torch.float32])
    assert grids == [(1, 2, 1)]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("softcap,window", [(None, 5), (2.0, 40)], ids=["window5", "softcap-window40"])
def test_paged_kernels_read_quantized_kv_with_a_window_like_ref(kv_dtype, softcap, window):
    args = _quantized(_case(SEQ_LENS, QUERY_LENS, 6, 2, 32, 16, torch.float32, seed=15), kv_dtype)
    out, ref = _prefill_and_ref(args, 0.5, softcap, window)
    assert_close(out, ref, TOL[torch.float32])
    args = _quantized(_case(DECODE_LENS, [1] * 4, 6, 2, 32, 16, torch.float32, seed=16), kv_dtype)
    out, ref = _decode_and_ref(args, 0.5, softcap, window, num_splits=2)
    assert_close(out, ref, TOL[torch.float32])


@pytest.mark.parametrize("head_dim,dtype", [(24, torch.float32), (24, torch.bfloat16), (256, torch.float16)])
def test_paged_kernels_head_dims_padded_or_largest(head_dim, dtype):
    # 24 pads to a 32-wide tile with masked columns (as Phi-3's 96 pads to 128); 256 is Gemma's, with
    # its own prefill tile; a block of 32 with a window of 33 (Gemma 3 270M's shape: 4 heads over 1)
    scale = head_dim ** -0.5
    args = _case([45, 80], [45, 33], 4, 1, head_dim, 32, dtype, seed=17)
    out, ref = _prefill_and_ref(args, scale, 50.0, 33, [45, 33])
    assert_close(out, ref, TOL[dtype])
    args = _case([45, 80], [1, 1], 4, 1, head_dim, 32, dtype, seed=18)
    out, ref = _decode_and_ref(args, scale, 50.0, 33)
    assert_close(out, ref, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,softcap,window", [
    (4, 1, 256, None, 512),  # Gemma 3 270M local layers
    (8, 4, 256, 50.0, 4096),  # Gemma 2 2B local layers
    (8, 4, 256, 50.0, None),  # Gemma 2 2B global layers
    (16, 8, 128, None, None),  # Qwen3
    (32, 32, 96, None, None),  # Phi-3-mini
])
def test_paged_attention_family_shapes_on_cuda(dtype, num_heads, num_kv_heads, head_dim, softcap, window):
    scale, tol = head_dim ** -0.5, TOL[dtype]
    cuda = lambda t: tuple(a.cuda() for a in t)  # noqa: E731
    for kv_dtype in (None, "int8", "fp8_e4m3"):
        args = _case([5000, 700, 33], [700, 45, 1], num_heads, num_kv_heads, head_dim, 16, dtype)
        args = args if kv_dtype is None else _quantized(args, kv_dtype)
        kernel_args, ref_args = (cuda(a) for a in _freed(args, window, [700, 45, 1]))
        out = paged_prefill(*kernel_args[:5], scale, *kernel_args[5:], softcap=softcap, window=window)
        ref = paged_attention_ref(*ref_args[:5], scale, *(ref_args[5:] or [None]), softcap=softcap, window=window)
        assert_close(out, ref, tol)
        args = _case([5000, 513, 77, 1], [1] * 4, num_heads, num_kv_heads, head_dim, 16, dtype)
        args = args if kv_dtype is None else _quantized(args, kv_dtype)
        kernel_args, ref_args = (cuda(a) for a in _freed(args, window, [1] * 4))
        ref = paged_attention_ref(*ref_args[:5], scale, *(ref_args[5:] or [None]), softcap=softcap, window=window)
        for num_splits in (None, 7):
            out = paged_decode(*kernel_args[:5], scale, *kernel_args[5:], softcap=softcap, window=window,
                               num_splits=num_splits)
            assert_close(out, ref, tol)
