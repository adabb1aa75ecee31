"""Decode tok/s of each model family at one size, against the Llama shape: random checkpoints of SmolLM2's size in
each family's form (`random:llama-135m`, `qwen3-135m`, `gemma3-135m`, `phi3-135m`; optc/frontend/sources.py)
built with SmolLM2's bf16 recipe (recipes/smollm2-bf16.yaml: fused qkv / gate_up, the kernels select_kernels times on
this machine, the fused CPU step planned), on the CPU, at batch 1.

Every artifact is built into `--work` unless already there, and loaded once; with `--node-by-node` each is loaded a
second time with its planned runs unfused (the fused step's ablation). Then `--rounds` rounds each run every config
in turn (llama, qwen3, ... llama, qwen3, ...), so load on a shared machine falls on all of them alike. A run is
`--batch` requests of `--input-len` prompt tokens and `--output-len` greedy output tokens, EOS ignored; tok/s =
output tokens / wall time of the run, the prefill included (benchmarks/quant_speed.py's `optc_run`). The table gives
each config's median over rounds, its ratio to the Llama shape's median, and the median of the per-round ratios (a
round's configs ran back to back). The issue's point (48): each family >= 0.9x the Llama shape. It measures; it
asserts nothing.

    python benchmarks/family_speed.py --threads 2 --rounds 5 --json benchmarks/results/family-speed.json
    python benchmarks/family_speed.py --families qwen3-moe-tiny,deepseek-v2-tiny --baseline qwen3-moe-tiny \\
        --node-by-node
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from optc.runtime import Engine
from optc.testing import build_artifact

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_speed import _machine, optc_run, prompts  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "smollm2-bf16.yaml"
FAMILIES = ("llama-135m", "qwen3-135m", "gemma3-135m", "phi3-135m")
NODES = " (node by node)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(FAMILIES), help="random: presets, comma-separated")
    p.add_argument("--baseline", default=FAMILIES[0], help="the config the ratio columns divide by")
    p.add_argument("--work", type=Path, default=REPO / "build" / "family-speed", help="where artifacts are built")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, the core count)")
    p.add_argument("--node-by-node", action="store_true", help="also run each artifact node by node")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    families = args.families.split(",")
    if args.baseline not in families:
        p.error(f"--baseline {args.baseline} is not one of --families ({args.families})")
    engines: dict[str, Engine] = {}
    for family in families:
        path = args.work / family
        if not (path / "manifest.json").exists():
            print(f"building random:{family} with {RECIPE.name}", flush=True)
            build_artifact(path, RECIPE, model=f"random:{family}")
        engines[family] = Engine.load(path, max_num_seqs=args.batch, enable_prefix_caching=False)
        if args.node_by_node:
            engines[family + NODES] = Engine.load(path, max_num_seqs=args.batch, enable_prefix_caching=False)
            engines[family + NODES].model.executor.unfuse()
    work = prompts(engines[families[0]].tokenizer, args.batch, args.input_len)
    for engine in engines.values():  # warm-up: first calls, prepared layouts
        optc_run(engine, work, args.output_len)
    runs: dict[str, list[float]] = {n: [] for n in engines}
    loads = []
    for r in range(args.rounds):
        before = os.getloadavg()[0]
        for name, engine in engines.items():
            runs[name].append(optc_run(engine, work, args.output_len)[0])
        loads.append((before, os.getloadavg()[0]))
        print(f"round {r + 1}: load {before:.2f} -> {loads[-1][1]:.2f}; "
              + ", ".join(f"{n} {v[-1]:.1f}" for n, v in runs.items()), flush=True)
    base = statistics.median(runs[args.baseline])
    summary = {}
    print(f"\nbatch {args.batch}, {torch.get_num_threads()} threads, CPU ({torch.backends.cpu.get_cpu_capability()}), "
          f"{args.input_len} prompt + {args.output_len} output tokens, {args.rounds} rounds, load average "
          f"{min(x for x, _ in loads):.2f}-{max(y for _, y in loads):.2f}")
    print(f"| config | tok/s (median) | vs {args.baseline} | median of the rounds' ratios |")
    print("|---|---:|---:|---:|")
    for name, values in runs.items():
        median = statistics.median(values)
        per_round = statistics.median(v / b for v, b in zip(values, runs[args.baseline], strict=True))
        summary[name] = {"runs": values, "median": median, "vs_baseline": median / base, "round_ratio": per_round}
        print(f"| {name} | {median:.1f} | {median / base:.2f}x | {per_round:.2f}x |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**_machine(), "threads": torch.get_num_threads(), "batch": args.batch,
                                         "input_len": args.input_len, "output_len": args.output_len,
                                         "baseline": args.baseline, "loads": loads, "results": summary,
                                         "artifacts": {f: str(args.work / f) for f in families}}, indent=1))


if __name__ == "__main__":
    main()
