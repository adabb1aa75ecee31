"""kernels/cpu_ext/ops.cpp: the CPU's one-call norms, gated activation, rotary + KV store and row attention
(decode and verification rows) against their op references (bfloat16: equal but for a last-bit rounding;
float32: within sums' order), a row's attention the same bits in a decode step and in a verification, the
launchers' fallbacks to the references, the build failing cleanly, and a tiny model bound to them."""

import logging

import pytest
import torch

from optc.core.kv_cache import KVCache, quantize
from optc.core.ops.attention import attention_ref, paged_attention_ref
from optc.core.ops.elementwise import gated_act_ref
from optc.core.ops.norm import add_rms_norm_ref, rms_norm_ref
from optc.core.ops.rope import rope_kv_store_ref
from optc.kernels import cpu_ext
from optc.kernels.cpu_ext import ops
from optc.testing import cpu_extension


@pytest.fixture(scope="module", autouse=True)
def _ops_built():
    """ops.cpp built: a failed build fails these tests (no compiler or no AVX2: skipped, saying so)."""
    cpu_extension()


DTYPES = [torch.bfloat16, torch.float32]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16: at most one rounding step (2^-7 relative) where a sum's order moves a value across a rounding
    boundary, or, for a value that is a sum cancelling to near 0, the fp32 sum's own order error (1e-6 of the
    largest value); float32: the sums' order, 1e-5 of the largest value."""
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    if got.dtype == torch.bfloat16:
        assert (diff <= want.float().abs() * 2**-7 + 1e-6 * want.float().abs().max()).all(), float(diff.max())
        assert (diff > 0).float().mean() < 0.01  # rare, not systematic
    else:
        assert diff.max() <= 1e-5 * want.abs().max(), float(diff.max())


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_norms_match_their_references(dtype, offset):
    x, r = (torch.randn(7, 192, generator=_g(s)).to(dtype) for s in (0, 1))
    w = (torch.rand(192, generator=_g(2)) + 0.5).to(dtype)
    _close(ops.rms_norm(x, w, 1e-6, offset), rms_norm_ref(x, w, 1e-6, offset))
    normed, summed = ops.add_rms_norm(x, r, w, 1e-5, offset)
    ref_normed, ref_summed = add_rms_norm_ref(x, r, w, 1e-5, offset)
    assert torch.equal(summed, ref_summed)
    _close(normed, ref_normed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_act_on_the_split_views_of_gate_up(dtype):
    gate_up = torch.randn(5, 2 * 96, generator=_g(0)).to(dtype) * 4
    gate, up = gate_up.split(96, dim=-1)  # what a fused gate_up linear's split outputs are
    assert not gate.is_contiguous()
    _close(ops.gated_act(gate, up), gated_act_ref(gate, up))
    _close(ops.gated_act(gate_up), gated_act_ref(gate_up))
    assert torch.equal(ops.gated_act(gate, up, act="gelu_tanh"), gated_act_ref(gate, up, act="gelu_tanh"))


def _cache(dtype, blocks=20, block_size=4, kv_heads=2, head_dim=32, seed=5) -> KVCache:
    return KVCache(torch.randn(blocks, 2, block_size, kv_heads, head_dim, generator=_g(seed)).to(dtype))


QUANTIZED = {"int8": (torch.int8, 127.0), "fp8_e4m3": (torch.float8_e4m3fn, 448.0)}


def _quantized_cache(kind, blocks=20, block_size=4, kv_heads=2, head_dim=32, seed=5) -> KVCache:
    """A cache of int8 / fp8 codes with a float32 scale per (token, KV head), as kv_cache.quantize writes it."""
    dtype, qmax = QUANTIZED[kind]
    values = torch.randn(blocks, 2, block_size, kv_heads, head_dim, generator=_g(seed))
    values[0, :, 1] = 0.0  # a token of zeros: scale 0
    codes, scales = quantize(values, dtype, qmax)
    return KVCache(codes, scales, qmax=qmax)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", [32, 16])  # whole head, partial (Phi-3)
def test_rope_kv_store_rotates_and_stores_as_the_reference(dtype, rotary):
    t, hq, hkv, d = 5, 6, 2, 32
    q, k, v = (torch.randn(t, h, d, generator=_g(s)).to(dtype) for s, h in ((0, hq), (1, hkv), (2, hkv)))
    positions = torch.tensor([0, 9, 3, 40, 17])
    cos_sin = torch.randn(64, rotary, generator=_g(3))
    slots = torch.tensor([5, -1, 22, 47, 8])  # -1: a padding row, not stored
    mine, ref = _cache(dtype), _cache(dtype)
    out = ops.rope_kv_store(q, k, v, positions, cos_sin, mine, slots)
    want = rope_kv_store_ref(q, k, v, positions, cos_sin, ref, slots)
    assert torch.equal(out, want)  # the same products and sums, the same roundings
    assert torch.equal(mine.data, ref.data)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(QUANTIZED))
