"""Triton rope / rope_kv_store / kv_store against their references (interpreter on the CPU)."""

import pytest
import torch

from optc.core.kv_cache import QMAX, STORAGE_DTYPES, KVCache
from optc.core.ops.attention import kv_store_ref
from optc.core.ops.rope import rope_kv_store_ref, rope_ref
from optc.kernels.rope import kv_store, rope, rope_kv_store


def assert_close(actual, expected, atol, rtol=0.0):
    diff = (actual.float() - expected.float()).abs()
    ok = torch.allclose(actual.float(), expected.float(), atol=atol, rtol=rtol)
    assert ok, f"max diff {diff.max().item():.3g}, mean diff {diff.mean().item():.3g}"


def _cos_sin(num_positions, head_dim):
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    f = torch.outer(torch.arange(num_positions).float(), inv)
    return torch.cat((f.cos(), f.sin()), dim=-1)


# bf16: the interpreter's fp32 -> bf16 cast truncates (one ulp = 2**-7 relative)
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_kernel_matches_ref(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 3, 32, generator=g).to(dtype)
    pos = torch.randint(0, 50, (11,), generator=g)
    assert_close(rope(x, pos, _cos_sin(50, 32)), rope_ref(x, pos, _cos_sin(50, 32)), *TOL[dtype])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float32)])
def test_rope_kv_store_kernel_matches_ref(num_heads, num_kv_heads, block_size, dtype, cache_dtype):
    g = torch.Generator().manual_seed(1)
    num_tokens, head_dim = 13, 16
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    pos = torch.randint(0, 40, (num_tokens,), generator=g)
    slots = torch.randperm(4 * block_size, generator=g)[:num_tokens] + block_size  # block 0 untouched
    slots[3] = -1  # a padding token: nothing stored
    cos_sin = _cos_sin(40, head_dim)
    cache = torch.zeros(5, 2, block_size, num_kv_heads, head_dim, dtype=cache_dtype)
    cache_ref = cache.clone()
    q_out = rope_kv_store(q, k, v, pos, cos_sin, KVCache(cache), slots)
    q_ref = rope_kv_store_ref(q, k, v, pos, cos_sin, KVCache(cache_ref), slots)
    assert_close(q_out, q_ref, *TOL[dtype])
    assert_close(cache, cache_ref, *TOL[dtype])
    assert torch.equal(cache == 0, cache_ref == 0)  # exactly the same slots written


def test_rope_kv_store_kernel_reads_strided_qkv_views():
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(7, (4 + 2 + 2) * 16, generator=g)  # a fused QKV output, split into views
    q, k, v = (t.view(7, -1, 16) for t in qkv.split([64, 32, 32], dim=-1))
    pos, slots, cos_sin = torch.arange(7), torch.arange(16, 23), _cos_sin(8, 16)
    cache, cache_ref = torch.zeros(3, 2, 16, 2, 16), torch.zeros(3, 2, 16, 2, 16)
    out = rope_kv_store(q, k, v, pos, cos_sin, KVCache(cache), slots)
    ref = rope_kv_store_ref(q, k, v, pos, cos_sin, KVCache(cache_ref), slots)
    assert_close(out, ref, 1e-5)
    assert_close(cache, cache_ref, 1e-5)


def test_kv_store_kernel_matches_ref():
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(9, 3, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    slots = torch.tensor([32, 33, 34, -1, 64, 65, 40, 41, -1])
    cache, cache_ref = torch.zeros(4, 2, 32, 3, 32, dtype=torch.bfloat16), torch.zeros(4, 2, 32, 3, 32,
                                                                                      dtype=torch.bfloat16)
    kv_store(k, v, KVCache(cache), slots)
    kv_store_ref(k, v, KVCache(cache_ref), slots)
    assert torch.equal(cache, cache_ref)  # a copy: bit-exact


def _quantized_cache(kv_dtype, num_blocks, block_size, num_kv_heads, head_dim, device="cpu"):
    data = torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=STORAGE_DTYPES[kv_dtype],
                       device=device)
    return KVCache(data, torch.zeros(data.shape[:4], device=device), QMAX[kv_dtype])


