"""Triton paged_decode / paged_prefill against paged_attention_ref (interpreter on the CPU).

Caches hold random K/V in shuffled blocks; block 0 (the null block) is filled with garbage that no
request may read. Sequence and query lengths are ragged and not multiples of the block or tile.
"""

import numpy as np
import pytest
import torch

from optc.core.kv_cache import QMAX, STORAGE_DTYPES, KVCache, dequantize, quantize
from optc.core.ops.attention import paged_attention_ref, paged_attention_sdpa
from optc.kernels.attention import paged_attention
from optc.kernels.paged_decode import paged_decode
from optc.kernels.paged_prefill import paged_prefill
from optc.runtime.batch import tree_rows

GQA = [(2, 2), (6, 2), (8, 2), (8, 1)]  # (H_q, H_kv): ratios 1, 3, 4, 8


def assert_close(actual, expected, atol, rtol=0.0):
    diff = (actual.float() - expected.float()).abs()
    ok = torch.allclose(actual.float(), expected.float(), atol=atol, rtol=rtol)
    assert ok, f"max diff {diff.max().item():.3g}, mean diff {diff.mean().item():.3g}"


def _case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks_per_request = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_request)
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    cache[0] = 1e4  # the null block: any read of it shows in the output
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).int()
    width = max(blocks_per_request) + 1
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_request):
        tables[b, :n] = perm[used:used + n]
        used += n
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), num_heads, head_dim, generator=g).to(dtype)
    return q, cache, tables, torch.tensor(seq_lens, dtype=torch.int32), starts


TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_kernel_matches_ref(num_heads, num_kv_heads, block_size, num_splits):
    seq_lens = [1, 37, 150, 64]
    args = _case(seq_lens, [1] * 4, num_heads, num_kv_heads, 32, block_size, torch.float32)
    out = paged_decode(*args, 0.2, num_splits=num_splits)
    assert_close(out, paged_attention_ref(*args, 0.2), TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_decode_kernel_half_precision_and_default_splits(dtype):
    args = _case([300, 5, 129], [1, 1, 1], 8, 2, 16, 16, dtype, seed=1)
    assert_close(paged_decode(*args, 0.25), paged_attention_ref(*args, 0.25), TOL[dtype])


def _launched_programs(monkeypatch):
    """The (request, KV head, split) grids paged_decode launches its decode kernel with."""
    from optc.kernels import paged_decode as module

    grids, kernel = [], module._decode_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid({}))
            return kernel[grid]

    monkeypatch.setattr(module, "_decode_kernel", Spy())
    return grids


def test_paged_decode_fills_the_gpu_at_batch_1_long_context():
    # Llama-3-8B at batch 1: 8 KV heads, 4,096 tokens of context; an H100 has 132 SMs
    from optc.kernels.paged_decode import MIN_SPLIT_TOKENS, TARGET_PROGRAMS, split_shape

    num_splits, tokens = split_shape(8, 4096)
    assert 8 * num_splits >= 3 * 132 and num_splits * tokens >= 4096 > (num_splits - 1) * tokens
    assert tokens >= MIN_SPLIT_TOKENS
    assert split_shape(TARGET_PROGRAMS, 4096) == (1, 4096)  # enough groups fill the GPU without splits
    assert split_shape(8, 100) == (2, 64)  # a short context: no split under MIN_SPLIT_TOKENS


def test_paged_decode_default_small_splits_match_ref(monkeypatch):
    # batch 1, 2 KV heads, 700 tokens: the heuristic takes 11 splits of 64 tokens (one inner step each)
    grids = _launched_programs(monkeypatch)
    args = _case([700], [1], 8, 2, 16, 16, torch.float32, seed=3)
    assert_close(paged_decode(*args, 0.2, max_seq_len=700), paged_attention_ref(*args, 0.2), TOL[torch.float32])
    assert grids == [(1, 2, 11)]