def test_rope_kv_store_writes_a_quantized_cache_s_codes_and_scales_as_the_reference(dtype, kind, monkeypatch):
    monkeypatch.setattr(ops, "rope_kv_store_ref", None)  # ops.cpp's, not the launcher's fallback
    t, hq, hkv, d = 5, 6, 2, 32
    q, k, v = (torch.randn(t, h, d, generator=_g(s)).to(dtype) * 3 for s, h in ((0, hq), (1, hkv), (2, hkv)))
    k[2, 1] = 0.0  # a head of zeros: scale 0, codes 0
    positions = torch.tensor([0, 9, 3, 40, 17])
    cos_sin = torch.randn(64, 32, generator=_g(3))
    slots = torch.tensor([5, -1, 22, 47, 8])
    mine, ref = _quantized_cache(kind), _quantized_cache(kind)
    out = ops.rope_kv_store(q, k, v, positions, cos_sin, mine, slots)
    want = rope_kv_store_ref(q, k, v, positions, cos_sin, ref, slots)
    assert torch.equal(out, want)
    assert torch.equal(mine.data.view(torch.int8), ref.data.view(torch.int8))  # the codes, bit for bit
    assert torch.equal(mine.scales, ref.scales)
    assert not torch.equal(mine.data.view(torch.int8), _quantized_cache(kind).data.view(torch.int8))  # it wrote


def _decode_batch(dtype, seq_lens, block_size=4, width=6):
    b = len(seq_lens)
    q = torch.randn(b, 6, 32, generator=_g(7)).to(dtype)
    tables = torch.randperm(20, generator=_g(8))[: b * width].view(b, width).int()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    start = torch.arange(b + 1, dtype=torch.int32)
    return q, tables, lens, start


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [None, *QUANTIZED])  # a float cache of q's dtype, int8 and fp8 codes with scales
@pytest.mark.parametrize("softcap,window", [(None, None), (20.0, None), (None, 5)])
def test_decode_attention_matches_the_reference(dtype, kind, softcap, window, monkeypatch):
    monkeypatch.setattr(ops, "attention_ref", None)  # ops.cpp's, not the launcher's fallback
    q, tables, lens, start = _decode_batch(dtype, [1, 9, 23])
    cache = _cache(dtype) if kind is None else _quantized_cache(kind)
    kw = {"softcap": softcap, "window": window, "max_query_len": 1, "max_seq_len": 23}
    got = ops.attention(q, None, None, cache, torch.zeros(3, dtype=torch.long), tables, lens, start, 0.17, **kw)
    want = attention_ref(q, None, None, cache, torch.zeros(3, dtype=torch.long), tables, lens, start, 0.17, **kw)
    _close(got, want)


def _rows_batch(dtype, query_lens, seq_lens, block_size=4, blocks=24, width=8, seed=7):
    """Requests with query_lens[b] rows at the end of their seq_lens[b] positions over a random float cache."""
    t = sum(query_lens)
    q = torch.randn(t, 6, 32, generator=_g(seed)).to(dtype)
    tables = torch.randint(1, blocks, (len(seq_lens), width), generator=_g(seed + 1)).int()  # blocks may be shared
    starts = torch.tensor([0, *query_lens]).cumsum(0).int()
    cache = _cache(dtype, blocks=blocks, block_size=block_size)
    return q, cache, tables, torch.tensor(seq_lens, dtype=torch.int32), starts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap,window", [(None, None), (20.0, None), (None, 5)])
