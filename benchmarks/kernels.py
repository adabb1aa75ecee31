"""Kernel benchmarks at Llama-3-8B (or SmolLM2, or a family's: Qwen3, Gemma 2 / 3, Phi-3 / 4) decode shapes:
each Triton kernel next to its torch equivalent, and torch's tinygemm int4 matmul (`tinygemm.*`, the
`torch.int4pack` candidate) beside w4a16 in bfloat16; the n8_tiles decode GEMV and prefill GEMM
(`w4a16_decode.*`, `w4a16_prefill.*`) and, where the `gemlite` package imports, GemLite's A16W4
(`gemlite.*`) on the same int4 weights (those rows: benchmarks/int4_cases.py).

    python benchmarks/kernels.py [--jsonl rows.jsonl] [--json out.json] [--repeats 50] [--only w4a16,w8a16]
    python benchmarks/kernels.py --compile-only [--arch 90] [--all-configs]    # no GPU needed

Per kernel and shape it prints the time of one call on the GPU alone (`time_ms`: calls captured in
a CUDA graph, each after an L2 flush, the flushes' own time subtracted), the bytes the kernel
must move (formula in `_cases`), achieved GB/s = bytes / time, and that as a fraction of the
device's copy bandwidth measured in the same run (benchmarks/yardstick.py: a copy kernel timed with CUDA
events outside graphs, bytes read + written, the best of a few sizes; the header names the method; a
CUDA-graph memcpy, a slower path that reads ~1.6x low on an H200, follows as a labelled second column
so rows can be compared with runs that divided by it). The
torch equivalent is the reference path: dequantize + matmul (cuBLAS) for the quantized linears,
gather the paged KV + F.scaled_dot_product_attention for decode, eager torch for the rest; its GB/s
uses the same byte count (the minimum traffic), so the ratio is a pure time ratio. Each row also
checks the Triton output against the torch one (max error relative to the largest |value|) and
marks it past MAX_REL_ERR; a case that raises is reported and the others still run. Needs CUDA.
Each row is appended to `--jsonl` the moment it is measured (benchmarks/results.py), so a run killed
at a time limit keeps its finished rows; the table is printed from the rows (`python
benchmarks/results.py table FILE.jsonl` rebuilds it). `--only` runs the kernels whose names start
with one of the given prefixes, so the cases can be split across time-limited calls.
Prefill rows (linears at M=512, paged_prefill) are compute-bound: their GB/s is not their limit.
A family's attributes reach its rows: GeGLU in gated_act, the rotary width in rope_kv_store, the soft
cap in the attention rows, and for a model with sliding layers `paged_decode.local` /
`paged_prefill.local` rows with its window (bytes: the window's keys only, which the kernels alone
read; the blocks before it stay in the table). Attention rows with a soft cap or a window compare
with the runtime's torch path (optc.core.ops.attention.paged_attention_sdpa), which computes them.

--compile-only needs no GPU: each case's Triton launches compile for the GPU of --arch (Triton's
own compiler and the ptxas in its wheel) and do not run; it prints each compiled kernel's registers,
spilled bytes, shared memory and global-load instructions by width (e.g. 8x16B), and fails on a
compiler error or a launch that cannot fit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from functools import partial as bind

import torch
from attention_cases import BLOCK_SIZE, PREFILL, TREE_ROWS, decode, layers, prefill, quantized_cache, tree, tree_bytes
from int4_cases import gemlite_cases, int4_tiles_cases
from results import Rows
from yardstick import fraction_of, gbps

BATCHES, CONTEXTS = (1, 8, 32), (512, 4096)
MAX_REL_ERR = 3e-2  # bf16 outputs against the torch path: a larger error marks the row (and exit 1)


@dataclass(frozen=True)
class Model:
    """The shapes a model's kernels see; `group` is the int4 group size its recipes use. The family
    attributes: the rotary width (None: head_dim), the gated activation, the attention soft cap, the
    sliding layers' window (None: no sliding layers) and the norms' weight offset (Gemma's 1 + w)."""

    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    group: int
    rotary_dim: int | None = None
    act: str = "silu"
    softcap: float | None = None
    window: int | None = None
    norm_offset: float = 0.0

    @property
    def linears(self) -> dict[str, tuple[int, int]]:  # name -> (N, K)
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"qkv": (q + 2 * kv, self.hidden), "o": (self.hidden, q), "gate_up": (2 * self.inter, self.hidden),
                "down": (self.hidden, self.inter)}