def test_paged_decode_kernel_more_splits_than_tokens_and_empty_request():
    # splits past a short request's end are empty; seq_len 0 (a padded batch slot) gives zeros
    args = _case([3, 200, 1], [1, 1, 1], 4, 4, 16, 16, torch.float32, seed=2)
    q, cache, tables, seq_lens, starts = args
    out = paged_decode(*args, 0.3, num_splits=4)
    assert_close(out, paged_attention_ref(*args, 0.3), 1e-4)
    seq_lens0 = torch.tensor([3, 0, 1], dtype=torch.int32)
    out0 = paged_decode(q, cache, tables, seq_lens0, starts, 0.3, num_splits=2)
    assert torch.equal(out0[1], torch.zeros_like(out0[1]))
    assert_close(out0[0], out[0], 1e-6)


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_prefill_kernel_matches_ref(num_heads, num_kv_heads, block_size):
    # request 0: a plain prompt; 1: a chunk after 40 context tokens; 2: decode; 3: nothing scheduled
    seq_lens, query_lens = [23, 57, 70, 9], [23, 17, 1, 0]
    args = _case(seq_lens, query_lens, num_heads, num_kv_heads, 32, block_size, torch.float32, seed=3)
    assert_close(paged_prefill(*args, 0.2), paged_attention_ref(*args, 0.2), TOL[torch.float32])


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens", [[23, 17, 1, 0], [1, 1, 1, 1]], ids=["mixed", "decode"])
def test_paged_attention_sdpa_matches_ref(num_heads, num_kv_heads, block_size, dtype, query_lens):
    # the torch-bound runtime path: prompt, chunk after context, decode, nothing scheduled; and a decode step
    seq_lens = [23, 57, 70, 9]
    args = _case(seq_lens, query_lens, num_heads, num_kv_heads, 32, block_size, dtype, seed=5)
    assert_close(paged_attention_sdpa(*args, 0.2), paged_attention_ref(*args, 0.2), TOL[dtype])


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_sdpa_decode_step_is_the_reference_math(kv_dtype, dtype):
    # a decode step whose caller passes the longest context as an int: the reference's fp32 math,
    # so equal to it up to fp32 reassociation (at most one step of a bf16 output), whatever the cache dtype
    args = _case([23, 57, 70, 9], [1] * 4, 9, 3, 64, 16, dtype, seed=9)
    q, data, tables, seq_lens, starts, *scales = args if kv_dtype is None else _quantized(args, kv_dtype)
    scales = scales[0] if scales else None
    out = paged_attention_sdpa(q, data, tables, seq_lens, starts, 0.2, max_query_len=1, max_seq_len=70,
                               kv_scales=scales)
    ref = paged_attention_ref(q, data, tables, seq_lens, starts, 0.2, scales)
    assert out.dtype == dtype
    assert_close(out, ref, 1e-6, rtol=0.0 if dtype == torch.float32 else 2**-8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_prefill_kernel_half_precision(dtype):
    args = _case([45, 80], [45, 33], 6, 2, 16, 16, dtype, seed=4)
    assert_close(paged_prefill(*args, 0.25, max_query_len=45), paged_attention_ref(*args, 0.25), TOL[dtype])


def _tree_case(dtype, seed):
    """A batch beside draft trees: a 20-row causal chunk with causal bits, an 11-row tree after 100 context
    tokens, a decode row, a 64-row tree (bit 63: the sign bit) and a 70-row prompt without bits (too long
    for a tree: causal); random parents, each before its children. Returns (args, tree_mask)."""
    g = torch.Generator().manual_seed(seed)
    masks = [(2 << i) - 1 for i in range(20)]
    for n in (11, 1, 64):
        parents = [int(torch.randint(-1, j, (1,), generator=g)) for j in range(n - 1)]
        masks += tree_rows(parents)[1]
    masks += [0] * 70
    args = _case([60, 111, 30, 90, 70], [20, 11, 1, 64, 70], 8, 2, 32, 16, dtype, seed=seed)
    return args, torch.tensor(np.array(masks, dtype=np.uint64).view(np.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_kernel_takes_draft_trees_like_ref(dtype):
    """Draft trees through the Triton launcher (the attention op's `tree_mask`) against the reference; the
    trees' rows differ from causal attention's, so a kernel that ignored the mask fails."""
    args, tree_mask = _tree_case(dtype, seed=6)
    expected = paged_attention_ref(*args, 0.2, tree_mask=tree_mask)
    out = paged_prefill(*args, 0.2, max_query_len=70, tree_mask=tree_mask)
    assert_close(out, expected, TOL[dtype])
    causal = paged_attention_ref(*args, 0.2)
    trees = torch.zeros(len(tree_mask), dtype=torch.bool)
    trees[20:31] = trees[32:96] = True
    assert torch.equal(out[~trees], paged_prefill(*args, 0.2)[~trees])
    assert (out[trees] - causal[trees]).abs().amax() > 10 * TOL[dtype]
    q, cache, tables, seq_lens, starts = args  # the op's launcher routes trees to paged_prefill
    kv = KVCache(cache)
    out_op = paged_attention(q, None, None, kv, None, tables, seq_lens, starts, 0.2, tree_mask=tree_mask)
    assert torch.equal(out_op, out)


def test_paged_prefill_kernel_rejects_bad_gqa():
    q, cache, tables, seq_lens, starts = _case([5], [5], 4, 4, 16, 16, torch.float32)
    with pytest.raises(AssertionError, match="multiple of H_kv"):
        paged_prefill(q[:, :3], cache, tables, seq_lens, starts, 0.1)


def _quantized(args, kv_dtype):
    """A `_case` with its cache quantized per (token, KV head): (q, data, tables, seq_lens, starts, scales)."""
    q, cache, tables, seq_lens, starts = args
    data, scales = quantize(cache, STORAGE_DTYPES[kv_dtype], QMAX[kv_dtype])
    return q, data, tables, seq_lens, starts, scales


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (8, 1)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_kernel_reads_quantized_kv_like_ref(kv_dtype, num_heads, num_kv_heads, num_splits):
    q, data, tables, seq_lens, starts, scales = _quantized(
        _case([1, 37, 150, 64], [1] * 4, num_heads, num_kv_heads, 32, 16, torch.float32, seed=6), kv_dtype)
    out = paged_decode(q, data, tables, seq_lens, starts, 0.2, scales, num_splits=num_splits)
    ref = paged_attention_ref(q, data, tables, seq_lens, starts, 0.2, scales)
    assert_close(out, ref, TOL[torch.float32])
    # the reference reads value * scale: the same as attending over the dequantized cache
    float_cache = dequantize(data, scales, torch.float32)
    assert_close(ref, paged_attention_ref(q, float_cache, tables, seq_lens, starts, 0.2), 1e-6)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_prefill_kernel_reads_quantized_kv_like_ref(kv_dtype, dtype, block_size):
    # a prompt, a chunk after context, a decode, nothing scheduled; q in the model dtype, K/V quantized
    q, data, tables, seq_lens, starts, scales = _quantized(
        _case([23, 57, 70, 9], [23, 17, 1, 0], 6, 2, 32, block_size, dtype, seed=7), kv_dtype)
    out = paged_prefill(q, data, tables, seq_lens, starts, 0.2, scales)
    assert out.dtype == dtype
    assert_close(out, paged_attention_ref(q, data, tables, seq_lens, starts, 0.2, scales), TOL[dtype])


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens", [[23, 17, 1, 0], [1, 1, 1, 1]], ids=["mixed", "decode"])
def test_paged_attention_sdpa_reads_quantized_kv_like_ref(kv_dtype, dtype, query_lens):
    args = _quantized(_case([23, 57, 70, 9], query_lens, 8, 2, 32, 16, dtype, seed=8), kv_dtype)
    q, data, tables, seq_lens, starts, scales = args
    out = paged_attention_sdpa(q, data, tables, seq_lens, starts, 0.2, kv_scales=scales)
    assert_close(out, paged_attention_ref(q, data, tables, seq_lens, starts, 0.2, scales), TOL[dtype])


def test_paged_kernels_refuse_a_quantized_cache_without_scales():
    q, data, tables, seq_lens, starts, _ = _quantized(_case([5], [5], 4, 4, 16, 16, torch.float32), "int8")
    with pytest.raises(AssertionError, match="needs its kv_scales"):
        paged_prefill(q, data, tables, seq_lens, starts, 0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 32, 128), (9, 3, 64), (32, 8, 128), (64, 8, 128)])
def test_paged_attention_kernels_on_cuda(dtype, block_size, num_heads, num_kv_heads, head_dim):
    # GQA ratios 1, 3, 4, 8; decode with the split heuristic at 4096 tokens and ragged lengths, then
    # prefill and chunked prefill (query shorter than context)
    scale, tol = head_dim**-0.5, TOL[dtype]
    args = [a.cuda() for a in _case([4096, 513, 77, 1], [1, 1, 1, 1], num_heads, num_kv_heads, head_dim,
                                    block_size, dtype)]
    assert_close(paged_decode(*args, scale), paged_attention_ref(*args, scale), tol)
    assert_close(paged_decode(*args, scale, num_splits=7), paged_attention_ref(*args, scale), tol)
    args = [a.cuda() for a in _case([700, 300, 33], [700, 45, 1], num_heads, num_kv_heads, head_dim,
                                    block_size, dtype)]
    assert_close(paged_prefill(*args, scale), paged_attention_ref(*args, scale), tol)
    for kv_dtype in ("int8", "fp8_e4m3"):
        q, data, tables, seq_lens, starts, scales = _quantized(args, kv_dtype)
        quantized = (q, data, tables, seq_lens, starts, scale, scales)
        assert_close(paged_prefill(*quantized), paged_attention_ref(*quantized), tol)
        decode = [a.cuda() for a in _quantized(_case([4096, 513, 77, 1], [1, 1, 1, 1], num_heads, num_kv_heads,
                                                     head_dim, block_size, dtype), kv_dtype)]
        decode.insert(5, scale)
        assert_close(paged_decode(*decode), paged_attention_ref(*decode), tol)