def assert_same_stored(cache: KVCache, ref: KVCache):
    """The kernel's int8 / fp8 cache holds the reference's values and scales.

    fp8 under the interpreter: its fp32 -> e4m3 conversion (triton/runtime/interpreter.py
    `_convert_float`) drops the carry when rounding up crosses a power of two (31.6 -> 16, not 32)
    and rounds ties up rather than to even, and subnormals (below 2**-6) off; those elements, and
    only those, may differ: half the reference's value, or one e4m3 step apart (2**-3 of the binade,
    2**-9 below 2**-6). Compiled, the conversion is round-to-nearest-even and the store exact.
    """
    assert torch.equal(cache.scales, ref.scales)
    got, want = cache.data.float(), ref.data.float()
    differ = got != want
    if cache.data.dtype == torch.float8_e4m3fn and triton_interpreting():
        carry = (got == want / 2) & (want.abs().log2() == want.abs().log2().round())
        step = torch.exp2(want.abs().clamp(min=2**-6).log2().floor() - 3)
        other = differ & ~carry & ((got - want).abs() > step)
        assert not other.any(), f"{int(other.sum())} elements differ"
        assert differ.float().mean() < 0.05
    else:
        assert not differ.any(), f"{int(differ.sum())} of {differ.numel()} elements differ"


def triton_interpreting() -> bool:
    from optc.kernels._dot import interpreting

    return interpreting()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (8, 1)])
def test_rope_kv_store_kernel_quantizes_like_ref(kv_dtype, dtype, num_heads, num_kv_heads):
    # each (token, KV head) row quantized with its own absmax scale; a padding token and a zero row
    g = torch.Generator().manual_seed(4)
    num_tokens, head_dim, block_size = 13, 32, 16
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    k, v = ((torch.randn(num_tokens, num_kv_heads, head_dim, generator=g) * 3).to(dtype) for _ in range(2))
    v[5] = 0  # a zero row: scale 0, stored zeros
    pos = torch.randint(0, 40, (num_tokens,), generator=g)
    slots = torch.randperm(3 * block_size, generator=g)[:num_tokens] + block_size
    slots[3] = -1
    cache, ref = (_quantized_cache(kv_dtype, 4, block_size, num_kv_heads, head_dim) for _ in range(2))
    q_out = rope_kv_store(q, k, v, pos, _cos_sin(40, head_dim), cache, slots)
    q_ref = rope_kv_store_ref(q, k, v, pos, _cos_sin(40, head_dim), ref, slots)
    assert_close(q_out, q_ref, *TOL[dtype])
    assert_same_stored(cache, ref)
    assert (ref.scales[slots[5] // block_size, 1, slots[5] % block_size] == 0).all()
    assert (ref.scales[0] == 0).all() and int((ref.scales[:, 0] > 0).sum()) == (num_tokens - 1) * num_kv_heads


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_kv_store_kernel_quantizes_like_ref(kv_dtype):
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(9, 3, 32, generator=g) * 10 for _ in range(2))
    slots = torch.tensor([32, 33, 34, -1, 64, 65, 40, 41, -1])
    cache, ref = (_quantized_cache(kv_dtype, 4, 32, 3, 32) for _ in range(2))
    kv_store(k, v, cache, slots)
    kv_store_ref(k, v, ref, slots)
    assert_same_stored(cache, ref)


# partial rotary (head_dim, rotary width): Phi-4-mini's 96 of 128 shrunk; a head dim that is not a power
# of two (Phi-3's 96, here 24); phi3-tiny's 12 of 16
PARTIAL = [(32, 24), (24, 16), (16, 12)]


@pytest.mark.parametrize("head_dim,rotary", PARTIAL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kernel_partial_rotary_matches_ref(head_dim, rotary, dtype):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(11, 3, head_dim, generator=g).to(dtype)
    pos = torch.randint(0, 50, (11,), generator=g)
    out = rope(x, pos, _cos_sin(50, rotary))
    assert_close(out, rope_ref(x, pos, _cos_sin(50, rotary)), *TOL[dtype])
    assert torch.equal(out[..., rotary:], x[..., rotary:])  # the dims past the rotary width pass through
    assert not torch.equal(out[..., :rotary], x[..., :rotary])


@pytest.mark.parametrize("head_dim,rotary", PARTIAL)
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_rope_kv_store_kernel_partial_rotary_matches_ref(head_dim, rotary, kv_dtype):
    # k rotates its first `rotary` dims, v none; an int8 row's absmax covers the whole head
    g = torch.Generator().manual_seed(7)
    num_tokens, num_kv_heads, block_size = 13, 2, 16
    q = torch.randn(num_tokens, 6, head_dim, generator=g)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=g) * 3 for _ in range(2))
    k[:, :, -1] = 20.0  # the largest |k| of each row is a pass-through dim
    pos = torch.randint(0, 40, (num_tokens,), generator=g)
    slots = torch.randperm(3 * block_size, generator=g)[:num_tokens] + block_size
    slots[3] = -1
    cos_sin = _cos_sin(40, rotary)
    if kv_dtype is None:
        cache, ref = (KVCache(torch.zeros(4, 2, block_size, num_kv_heads, head_dim)) for _ in range(2))
    else:
        cache, ref = (_quantized_cache(kv_dtype, 4, block_size, num_kv_heads, head_dim) for _ in range(2))
    assert_close(rope_kv_store(q, k, v, pos, cos_sin, cache, slots),
                 rope_kv_store_ref(q, k, v, pos, cos_sin, ref, slots), *TOL[torch.float32])
    if kv_dtype is None:
        assert_close(cache.data, ref.data, *TOL[torch.float32])
        assert torch.equal(cache.data == 0, ref.data == 0)
    else:
        assert_same_stored(cache, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary", [(24, 8, 128, 96), (32, 32, 96, 96), (8, 4, 256, 256)])
def test_rope_kv_store_family_shapes_on_cuda(dtype, kv_dtype, heads, kv_heads, head_dim, rotary):
    # Phi-4-mini (partial rotary), Phi-3-mini (head dim 96), Gemma 2 2B (head dim 256)
    g = torch.Generator().manual_seed(heads)
    q = torch.randn(20, heads, head_dim, generator=g).to(dtype).cuda()
    k, v = (torch.randn(20, kv_heads, head_dim, generator=g).to(dtype).cuda() for _ in range(2))
    pos = torch.randint(0, 4000, (20,), generator=g).cuda()
    slots = torch.arange(16, 36).cuda()
    slots[[3, 11]] = -1
    cos_sin = _cos_sin(4096, rotary).cuda()
    if kv_dtype is None:
        cache, ref = (KVCache(torch.zeros(4, 2, 16, kv_heads, head_dim, device="cuda", dtype=dtype)) for _ in range(2))
    else:
        cache, ref = (_quantized_cache(kv_dtype, 4, 16, kv_heads, head_dim, "cuda") for _ in range(2))
    assert_close(rope_kv_store(q, k, v, pos, cos_sin, cache, slots),
                 rope_kv_store_ref(q, k, v, pos, cos_sin, ref, slots), *TOL[dtype])
    if kv_dtype is None:
        assert_close(cache.data, ref.data, *TOL[dtype])
    else:
        assert_same_stored(cache, ref)
    assert_close(rope(q, pos, cos_sin), rope_ref(q, pos, cos_sin), *TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])
