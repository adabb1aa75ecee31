"""The MLA decode kernel (kernels/mla_decode.py) against the op's reference (optc/core/ops/mla.py), under the
Triton interpreter without a GPU: decode steps over requests whose contexts end mid-block and span several
blocks, latent and rope widths that are not powers of two, float32 and bfloat16 caches; the cache rows the
kernel's launcher stores equal the reference's, and any other batch runs the reference."""

from __future__ import annotations

import pytest
import torch

from optc.core.kv_cache import KVCache
from optc.testing import assert_close

pytest.importorskip("triton")


def _step(rank: int, rope: int, block_size: int, dtype: torch.dtype, query_lens: list[int]):
    """A batch of 3 requests with 9, 3 and 14 cached tokens, its queries and weights, and a filled cache."""
    from optc.core.rope import base_inv_freq

    g = torch.Generator().manual_seed(0)
    heads, nope, v = 4, 12, 10
    context = [9, 3, 14]
    seq_lens = torch.tensor([n + q for n, q in zip(context, query_lens, strict=True)])
    per_request = -(-int(seq_lens.max()) // block_size)
    tables = torch.arange(1, 1 + 3 * per_request).view(3, per_request).flip(1)  # blocks out of order
    positions = torch.cat([torch.arange(n, n + q) for n, q in zip(context, query_lens, strict=True)])
    request = torch.repeat_interleave(torch.arange(3), torch.tensor(query_lens))
    slots = tables[request, positions // block_size] * block_size + positions % block_size
    start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    data = torch.randn(1 + 3 * per_request, 1, block_size, 1, rank + rope, generator=g).to(dtype)
    t = len(positions)
    freqs = torch.outer(torch.arange(64.0), base_inv_freq(10000.0, rope))
    args = dict(q=torch.randn(t, heads, nope + rope, generator=g).to(dtype),
                kv_a=torch.randn(t, rank + rope, generator=g).to(dtype), positions=positions,
                cos_sin=torch.cat((freqs.cos(), freqs.sin()), -1), kv_norm=1 + 0.1 * torch.randn(rank, generator=g),
                kv_b=(torch.randn(heads * (nope + v), rank, generator=g) / 4).to(dtype), slot_mapping=slots,
                block_tables=tables, seq_lens=seq_lens, query_start_loc=start, scale=0.2, eps=1e-6,
                qk_nope_head_dim=nope, v_head_dim=v)
    return args, data


@pytest.mark.parametrize("rank, rope, block_size, dtype", [
    (16, 8, 16, torch.float32), (20, 6, 4, torch.float32), (20, 6, 8, torch.bfloat16)],
    ids=["pow2-bs16-f32", "odd-bs4-f32", "odd-bs8-bf16"])
def test_mla_decode_kernel_equals_the_reference(rank, rope, block_size, dtype):
    from optc.core.ops.mla import mla_attention_ref
    from optc.kernels.mla_decode import mla_decode

    args, data = _step(rank, rope, block_size, dtype, [1, 1, 1])
    caches = {fn: KVCache(data.clone()) for fn in ("ref", "kernel")}
    want = mla_attention_ref(**args, kv_cache=caches["ref"])
    got = mla_decode(**args, kv_cache=caches["kernel"])
    assert torch.equal(caches["kernel"].data, caches["ref"].data), "the stored latents differ"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close(got, want, atol=tol, rtol=tol, what=f"mla decode kernel, R {rank} Dr {rope} bs {block_size} {dtype}")


def test_a_prefill_batch_runs_the_reference():
    from optc.core.ops.mla import mla_attention_ref
    from optc.kernels.mla_decode import mla_decode

    args, data = _step(16, 8, 4, torch.float32, [5, 1, 12])
    want = mla_attention_ref(**args, kv_cache=KVCache(data.clone()))
    assert torch.equal(mla_decode(**args, kv_cache=KVCache(data.clone())), want)


def test_mla_decode_kernel_compiles_for_sm90_at_deepseek_v2_sizes(tmp_path):
    """kv_lora_rank 512 + rope 64 in bfloat16 (DeepSeek-V2's) and the tiny preset's: compiled for sm_90 in a
    process without the interpreter (kernels/compile_only.py), fitting shared memory without register spills."""
    import json
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = tmp_path / "compile.py"
    script.write_text(textwrap.dedent(f'''
        import json, sys
        import torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from optc.core.kv_cache import KVCache
        from optc.kernels.compile_only import compile_only
        from optc.kernels.mla_decode import mla_decode
        from test_kernels_mla import _step

        out = []
        for rank, rope, bs, dtype in ((512, 64, 16, torch.bfloat16), (16, 8, 16, torch.float32)):
            args, data = _step(rank, rope, bs, dtype, [1, 1, 1])
            with compile_only(90) as launches:
                mla_decode(**args, kv_cache=KVCache(data))
            (launch,) = launches
            (c,) = launch.configs
            out.append(dict(kernel=launch.kernel, fits=launch.fits, registers=c.registers, spills=c.spill_bytes))
        print(json.dumps(out))
    '''))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for c in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert c["kernel"] == "_mla_decode_kernel" and c["fits"] and c["registers"] > 0 and c["spills"] == 0, c
