"""The LoRA deltas of one decode step alone: kernels/cpu_ext/lora.cpp's lora_add on the CPU, kernels/lora_bgmv.py's
Triton kernel on CUDA (runtime/lora.py's `apply` either way) on
every linear of an artifact that adapters may target, random factors of `--rank` on every projection in every slot,
`--batch` rows spread over slots as given, best of `--repeats` (ms per step). What profiles the CPU path without
the rest of the step (benchmarks/lora.py times the whole decode).

    python benchmarks/lora_deltas.py ARTIFACT [--batch 8] [--rank 16] [--slots 0,1,2,3] [--repeats 7]
        [--device cpu|cuda] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from optc.core.artifact import read
from optc.core.formats import DTYPES
from optc.runtime.lora import LoraSlots


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", default="0,1,2,3", help="the rows' slots, repeated over the batch (-1: no adapter)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the factors and rows live")
    p.add_argument("--json", type=Path, help="also write the result as JSON here")
    a = p.parse_args()
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    graph = read(a.artifact, verify=False).graph
    cycle = [int(s) for s in a.slots.split(",")]
    num_slots = max(max(cycle) + 1, 1)
    lora = LoraSlots(graph, num_slots, a.rank, device)
    if lora.kernel is None:
        raise SystemExit("lora.cpp could not be built here (see the warning above)")
    g = torch.Generator().manual_seed(0)
    for table in lora.tables.values():
        for part, size in enumerate(table.sizes):  # each projection its own rank columns, as an adapter loads
            cols = slice(part * a.rank, (part + 1) * a.rank)
            rows = slice(table.offsets[part], table.offsets[part] + size)
            table.a[:, cols] = torch.randn(table.a[:, cols].shape, generator=g).to(table.a)
            table.bt[:, cols, rows] = torch.randn(table.bt[:, cols, rows].shape, generator=g).to(table.bt)
            table.parts[:, part] = torch.tensor([part * a.rank, a.rank])
    slots = torch.tensor([cycle[i % len(cycle)] for i in range(a.batch)], device=device)
    dtype = DTYPES[graph.config.dtype]
    inputs = {n: torch.randn(a.batch, t.a.shape[2], generator=g).to(device, dtype) for n, t in lora.tables.items()}
    outputs = {n: [torch.zeros(a.batch, s, dtype=dtype, device=device) for s in t.sizes]
               for n, t in lora.tables.items()}
    load_before, times = os.getloadavg()[0], []
    for _ in range(a.repeats + 1):  # the first run compiles (Triton) or warms caches: not counted
        sync()
        start = time.perf_counter()
        for name in lora.tables:
            lora.apply(name, inputs[name], outputs[name], slots, None)
        sync()
        times.append(time.perf_counter() - start)
    best = min(times[1:])
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    factors = lora.tables[next(iter(lora.tables))].a.dtype
    print(f"{a.artifact.name}: {len(lora.tables)} linears, batch {a.batch} over slots {a.slots}, rank {a.rank}, "
          f"factors {factors}, {where}, load {load_before:.1f} -> {os.getloadavg()[0]:.1f}: "
          f"{best * 1e3:.3f} ms a step (best of {a.repeats})")
    if a.json:
        a.json.write_text(json.dumps({"artifact": str(a.artifact), "linears": len(lora.tables), "batch": a.batch,
                                      "slots": a.slots, "rank": a.rank, "factors": str(factors), "device": where,
                                      "repeats": a.repeats, "best_ms": best * 1e3}, indent=1) + "\n")


if __name__ == "__main__":
    main()
