"""Kernel benchmarks at Llama-3-8B decode shapes: each Triton kernel next to its torch equivalent.

    python benchmarks/kernels.py [--json out.json] [--repeats 50]

Per kernel and shape it prints the median time (CUDA events, after warmup), the bytes the kernel
must move (formula in `_cases`), achieved GB/s = bytes / time, and that as a fraction of the
device-to-device copy bandwidth measured in the same run (2 * bytes / time of a 1 GiB copy). The
torch equivalent is the reference path: dequantize + matmul (cuBLAS) for the quantized linears,
gather the paged KV + F.scaled_dot_product_attention for decode, eager torch for the rest; its GB/s
uses the same byte count (the minimum traffic), so the ratio is a pure time ratio. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial as bind

import torch
import torch.nn.functional as F

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, GROUP = 4096, 14336, 32, 8, 128, 128
BATCHES, CONTEXTS, BLOCK_SIZE = (1, 8, 32), (512, 4096), 16
LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def time_ms(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(warmup: int, repeats: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (time_ms(lambda: dst.copy_(src), warmup, repeats) * 1e-3)


def _cases():
    """Yields (kernel, shape, bytes moved, triton fn, torch fn)."""
    from optc.formats import Format, FormatKind, linear_ref, pack_int4
    from optc.kernels import activation, norm, paged_decode, rope, w4a16, w8a16

    dev, dt, e = "cuda", torch.bfloat16, 2
    w = torch.randn(HIDDEN, device=dev, dtype=dt)
    cos_sin = torch.randn(8192, HEAD_DIM, device=dev)
    for t in BATCHES:
        x, r = torch.randn(2, t, HIDDEN, device=dev, dtype=dt)
        yield "rms_norm", f"T={t}", (2 * t + 1) * HIDDEN * e, bind(norm.rms_norm, x, w, 1e-5), \
            bind(norm.rms_norm_ref, x, w, 1e-5)
        yield "add_rms_norm", f"T={t}", (4 * t + 1) * HIDDEN * e, bind(norm.add_rms_norm, x, r, w, 1e-5), \
            bind(norm.add_rms_norm_ref, x, r, w, 1e-5)
        gu = torch.randn(t, 2 * INTER, device=dev, dtype=dt)
        yield "silu_mul", f"T={t}", 3 * t * INTER * e, bind(activation.silu_mul, gu), \
            bind(activation.silu_mul_ref, gu)
        q = torch.randn(t, HEADS, HEAD_DIM, device=dev, dtype=dt)
        k, v = torch.randn(2, t, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
        pos, slots = torch.arange(t, device=dev) + 100, torch.arange(t, device=dev) + BLOCK_SIZE
        cache = torch.zeros(t // BLOCK_SIZE + 2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
        byts = (2 * HEADS + 4 * KV_HEADS) * t * HEAD_DIM * e + t * HEAD_DIM * 4
        args = (q, k, v, pos, cos_sin, cache, slots)
        yield "rope_kv_store", f"T={t}", byts, bind(rope.rope_kv_store, *args), bind(rope.rope_kv_store_ref, *args)
        for ctx in CONTEXTS:
            byts = 2 * t * ctx * KV_HEADS * HEAD_DIM * e + 2 * t * HEADS * HEAD_DIM * e
            yield ("paged_decode", f"B={t} ctx={ctx}", byts, *_decode(t, ctx, paged_decode.paged_decode))
        for name, (n, kk) in LINEARS.items():
            xl = torch.randn(t, kk, device=dev, dtype=dt)
            fmt4 = Format(FormatKind.INT4_G, dtype="bfloat16", bits=4, group_size=GROUP, zero_point=True,
                          packing="k8_lsb")
            p4 = {"qweight": pack_int4(torch.randint(0, 16, (n, kk), device=dev)),
                  "scales": torch.rand(n, kk // GROUP, device=dev, dtype=dt) * 0.01,
                  "zeros": torch.randint(0, 16, (n, kk // GROUP), device=dev, dtype=torch.uint8)}
            io = (t * kk + t * n) * e
            yield f"w4a16.{name}", f"M={t} N={n} K={kk}", n * kk // 2 + n * kk // GROUP * (e + 1) + io, \
                bind(w4a16.w4a16_linear, xl, p4, fmt4), bind(linear_ref, xl, p4, fmt4)
            fmt8 = Format(FormatKind.INT8_WO, dtype="bfloat16", bits=8)
            p8 = {"qweight": torch.randint(-127, 128, (n, kk), device=dev, dtype=torch.int8),
                  "scales": torch.rand(n, device=dev, dtype=dt) * 0.01}
            yield f"w8a16.{name}", f"M={t} N={n} K={kk}", n * kk + n * e + io, \
                bind(w8a16.w8a16_linear, xl, p8, fmt8), bind(linear_ref, xl, p8, fmt8)


def _decode(batch, ctx, kernel):
    dev, dt = "cuda", torch.bfloat16
    per = ctx // BLOCK_SIZE
    cache = torch.randn(1 + batch * per, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
    tables = (torch.randperm(batch * per, device=dev) + 1).int().view(batch, per)
    seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    starts = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=dev, dtype=dt)
    scale = HEAD_DIM ** -0.5

    def torch_fn():  # gather each request's K/V, then SDPA with GQA (no causal mask needed for decode)
        kv = cache[tables.long()].transpose(1, 2).reshape(batch, 2, ctx, KV_HEADS, HEAD_DIM)
        k, v = kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)  # (B, H_kv, ctx, D)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)

    return lambda: kernel(q, cache, tables, seq_lens, starts, scale, max_seq_len=ctx), torch_fn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU; none is available on this machine", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    peak = copy_bandwidth(args.warmup, args.repeats)
    print(f"device: {torch.cuda.get_device_name()}; device-to-device copy: {peak / 1e9:.0f} GB/s")
    print(f"{'kernel':<14} {'shape':<26} {'MB':>8} {'triton us':>10} {'GB/s':>7} {'%copy':>6} "
          f"{'torch us':>10} {'GB/s':>7} {'speedup':>8}")
    rows = []
    for kernel, shape, byts, tri, ref in _cases():
        t_ms, r_ms = time_ms(tri, args.warmup, args.repeats), time_ms(ref, args.warmup, args.repeats)
        row = {"kernel": kernel, "shape": shape, "bytes": byts, "triton_us": t_ms * 1e3, "torch_us": r_ms * 1e3,
               "triton_gbps": byts / t_ms / 1e6, "torch_gbps": byts / r_ms / 1e6,
               "fraction_of_copy": byts / (t_ms * 1e-3) / peak, "speedup": r_ms / t_ms}
        rows.append(row)
        print(f"{kernel:<14} {shape:<26} {byts / 1e6:8.2f} {row['triton_us']:10.1f} {row['triton_gbps']:7.0f} "
              f"{row['fraction_of_copy']:6.1%} {row['torch_us']:10.1f} {row['torch_gbps']:7.0f} {row['speedup']:7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbps": peak / 1e9, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
