"""The moe block on the CPU: the reference (each chosen expert's weight dequantized per call) against
`cpu.moe_packed` (each chosen expert through the packed int8 / int4 matmuls), bfloat16 activations, one
thread, at a Mixtral-like layer shrunk to fit the 2-core VM (E experts, top-k, hidden H, expert size I).

    python benchmarks/moe_cpu.py [--experts 8] [--top-k 2] [--hidden 1024] [--intermediate 1024] [--repeats 15]

Per format and T (tokens in the step) it prints the best of `--repeats` calls of each and the weight bytes
the packed path must read: experts hit x 3 x H x I x bits / 8 (gate, up and down of each expert some token
chose; scales not counted), and that over the packed time in GB/s.
"""

from __future__ import annotations

import argparse
import time

import torch

from optc.core.ops import Param
from optc.core.ops.moe import moe_ref, route
from optc.frontend.quant.options import per_expert
from optc.frontend.quant.rtn import make_format, quantize_weight
from optc.kernels.moe_cpu import moe_packed, prepare_moe_packed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args()
    torch.set_num_threads(1)
    e, k, h, i = a.experts, a.top_k, a.hidden, a.intermediate
    g = torch.Generator().manual_seed(0)
    router = torch.randn(e, h, generator=g).bfloat16()
    weights = {"gate_up": torch.randn(e, 2 * i, h, generator=g) / h**0.5,
               "down": torch.randn(e, h, i, generator=g) / i**0.5}
    print(f"E={e} top-{k} H={h} I={i}, bfloat16, 1 thread, best of {a.repeats}")
    for bits in (8, 4):
        fmt = make_format(bits, 128, bits == 4, "bfloat16")
        params = {n: Param(per_expert(quantize_weight, w, fmt, n), fmt) for n, w in weights.items()}
        packed = prepare_moe_packed(params)
        for t in (1, 8, 64):
            x = torch.randn(t, h, generator=g).bfloat16()
            hit = len(route(x, router, k, True)[1].unique())
            ref = _best(moe_ref, (x, router, params["gate_up"].parts, fmt, params["down"].parts, fmt, k, True),
                        a.repeats)
            ker = _best(moe_packed, (x, router, packed["gate_up"].parts, fmt, packed["down"].parts, fmt, k, True),
                        a.repeats)
            nbytes = hit * 3 * h * i * bits // 8
            print(f"int{bits} T={t:<3} experts hit {hit}: reference {ref * 1e3:7.2f} ms   moe_packed "
                  f"{ker * 1e3:6.2f} ms ({ref / ker:4.1f}x)   {nbytes / 2**20:.1f} MiB -> "
                  f"{nbytes / ker / 1e9:.1f} GB/s")


def _best(fn, args: tuple, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


if __name__ == "__main__":
    main()