def test_row_attention_matches_the_reference_on_verification_batches(dtype, softcap, window):
    # k + 1 rows per request beside decode rows, and a prefill longer than MAX_ROWS (the reference's rows)
    lens = [5, 1, 3, ops.MAX_ROWS + 2, ops.MAX_ROWS]
    q, cache, tables, seq_lens, starts = _rows_batch(dtype, lens, [9, 23, 3, 30, 31])
    kw = {"softcap": softcap, "window": window}
    slots = torch.zeros(len(q), dtype=torch.long)
    spec = paged_attention_ref(q, cache.data, tables, seq_lens, starts, 0.17, softcap=softcap, window=window)
    ref = attention_ref(q, None, None, cache, slots, tables, seq_lens, starts, 0.17, **kw)
    prefill = torch.zeros(len(q), dtype=torch.bool)
    prefill[starts[3]: starts[4]] = True
    for bounds in ({}, {"max_query_len": max(lens), "max_seq_len": 31}):
        got = ops.attention(q, None, None, cache, slots, tables, seq_lens, starts, 0.17, **bounds, **kw)
        _close(got[~prefill], spec[~prefill])  # the fp32 specification (the reference's SDPA rounds P in bf16)
        _close(got[prefill], ref[prefill])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap,window", [(None, None), (20.0, 6)])
@pytest.mark.parametrize("kind", [None, "int8"])
def test_a_row_is_the_same_bits_in_a_decode_step_and_in_a_verification(dtype, softcap, window, kind):
    """Row i of a request verifying n rows at seq_len L is the decode step of one row at L - n + 1 + i, whatever
    else the batch holds (over a float cache and an int8 one)."""
    n, length = ops.MAX_ROWS, 29
    q, cache, tables, seq_lens, starts = _rows_batch(dtype, [2, n, ops.MAX_ROWS + 1], [6, length, 20])
    if kind is not None:
        cache = _quantized_cache(kind, blocks=24)
    kw = {"softcap": softcap, "window": window}
    slots = torch.zeros(len(q), dtype=torch.long)
    verified = ops.attention(q, None, None, cache, slots, tables, seq_lens, starts, 0.2, **kw)[2: 2 + n]
    for i in range(n):
        one = ops.attention(q[2 + i: 3 + i], None, None, cache, slots[:1], tables[1:2],
                            torch.tensor([length - n + 1 + i], dtype=torch.int32), torch.tensor([0, 1]).int(), 0.2,
                            max_query_len=1, max_seq_len=length, **kw)
        assert torch.equal(one[0], verified[i]), i


def _tree_masks(parents_per_request: list[list[int]]) -> torch.Tensor:
    """Each node's bit mask of itself and its ancestors (bit j: node j of its request)."""
    masks = []
    for parents in parents_per_request:
        own: list[int] = []
        for j, parent in enumerate(parents):
            own.append((1 << j) | (own[parent] if parent >= 0 else 0))
        masks += own
    return torch.tensor(masks, dtype=torch.int64)


TREES = [[-1, -1, 0, 0, 1, 2, 5], [-1], [-1, 0, 1, 2]]  # a tree, one node, a chain


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_tree_attention_matches_its_reference(dtype, softcap):
    q, cache, tables, seq_lens, starts = _rows_batch(dtype, [len(t) for t in TREES], [19, 4, 30])
    masks = _tree_masks(TREES)
    got = ops.tree_attention(q, cache, tables, seq_lens, starts, 0.2, masks, softcap)
    _close(got, ops._tree_attention_ref(q, cache, tables, seq_lens, starts, 0.2, masks, softcap))
    big = _rows_batch(dtype, [ops.MAX_TREE_NODES + 1], [70], width=20)
    with pytest.raises(ValueError, match="at most 64 nodes"):
        ops.tree_attention(*big, 0.2, torch.zeros(ops.MAX_TREE_NODES + 1, dtype=torch.long))