MODELS = {"llama-3-8b": Model(4096, 14336, 32, 8, 128, 128), "smollm2-135m": Model(576, 1536, 9, 3, 64, 64),
          # each family's config.json: head_dim 128 not hidden / heads (Qwen3); head_dim 256, GeGLU, soft cap and
          # a 4,096-token window on alternate layers (Gemma 2); 4 heads over 1, a 512-token window on 5 of 6
          # layers (Gemma 3); head_dim 96 (Phi-3-mini); partial rotary 96 of 128 (Phi-4-mini)
          "qwen3-0.6b": Model(1024, 3072, 16, 8, 128, 128),
          "gemma-2-2b": Model(2304, 9216, 8, 4, 256, 128, act="gelu_tanh", softcap=50.0, window=4096, norm_offset=1.0),
          "gemma-3-270m": Model(640, 2048, 4, 1, 256, 128, act="gelu_tanh", window=512, norm_offset=1.0),
          "phi-3-mini": Model(3072, 8192, 32, 32, 96, 128),
          "phi-4-mini": Model(3072, 8192, 24, 8, 128, 128, rotary_dim=96)}
FAMILY_MODELS = ("qwen3-0.6b", "gemma-2-2b", "gemma-3-270m", "phi-3-mini", "phi-4-mini")


# rows whose torch reference reads device values on the host (OpSpec.reference_syncs_host): it cannot be
# captured in a CUDA graph, so it is timed eagerly (its launch time counts against it)
HOST_SYNCING_REFERENCES = ("rope_kv_store", "paged_decode", "paged_prefill")
L2_FLUSH_BYTES = 256 << 20  # more than an H100's 50 MB L2: each timed call reads its operands from HBM


def time_ms(fn, warmup: int, repeats: int, graph: bool = True) -> float:
    """Median milliseconds of one `fn` call on the GPU alone. Host launch time (tens of µs for a Triton
    launch from Python) would otherwise hide small kernels: `repeats` calls, each after an L2 flush,
    are captured in one CUDA graph and replayed; a graph of the flushes alone is subtracted, so the
    time is the kernel's as a decode step sees it (operands from HBM, launched from a graph). With
    `graph=False` (a torch reference that reads device values on the host: no capture) the same calls
    run eagerly between two events, their launch time included."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()  # warm-up on a side stream, as before any capture (lazy per-stream state)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):  # compiles and autotunes before the capture
            flush.zero_()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    if not graph:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        per_call = []
        for _ in range(5):
            start.record()
            for _ in range(repeats):
                flush.zero_()
                fn()
            end.record()
            end.synchronize()
            per_call.append(start.elapsed_time(end) / repeats)
        return max(statistics.median(per_call), 1e-6)

    def capture(body) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeats):
                body()
        return graph

    def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    both = capture(lambda: (flush.zero_(), fn()))
    alone = capture(flush.zero_)
    replay_ms(both), replay_ms(alone)  # first replays upload the graphs
    per_call = [(replay_ms(both) - replay_ms(alone)) / repeats for _ in range(5)]
    return max(statistics.median(per_call), 1e-6)


def graph_memcpy_bandwidth(warmup: int, repeats: int) -> float:
    """GB/s of a 1 GiB `dst.copy_(src)` timed by `time_ms` (a memcpy node in a CUDA graph): the yardstick this
    benchmark printed before benchmarks/yardstick.py, kept as a labelled second column to compare old rows."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return gbps(2 * src.numel(), time_ms(lambda: dst.copy_(src), warmup, repeats))


