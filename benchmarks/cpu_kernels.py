"""CPU linear kernels at SmolLM2-135M's decode shapes, per weight format and M, against a bf16 matmul.

    python benchmarks/cpu_kernels.py [--m 1,8,64] [--repeats 30] [--threads 1] [--isa both|native|avx2]

Per shape (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, lm_head 49152x576), M and weight format
(int4_g g64 with zero points: AWQ's; int8_wo per channel; int4_gf g32 with mins: GGUF Q4_1; int8_gf g32: Q8_0)
it times every CPU kernel the table offers for that format (torch's packed kernels, the widened weight,
optc's qdot from kernels/cpu_ext) and `F.linear` on the bf16 weight, and prints the median µs of one call,
the weight bytes it must read (codes + scales + mins / zeros, the formula in `_weight_bytes`) over that time
as GB/s, and the ratio to bf16. Candidates run interleaved, round after round, in one process, so machine
load hits them alike. `--isa both` runs the script twice in child processes: as the CPU is
(torch's capability as reported) and capped to AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2, and
qdot's AVX2 path); a capability cap must be set before torch is imported, hence the child processes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
FORMATS = ("int4_g", "int8_wo", "int4_gf", "int8_gf")
CAP_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="1,8,64")
    ap.add_argument("--repeats", type=int, default=30, help="rounds; each times every candidate once")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--isa", choices=("both", "native", "avx2"), default="both")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args()
    capped = all(os.environ.get(k) == v for k, v in CAP_ENV.items())
    if args.isa == "both" or (args.isa == "avx2" and not capped):
        for isa in ("native", "avx2") if args.isa == "both" else ("avx2",):
            argv = ["--m", args.m, "--repeats", str(args.repeats), "--threads", str(args.threads),
                    "--shapes", args.shapes, "--formats", args.formats]
            env = {**os.environ, **(CAP_ENV if isa == "avx2" else {})}
            subprocess.run([sys.executable, __file__, *argv, "--isa", isa], env=env, check=True)
        return
    run(args)


def run(args: argparse.Namespace) -> None:
    import torch

    from optc.kernels import cpu_ext

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cap = torch.backends.cpu.get_cpu_capability()
    qdot_isa = cpu_ext.ISA_NAMES.get(cpu_ext.isa(), "unavailable")
    print(f"\n## torch {torch.__version__} capability {cap}, qdot path {qdot_isa}, threads {args.threads}, "
          f"load average {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{'shape':9} {'M':>3} {'format':8} {'kernel':16} {'µs':>9} {'GB/s':>6} {'vs bf16':>7}")
    for shape_name in args.shapes.split(","):
        n, k = SHAPES[shape_name]
        dense = torch.randn(n, k).bfloat16() * 0.05
        for fmt_name in args.formats.split(","):
            weight = _weight(fmt_name, n, k)
            cands = _candidates(weight)
            for m in map(int, args.m.split(",")):
                x = torch.randn(m, k).bfloat16()
                fns = {"bf16": lambda x=x, d=dense: torch.nn.functional.linear(x, d)} | {
                    name: (lambda fn=fn, p=p, x=x, f=weight.format: fn(x, p, f)) for name, (fn, p) in cands.items()}
                times = _interleaved(fns, args.repeats)
                for name, t in times.items():
                    nbytes = 2 * n * k if name == "bf16" else _weight_bytes(weight)
                    print(f"{shape_name:9} {m:3d} {fmt_name:8} {name:16} {t * 1e6:9.1f} {nbytes / t / 1e9:6.1f} "
                          f"{times['bf16'] / t:7.2f}")


def _weight(fmt_name: str, n: int, k: int):
    """Random codes, scales and minimums / zero points in the format's parts (their values do not change a
    kernel's time)."""
    import torch

    from optc.core.formats import Format, FormatKind
    from optc.core.ops import Param

    codes4 = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32)
    if fmt_name == "int4_g":
        fmt = Format(FormatKind.INT4_G, "bfloat16", bits=4, group_size=64, zero_point=True, packing="k8_lsb")
        parts = {"qweight": codes4, "scales": torch.rand(n, k // 64).bfloat16() * 0.01,
                 "zeros": torch.randint(0, 16, (n, k // 64), dtype=torch.uint8)}
    elif fmt_name == "int8_wo":
        fmt = Format(FormatKind.INT8_WO, "bfloat16", bits=8)
        parts = {"qweight": torch.randint(-127, 128, (n, k), dtype=torch.int8), "scales": torch.rand(n).bfloat16()}
    elif fmt_name == "int4_gf":
        fmt = Format(FormatKind.INT4_GF, "bfloat16", bits=4, group_size=32, zero_point=True, packing="k8_lsb")
        parts = {"qweight": codes4, "scales": torch.rand(n, k // 32) * 0.01, "mins": -torch.rand(n, k // 32) * 0.08}
    else:
        fmt = Format(FormatKind.INT8_GF, "bfloat16", bits=8, group_size=32)
        parts = {"qweight": torch.randint(-127, 128, (n, k), dtype=torch.int8), "scales": torch.rand(n, k // 32)}
    return Param(parts, fmt)


def _candidates(weight) -> dict:
    """Every CPU linear kernel of the table that takes the weight: name -> (launcher, prepared parts)."""
    from optc.kernels.registry import KERNELS, KernelQuery
    from optc.kernels.spec import _load

    q = KernelQuery("linear", "bfloat16", weight.format, tuple(_shape(weight)))
    out = {}
    for spec in KERNELS.values():
        if spec.target == "cpu" and spec.op == "linear" and spec.supports(q):
            params = {"weight": weight}
            parts = (_load(spec.prepare)(params) if spec.prepare else params)["weight"].parts
            out[spec.name.removeprefix("cpu.")] = (_load(spec.launcher), parts)
    return out


def _shape(weight) -> tuple[int, int]:
    q = weight.parts["qweight"]
    return q.shape[0], q.shape[1] * (8 if q.dtype.itemsize == 4 else 1)


def _weight_bytes(weight) -> int:
    """Bytes a kernel must read: every stored part (codes, scales, mins / zeros) once."""
    return sum(p.numel() * p.element_size() for p in weight.parts.values())


def _interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of one call per candidate; each round calls every candidate (a few calls each)."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            calls = 5
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - t0) / calls)
    return {name: statistics.median(s) for name, s in samples.items()}


if __name__ == "__main__":
    main()