def test_a_chain_mask_is_causal_attention_bit_for_bit():
    dtype = torch.bfloat16
    q, cache, tables, seq_lens, starts = _rows_batch(dtype, [4, 1, 6], [9, 23, 14])
    masks = _tree_masks([[-1, 0, 1, 2], [-1], [-1, 0, 1, 2, 3, 4]])
    slots = torch.zeros(len(q), dtype=torch.long)
    causal = ops.attention(q, None, None, cache, slots, tables, seq_lens, starts, 0.2)
    assert torch.equal(ops.tree_attention(q, cache, tables, seq_lens, starts, 0.2, masks), causal)
    # and the reference's chain is the op's fp32 specification
    spec = paged_attention_ref(q, cache.data, tables, seq_lens, starts, 0.2)
    _close(ops._tree_attention_ref(q, cache, tables, seq_lens, starts, 0.2, masks, None), spec)


def test_tree_attention_without_the_extension_is_its_reference(monkeypatch):
    q, cache, tables, seq_lens, starts = _rows_batch(torch.float32, [len(t) for t in TREES], [19, 4, 30])
    masks = _tree_masks(TREES)
    monkeypatch.setattr(ops, "_ext", lambda x: None)
    assert torch.equal(ops.tree_attention(q, cache, tables, seq_lens, starts, 0.2, masks),
                       ops._tree_attention_ref(q, cache, tables, seq_lens, starts, 0.2, masks, None))


def test_what_ops_cpp_does_not_take_runs_the_reference(monkeypatch):
    dtype = torch.bfloat16
    q, tables, lens, start = _decode_batch(dtype, [3, 7])
    # a cache of another float dtype than q's: the reference casts it
    args = (q, None, None, _cache(torch.float16), torch.zeros(2, dtype=torch.long), tables, lens, start, 0.2)
    assert torch.equal(ops.attention(*args, max_query_len=1, max_seq_len=7), attention_ref(*args, 1, 7))
    # prefill (every request past MAX_ROWS rows): the reference
    long_q, cache, long_tables, long_lens, long_start = _rows_batch(dtype, [ops.MAX_ROWS + 1] * 2, [20, 30])
    args = (long_q, None, None, cache, torch.zeros(len(long_q), dtype=torch.long), long_tables, long_lens,
            long_start, 0.2)
    assert torch.equal(ops.attention(*args), attention_ref(*args))
    # no extension: every launcher is its reference
    monkeypatch.setattr(ops, "_ext", lambda x: None)
    x = torch.randn(3, 64, generator=_g(2)).to(dtype)
    w = torch.rand(64, generator=_g(3)).to(dtype)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    args = (q, None, None, _cache(dtype), torch.zeros(2, dtype=torch.long), tables, lens, start, 0.2)
    assert torch.equal(ops.attention(*args, max_query_len=1, max_seq_len=7), attention_ref(*args, 1, 7))


def test_a_failed_build_is_logged_and_gives_none(tmp_path, monkeypatch, caplog):
    from torch.utils import cpp_extension

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'optc_cpu': g++ not found")

    monkeypatch.setattr(cpp_extension, "load", broken)
    with caplog.at_level(logging.WARNING, logger="optc.kernels.cpu_ext"):
        assert cpu_ext.build(cpu_ext.CPU, tmp_path) is None
    assert "could not be built" in caplog.text and "g++ not found" in caplog.text and "op references" in caplog.text