def _cases(model: Model, dev: str = "cuda", dt: torch.dtype = torch.bfloat16, rand=None):
    """Yields (kernel, shape, bytes moved, triton fn, torch fn) at `model`'s shapes on `dev` in `dt`. `rand(*shape,
    dtype=)` makes the data (default torch.randn; --compile-only passes torch.empty); block
    tables, positions and lengths are always real."""
    from optc.core.formats import Format, FormatKind, linear_ref
    from optc.core.kv_cache import KVCache
    from optc.core.ops import Param
    from optc.core.ops.elementwise import gated_act_ref
    from optc.core.ops.norm import add_rms_norm_ref, rms_norm_ref
    from optc.core.ops.rope import rope_kv_store_ref
    from optc.kernels import activation, norm, paged_decode, paged_prefill, rope, w4a16, w8a16

    m, rand = model, rand or torch.randn
    data = lambda *shape, dtype=dt: rand(*shape, dtype=dtype, device=dev)  # noqa: E731
    e, name = dt.itemsize, str(dt).removeprefix("torch.")
    w = data(m.hidden)
    cos_sin = data(8192, m.rotary_dim or m.head_dim, dtype=torch.float32)
    for t in BATCHES:
        x, r = data(2, t, m.hidden)
        norm_args = (w, 1e-5, m.norm_offset)
        yield "rms_norm", f"T={t}", (2 * t + 1) * m.hidden * e, bind(norm.rms_norm, x, *norm_args), \
            bind(rms_norm_ref, x, *norm_args)
        yield "add_rms_norm", f"T={t}", (4 * t + 1) * m.hidden * e, bind(norm.add_rms_norm, x, r, *norm_args), \
            bind(add_rms_norm_ref, x, r, *norm_args)
        gu = data(t, 2 * m.inter)
        yield "gated_act", f"T={t}", 3 * t * m.inter * e, bind(activation.gated_act, gu, act=m.act), \
            bind(gated_act_ref, gu, act=m.act)
        q = data(t, m.heads, m.head_dim)
        k, v = data(2, t, m.kv_heads, m.head_dim)
        pos, slots = torch.arange(t, device=dev) + 100, torch.arange(t, device=dev) + BLOCK_SIZE
        cache = KVCache(data(t // BLOCK_SIZE + 2, 2, BLOCK_SIZE, m.kv_heads, m.head_dim))
        byts = (2 * m.heads + 4 * m.kv_heads) * t * m.head_dim * e + t * m.head_dim * 4
        args = (q, k, v, pos, cos_sin, cache, slots)
        yield "rope_kv_store", f"T={t}", byts, bind(rope.rope_kv_store, *args), bind(rope_kv_store_ref, *args)
        for ctx in CONTEXTS:
            for kernel, window in layers(m):
                seen = min(ctx, window or ctx)  # the keys the kernel reads
                byts = 2 * t * seen * m.kv_heads * m.head_dim * e + 2 * t * m.heads * m.head_dim * e
                yield ("paged_decode" + kernel, f"B={t} ctx={ctx}", byts,
                       *decode(m, t, ctx, dev, data, paged_decode.paged_decode, window=window))
    for t in BATCHES + (PREFILL,):
        for lin, (n, kk) in m.linears.items():
            xl = data(t, kk)
            fmt4 = Format(FormatKind.INT4_G, dtype=name, bits=4, group_size=m.group, zero_point=True, packing="k8_lsb")
            p4 = {"qweight": torch.randint(-2**31, 2**31 - 1, (n, kk // 8), dtype=torch.int32, device=dev),
                  "scales": data(n, kk // m.group) * 0.01,
                  "zeros": torch.randint(0, 16, (n, kk // m.group), device=dev, dtype=torch.uint8)}
            io = (t * kk + t * n) * e
            yield f"w4a16.{lin}", f"M={t} N={n} K={kk}", n * kk // 2 + n * kk // m.group * (e + 1) + io, \
                bind(w4a16.w4a16_linear, xl, p4, fmt4), bind(linear_ref, xl, p4, fmt4)
            if dev == "cuda" and dt == torch.bfloat16:  # torch's tinygemm (no Triton: nothing to compile-only)
                from optc.kernels.int4_cuda import int4pack_cuda_linear, prepare_int4pack_cuda

                packed = prepare_int4pack_cuda({"weight": Param(p4, fmt4)})["weight"].parts
                yield f"tinygemm.{lin}", f"M={t} N={n} K={kk}", n * kk // 2 + n * kk // m.group * 2 * e + io, \
                    bind(int4pack_cuda_linear, xl, packed, fmt4), bind(linear_ref, xl, p4, fmt4)
            if dt in (torch.float16, torch.bfloat16):  # the n8_tiles kernels and GemLite on the same weights
                yield from int4_tiles_cases(lin, t, n, kk, m.group, p4, fmt4, xl, io)
                if dev == "cuda":
                    yield from gemlite_cases(lin, t, n, kk, m.group, p4, fmt4, xl, io)
            fmt8 = Format(FormatKind.INT8_WO, dtype=name, bits=8)
            p8 = {"qweight": torch.randint(-127, 128, (n, kk), device=dev, dtype=torch.int8),
                  "scales": data(n) * 0.01}
            yield f"w8a16.{lin}", f"M={t} N={n} K={kk}", n * kk + n * e + io, \
                bind(w8a16.w8a16_linear, xl, p8, fmt8), bind(linear_ref, xl, p8, fmt8)
    for batch in (1, 4):  # prefill: `batch` prompts of PREFILL tokens each (compute-bound; bytes are the minimum)
        byts = 4 * batch * PREFILL * (m.heads + m.kv_heads) * m.head_dim * e
        for kernel, window in layers(m):
            fns = prefill(m, batch, dev, data, paged_prefill.paged_prefill, window=window)
            yield ("paged_prefill" + kernel, f"B={batch} T={PREFILL}", byts, *fns)
    if not m.window:  # an EAGLE draft tree's verification at batch 1 (the attention op's tree_mask)
        yield ("paged_prefill.tree", f"B=1 T={TREE_ROWS} ctx={PREFILL}", tree_bytes(m, e),
               *tree(m, dev, data, paged_prefill.paged_prefill))
    # int8 / fp8 KV (a value byte per element, an fp32 scale per (token, KV head) for K and V): the
    # fused store at T=32, decode at batch 32 x 4,096 (compare its GB/s with the bf16 row above:
    # the target is the same bytes per second on half the bytes), prefill at B=1
    for kv in ("int8", "fp8_e4m3"):
        t = BATCHES[-1]
        q = data(t, m.heads, m.head_dim)
        k, v = data(2, t, m.kv_heads, m.head_dim)
        pos, slots = torch.arange(t, device=dev) + 100, torch.arange(t, device=dev) + BLOCK_SIZE
        cache = quantized_cache(data(t // BLOCK_SIZE + 2, 2, BLOCK_SIZE, m.kv_heads, m.head_dim), kv, data)
        byts = (2 * m.heads + 2 * m.kv_heads) * t * m.head_dim * e + 2 * t * m.kv_heads * (m.head_dim + 4)
        args = (q, k, v, pos, cos_sin, cache, slots)
        yield f"rope_kv_store.{kv}", f"T={t}", byts, bind(rope.rope_kv_store, *args), bind(rope_kv_store_ref, *args)
        ctx = CONTEXTS[-1]
        byts = 2 * t * ctx * m.kv_heads * (m.head_dim + 4) + 2 * t * m.heads * m.head_dim * e
        yield (f"paged_decode.{kv}", f"B={t} ctx={ctx}", byts,
               *decode(m, t, ctx, dev, data, paged_decode.paged_decode, kv))
        byts = 2 * PREFILL * m.heads * m.head_dim * e + 2 * PREFILL * m.kv_heads * (m.head_dim + 4)
        yield (f"paged_prefill.{kv}", f"B=1 T={PREFILL}", byts,
               *prefill(m, 1, dev, data, paged_prefill.paged_prefill, kv))


def compile_report(model: str, arch: int, all_configs: bool, dtypes: list[str], only: tuple[str, ...] = ()) -> dict:
    """Compile every kernel the cases launch for sm_{arch}, without a GPU (optc.kernels.compile_only):
    one row per distinct compiled config, and the failures (compiler errors; launches with no
    config that fits in the GPU's shared memory). `only`: just the cases whose kernel name starts with one."""
    import triton

    from optc.kernels.compile_only import MAX_SHARED, compile_only

    seen, rows, failures = set(), [], []
    for name in dtypes:
        for kernel, shape, _, tri, _ in _cases(MODELS[model], "cpu", getattr(torch, name), torch.empty):
            if only and not kernel.startswith(only):
                continue
            where = f"{kernel} {shape} {name}"
            with compile_only(arch, all_configs) as launches:
                try:
                    tri()
                except Exception as exc:  # what the compiler refuses, reported with the case
                    failures.append(f"{where}: {type(exc).__name__}: {exc}")
            failures += [f"{where}: no config of {launch.kernel} fits in {MAX_SHARED[arch]} bytes of shared memory"
                         for launch in launches if not launch.fits]
            for c in (c for launch in launches for c in launch.configs):
                key = (c.name, name, tuple(c.config.items()))
                if key not in seen:
                    seen.add(key)
                    rows.append({"kernel": c.name, "dtype": name, "config": c.config, "registers": c.registers,
                                 "spill_bytes": c.spill_bytes, "shared_bytes": c.shared_bytes, "fits": c.fits,
                                 "loads": c.loads})
    return {"model": model, "arch": arch, "triton": triton.__version__, "all_configs": all_configs, "compiled": rows,
            "failures": failures}


def _print_compile_report(report: dict) -> None:
    print(f"{report['model']} shapes compiled for sm_{report['arch']} with triton {report['triton']}, no GPU used "
          f"({'every autotune config' if report['all_configs'] else 'first autotune config'})")
    print(f"{'kernel':<24} {'dtype':<9} {'regs':>5} {'spill':>6} {'smem KB':>8}  {'global loads':<22} config")
    for r in report["compiled"]:
        config = " ".join(f"{k}={v}" for k, v in r["config"].items())
        loads = " ".join(f"{n}x{w}B" for w, n in r["loads"].items())
        print(f"{r['kernel']:<24} {r['dtype']:<9} {r['registers']:5d} {r['spill_bytes']:6d} "
              f"{r['shared_bytes'] / 1024:8.1f}{'' if r['fits'] else '!'}  {loads:<22} {config}")
    for failure in report["failures"]:
        print(f"FAILED {failure}")
    print(f"{len(report['compiled'])} kernels compiled, {len(report['failures'])} failures")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results to this file (at the end)")
    ap.add_argument("--jsonl", help="append each row here as one JSON line the moment it is measured (survives a kill)")
    ap.add_argument("--only", default="",
                    help="comma-separated kernel name prefixes to run, or compile with --compile-only (e.g. "
                         "w4a16,w8a16; default: every kernel)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed runs before timing (default 10)")
    ap.add_argument("--repeats", type=int, default=50, help="timed runs; the median is reported (default 50)")
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-3-8b",
                    help="whose shapes the cases use (default llama-3-8b)")
    ap.add_argument("--compile-only", action="store_true",
                    help="no GPU needed: compile every kernel the benchmark launches for --arch and print "
                         "registers, spills and shared memory; exit 1 on a compiler error or a launch that "
                         "cannot fit")
    ap.add_argument("--arch", type=int, default=90, help="compute capability for --compile-only (default 90, H100)")
    ap.add_argument("--all-configs", action="store_true",
                    help="--compile-only: compile every autotune config, not just the first one kept")
    ap.add_argument("--dtypes", default="bfloat16,float16,float32",
                    help="--compile-only: activation dtypes, comma-separated (default bfloat16,float16,float32)")
    args = ap.parse_args(argv)
    if args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not interpreted ones (read at import)
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is its default
        only = tuple(p for p in args.only.split(",") if p)
        report = compile_report(args.model, args.arch, args.all_configs, args.dtypes.split(","), only)
        _print_compile_report(report)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        return 1 if report["failures"] else 0
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU; none is available on this machine", file=sys.stderr)
        return 2
    import yardstick

    torch.manual_seed(0)
    stick = yardstick.measure()
    old = graph_memcpy_bandwidth(args.warmup, args.repeats)
    device = torch.cuda.get_device_name()
    print(f"device: {device}; copy bandwidth: {stick.label()}; CUDA-graph memcpy (the old yardstick): {old:.0f} "
          f"GB/s; {args.model} shapes", flush=True)
    out, rows, only = Rows(args.jsonl), [], tuple(p for p in args.only.split(",") if p)
    for kernel, shape, byts, tri, ref in _cases(MODELS[args.model]):
        if only and not kernel.startswith(only):
            continue
        row = {"table": "kernels", "device": device, "model": args.model, "copy_gbps": stick.gbps,
               "copy_method": stick.method, "graph_memcpy_gbps": old, "kernel": kernel, "shape": shape}
        try:  # a kernel that fails on first contact with the device costs its row, not the table
            err = _error(tri(), ref())
            t_ms = time_ms(tri, args.warmup, args.repeats)
            r_ms = time_ms(ref, args.warmup, args.repeats, graph=not kernel.startswith(HOST_SYNCING_REFERENCES))
            row |= {"bytes": byts, "triton_us": t_ms * 1e3, "torch_us": r_ms * 1e3, "triton_gbps": gbps(byts, t_ms),
                    "torch_gbps": gbps(byts, r_ms), "fraction_of_copy": fraction_of(gbps(byts, t_ms), stick.gbps),
                    "fraction_of_graph_memcpy": fraction_of(gbps(byts, t_ms), old),
                    "speedup": r_ms / t_ms, "max_rel_err": err}
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
        out.append(row)
        print(kernels_table([row], head=False), flush=True)
    print(kernels_table(rows))
    failures = sum("error" in r or r["max_rel_err"] > MAX_REL_ERR for r in rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "model": args.model, "copy_gbps": stick.gbps,
                       "copy_method": stick.method, "copy_gbps_by_size": stick.by_size, "graph_memcpy_gbps": old,
                       "results": rows}, f, indent=1)
    return 1 if failures else 0


def kernels_table(rows: list[dict], head: bool = True) -> str:
    """The benchmark's table of `rows` (one run's, or rows rebuilt from --jsonl files)."""
    lines = []
    if head:
        # rows from before benchmarks/yardstick.py carry no method: a `copy_` timed eagerly (2026-11-23) or as a
        # CUDA-graph memcpy (from then on), and no second column
        devices = sorted({(r["device"], round(r["copy_gbps"]), r.get("copy_method", "a copy_, method not recorded"),
                           round(r.get("graph_memcpy_gbps", 0))) for r in rows})
        lines += [f"device: {d}; copy bandwidth: {g} GB/s ({m})" + (f"; CUDA-graph memcpy: {o} GB/s" if o else "")
                  for d, g, m, o in devices]
        lines.append(f"{'kernel':<14} {'shape':<26} {'MB':>8} {'triton us':>10} {'GB/s':>7} {'%copy':>6} "
                     f"{'%memcpy':>7} {'torch us':>10} {'GB/s':>7} {'speedup':>8} {'rel err':>8}")
    for r in rows:
        kernel, shape = r["kernel"], r["shape"]
        if "error" in r:
            lines.append(f"{kernel:<14} {shape:<26} FAILED {r['error'].splitlines()[0][:100]}")
            continue
        err = r["max_rel_err"]
        lines.append(f"{kernel:<14} {shape:<26} {r['bytes'] / 1e6:8.2f} {r['triton_us']:10.1f} {r['triton_gbps']:7.0f} "
                     f"{r['fraction_of_copy']:6.1%} {r.get('fraction_of_graph_memcpy', float('nan')):7.1%} "
                     f"{r['torch_us']:10.1f} {r['torch_gbps']:7.0f} "
                     f"{r['speedup']:7.2f}x {err:8.1e}{'!' if err > MAX_REL_ERR else ''}")
    return "\n".join(lines)


def _error(out, ref) -> float:
    """max |out - ref| / max |ref|, after bringing SDPA's (B, H, T, D) to the kernels' (B * T, H, D);
    a tuple (add_rms_norm's) is compared by its first item."""
    out, ref = (t[0] if isinstance(t, tuple) else t for t in (out, ref))
    if ref.dim() == 4:
        ref = ref.transpose(1, 2).reshape(-1, ref.shape[1], ref.shape[3])
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


if __name__ == "__main__":
    sys.exit(main())