def test_rope_kv_store_kernel_on_cuda(dtype, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(heads)
    q = torch.randn(20, heads, head_dim, generator=g).to(dtype).cuda()
    k, v = (torch.randn(20, kv_heads, head_dim, generator=g).to(dtype).cuda() for _ in range(2))
    pos = torch.randint(0, 4000, (20,), generator=g).cuda()
    slots = torch.arange(16, 36).cuda()
    slots[[3, 11]] = -1  # padding tokens: nothing stored
    cos_sin = _cos_sin(4096, head_dim).cuda()
    cache, cache_ref = (torch.zeros(4, 2, 16, kv_heads, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    atol, rtol = TOL[dtype]
    assert_close(rope_kv_store(q, k, v, pos, cos_sin, KVCache(cache), slots),
                 rope_kv_store_ref(q, k, v, pos, cos_sin, KVCache(cache_ref), slots), atol, rtol)
    assert_close(cache, cache_ref, atol, rtol)
    assert_close(rope(q, pos, cos_sin), rope_ref(q, pos, cos_sin), atol, rtol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantizing_kv_stores_on_cuda(kv_dtype, dtype):
    """Compiled, the e4m3 conversion rounds to nearest even: the stored values and scales are the
    reference's exactly (assert_same_stored allows the interpreter's carry slips only when interpreting)."""
    if kv_dtype == "fp8_e4m3" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89 or newer")
    g = torch.Generator().manual_seed(9)
    q = torch.randn(40, 32, 128, generator=g).to(dtype).cuda()
    k, v = ((torch.randn(40, 8, 128, generator=g) * 3).to(dtype).cuda() for _ in range(2))
    pos = torch.randint(0, 4000, (40,), generator=g).cuda()
    slots = (torch.randperm(8 * 16, generator=g)[:40] + 16).cuda()
    slots[[3, 17]] = -1
    cos_sin = _cos_sin(4096, 128).cuda()
    cache, ref = (_quantized_cache(kv_dtype, 10, 16, 8, 128, "cuda") for _ in range(2))
    assert_close(rope_kv_store(q, k, v, pos, cos_sin, cache, slots),
                 rope_kv_store_ref(q, k, v, pos, cos_sin, ref, slots), *TOL[dtype])
    assert_same_stored(cache, ref)
    cache, ref = (_quantized_cache(kv_dtype, 10, 16, 8, 128, "cuda") for _ in range(2))
    kv_store(k, v, cache, slots)
    kv_store_ref(k, v, ref, slots)
    assert_same_stored(cache, ref)