def test_a_tiny_bf16_model_bound_to_them_decodes_like_the_references(tmp_path):
    from optc.core.artifact import read
    from optc.runtime import Engine, SamplingParams
    from optc.testing import build_artifact

    recipe = tmp_path / "tiny-bf16.yaml"
    recipe.write_text("model: random:tiny\ndtype: bfloat16\ntarget: cpu\npasses: [fuse_qkv, fuse_gate_up, "
                      "fuse_add_rmsnorm, fuse_rope_kv, kv_layout, {select_kernels: {measure: false}}]\n")
    art = build_artifact(tmp_path / "cpp", recipe)
    kernels = {n.kernel for n in read(art).graph.nodes}
    assert {"cpu.cpp_add_rms_norm", "cpu.cpp_rope_kv_store", "cpu.cpp_attention", "cpu.cpp_gated_act"} <= kernels
    prompts = [[5, 9, 13, 200, 3], [7] * 11]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    bound = Engine.load(art, enable_prefix_caching=False).generate(prompts, params)
    reference = Engine.load(art, enable_prefix_caching=False, use_references=True).generate(prompts, params)
    assert [c.token_ids for c in bound] == [c.token_ids for c in reference]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_attention_op_takes_a_tree_mask_beside_causal_rows(dtype):
    """The op's tree_mask (a batch with draft trees): tree rows as their bits say, a decode row and a chain as
    causal bits, prefill chunks without bits (one of MAX_ROWS + 1 .. 64 rows, one longer) causal and computed as
    without trees; the C++ launcher and the reference agree with tree_attention's reference."""
    trees = TREES[:1] + [[-1], [-1, 0, 1]]  # a tree, then a decode row and a chain as causal bits
    lens = [len(t) for t in trees] + [ops.MAX_ROWS + 3, ops.MAX_TREE_NODES + 3]
    q, cache, tables, seq_lens, starts = _rows_batch(dtype, lens, [19, 4, 30, 40, 70], width=20)
    masks = torch.cat([_tree_masks(trees), torch.zeros(sum(lens[3:]), dtype=torch.long)])
    slots = torch.zeros(len(q), dtype=torch.long)
    args = (q, None, None, cache, slots, tables, seq_lens, starts, 0.2)
    rows = int(starts[3])
    want = ops._tree_attention_ref(q[:rows], cache, tables[:3], seq_lens[:3], starts[:4], 0.2, masks[:rows], None)
    # the prefill: the launcher runs the op's reference (SDPA) there, the tree reference the fp32 specification
    runs = ((ops.attention(*args, tree_mask=masks), attention_ref(*args)),
            (attention_ref(*args, tree_mask=masks), paged_attention_ref(q, cache.data, tables, seq_lens, starts, 0.2)))
    for got, prefill in runs:
        _close(got[:rows], want)
        _close(got[rows:], prefill[rows:])


def _ranked(logits: torch.Tensor) -> torch.Tensor:
    """Every row's indices best first: descending, NaN first, ties to the smaller index (a stable sort)."""
    return torch.sort(logits, dim=-1, descending=True, stable=True).indices


@pytest.mark.parametrize("width", [1, 7, 33, 100, 16384 * 2 + 5, 262144])
@pytest.mark.parametrize("k", [1, 16])
def test_top_k_is_a_stable_descending_sort_s_head(width, k):
    k = min(k, width)
    gen = torch.Generator().manual_seed(width + k)
    logits = torch.randn(3, width, generator=gen)
    logits[1] = torch.randint(-3, 3, (width,), generator=gen).float()  # ties everywhere, the best k among them
    logits[2, ::3] = float("-inf")  # masked tokens (a grammar's), and a NaN that ranks above every number
    logits[2, width // 2] = float("nan")
    got = ops.top_k(logits, k)
    assert got.dtype == torch.int64 and got.shape == (3, k)
    assert torch.equal(got, _ranked(logits)[:, :k])
    assert torch.equal(ops.top_k(logits, 1)[:, 0], logits.argmax(-1))


def test_top_k_of_rows_all_masked_but_few():
    logits = torch.full((2, 5000), float("-inf"))
    logits[0, 4321] = 1.0
    logits[1, [17, 4000]] = torch.tensor([2.0, 3.0])
    assert torch.equal(ops.top_k(logits, 16), _ranked(logits)[:, :16])  # the -inf ties by index after the rest
