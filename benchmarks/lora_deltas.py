"""The LoRA deltas of one decode step alone: kernels/cpu_ext/lora.cpp's lora_add (runtime/lora.py's `apply`) on
every linear of an artifact that adapters may target, random factors of `--rank` on every projection in every slot,
`--batch` rows spread over slots as given, best of `--repeats` (ms per step). What profiles the CPU path without
the rest of the step (benchmarks/lora.py times the whole decode).

    python benchmarks/lora_deltas.py ARTIFACT [--batch 8] [--rank 16] [--slots 0,1,2,3] [--repeats 7]
"""

from __future__ import annotations

import argparse
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
    a = p.parse_args()
    graph = read(a.artifact, verify=False).graph
    cycle = [int(s) for s in a.slots.split(",")]
    num_slots = max(max(cycle) + 1, 1)
    lora = LoraSlots(graph, num_slots, a.rank, torch.device("cpu"))
    if lora.kernel is None:
        raise SystemExit("lora.cpp could not be built here (see the warning above)")
    g = torch.Generator().manual_seed(0)
    for table in lora.tables.values():
        for part, size in enumerate(table.sizes):  # each projection its own rank columns, as an adapter loads
            cols = slice(part * a.rank, (part + 1) * a.rank)
            rows = slice(table.offsets[part], table.offsets[part] + size)
            table.a[:, cols] = torch.randn(table.a[:, cols].shape, generator=g).to(table.a.dtype)
            table.bt[:, cols, rows] = torch.randn(table.bt[:, cols, rows].shape, generator=g).to(table.bt.dtype)
            table.parts[:, part] = torch.tensor([part * a.rank, a.rank])
    slots = torch.tensor([cycle[i % len(cycle)] for i in range(a.batch)])
    dtype = DTYPES[graph.config.dtype]
    inputs = {n: torch.randn(a.batch, t.a.shape[2], generator=g).to(dtype) for n, t in lora.tables.items()}
    outputs = {n: [torch.zeros(a.batch, s, dtype=dtype) for s in t.sizes] for n, t in lora.tables.items()}
    load_before, best = os.getloadavg()[0], float("inf")
    for _ in range(a.repeats):
        start = time.perf_counter()
        for name in lora.tables:
            lora.apply(name, inputs[name], outputs[name], slots, None)
        best = min(best, time.perf_counter() - start)
    print(f"{a.artifact.name}: {len(lora.tables)} linears, batch {a.batch} over slots {a.slots}, rank {a.rank}, "
          f"factors {lora.tables[next(iter(lora.tables))].a.dtype}, {torch.get_num_threads()} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}, load {load_before:.1f} -> {os.getloadavg()[0]:.1f}: "
          f"{best * 1e3:.2f} ms a step (best of {a.repeats})")


if __name__ == "__main__":
    main()
