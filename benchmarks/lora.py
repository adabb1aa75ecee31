"""Batched LoRA adapters on the CPU: decode throughput of a batch of requests spread over several adapters against the
same batch on the base alone, one engine, in-process.

    python benchmarks/lora.py ARTIFACT [--batch 8] [--adapters 4] [--rank 16] [--input-len 32] [--output-len 64]
        [--repeats 3] [--json benchmarks/results/lora-....json]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/lora.py ARTIFACT    # capped to AVX2

The adapters are random (seeded), written in peft's format from the artifact's own linear shapes, each targeting
q/k/v/o/gate/up/down at `--rank`, so no checkpoint is needed. Runs, each over the same prompts (random token ids):
`base` (no request has an adapter: the fused CPU step where the artifact plans it), `lora` (request i under adapter
i % adapters: the same fused step, each targeted linear adding its rows' deltas, kernels/cpu_ext/lora.cpp's
lora_add), and `lora-unfused` / `base-unfused` (both with the fused runs dropped: the node-by-node path).
The runs alternate round by round (base, lora, base, lora, ...), so that a change of the machine's load falls on
both. It prints decode tok/s = generated tokens / wall seconds of the decode steps (the prefill step excluded; each
run warmed up first at its own batch), the best of `--repeats` rounds, and lora / base; `--json` writes them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from optc.core.artifact import read
from optc.core.lora import TARGETS, linear_targets
from optc.runtime import Engine, SamplingParams


def write_adapters(artifact: Path, out: Path, count: int, rank: int) -> list[Path]:
    """`count` random peft adapters over the artifact's projections (a fused linear's: its split outputs)."""
    targets = {m: t for m, t in linear_targets(read(artifact, verify=False).graph).items()
               if m.rsplit(".", 1)[-1] in TARGETS}
    g = torch.Generator().manual_seed(0)
    folders = []
    for i in range(count):
        folder = out / f"adapter{i}"
        folder.mkdir(parents=True)
        tensors = {}
        for module, t in targets.items():
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, t.in_features, generator=g) / 8
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(t.rows, rank, generator=g) / 64
        save_file(tensors, folder / "adapter_model.safetensors")
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGETS)}))
        folders.append(folder)
    return folders


def decode_tok_s(engine: Engine, prompts: list[list[int]], output_len: int, loras: list[str | None]) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for prompt, lora in zip(prompts, loras, strict=True):
        engine.add_request(prompt, params, lora=lora)
    engine.step()  # the prefill step (every prompt fits one step)
    start, before = time.perf_counter(), engine.stats().num_generated_tokens
    while engine.has_unfinished():
        engine.step()
    return (engine.stats().num_generated_tokens - before) / (time.perf_counter() - start)


def _commit() -> str:
    """This checkout's commit, '+' where its tracked files differ from it."""
    here = Path(__file__).parent
    run = functools.partial(subprocess.run, capture_output=True, text=True, cwd=here, check=False)
    sha = run(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
    return sha + ("+" if run(["git", "diff", "--quiet", "HEAD"]).returncode else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the conditions and results here (benchmarks/results/...)")
    a = p.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folders = write_adapters(a.artifact, Path(tmp), a.adapters, a.rank)
        engine = Engine.load(a.artifact, max_loras=a.adapters, max_lora_rank=a.rank, max_num_seqs=a.batch,
                             enable_prefix_caching=False)
        names = [f"adapter{i}" for i in range(a.adapters)]
        for name, folder in zip(names, folders, strict=True):
            engine.load_lora(name, folder)
    g = torch.Generator().manual_seed(1)
    vocab = engine.vocab_size
    prompts = [torch.randint(3, vocab, (a.input_len,), generator=g).tolist() for _ in range(a.batch)]
    runs = {"base": [None] * a.batch, "lora": [names[i % a.adapters] for i in range(a.batch)]}
    results: dict[str, float] = {}
    fused = engine.model.fused_runs
    for mode in ("", "-unfused"):
        if mode:
            engine.model.executor.unfuse()
        for loras in runs.values():  # warm-up at the run's batch: one-time preparation of its row counts is not timed
            decode_tok_s(engine, prompts, 4, loras)
        for _ in range(a.repeats):
            for name, loras in runs.items():
                tok_s = decode_tok_s(engine, prompts, a.output_len, loras)
                results[name + mode] = max(results.get(name + mode, 0.0), tok_s)
    load = os.getloadavg()[0]
    conditions = {"artifact": str(a.artifact), "batch": a.batch, "adapters": a.adapters, "rank": a.rank,
                  "input_len": a.input_len, "output_len": a.output_len, "threads": torch.get_num_threads(),
                  "isa": torch.backends.cpu.get_cpu_capability(), "cpu": platform.processor() or platform.machine(),
                  "fused_runs": fused, "repeats": a.repeats, "load_before": load_before, "load_after": load,
                  "commit": _commit(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(f"{a.artifact.name}: batch {a.batch}, {a.adapters} adapters of rank {a.rank} on q/k/v/o/gate/up/down, "
          f"{a.input_len} prompt + {a.output_len} output tokens, {conditions['threads']} threads, {conditions['isa']}, "
          f"{conditions['cpu']}, fused runs {fused}, best of {a.repeats}, load {load_before:.1f} -> {load:.1f}")
    for name, tok_s in results.items():
        base = results["base" + name[name.index("-"):] if "-" in name else "base"]
        print(f"  {name:<13} {tok_s:8.1f} decode tok/s   {tok_s / results['base']:5.2f}x base   "
              f"{tok_s / base:5.2f}x its base")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"conditions": conditions, "decode_tok_s": results}, indent=1) + "\n")

if __name__ == "__main__":
    main()
