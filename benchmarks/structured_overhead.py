"""Constrained decoding's cost on SmolLM2 (issue 45's acceptance): median inter-token latency with a JSON schema
against unconstrained at batch 1 and 16, in process through `Engine`, and each schema's cold compile time.

A step is timed only while every row of the batch is decoding (after the prefill step, before the first row
finishes): a constrained row ends when its JSON does, so max_tokens is large and the unconstrained rows
ignore EOS and stop at 64 tokens. The configurations alternate round by round, in ABBA order (unconstrained,
constrained, constrained, unconstrained, ...), so that drift and a loaded machine slow both alike; the ratio is
of medians over all rounds, and the spread of the per-round ratios is reported beside it. Compile
time: a fresh GrammarCompiler (empty cache) per schema, as the server compiles a schema it has not seen.

    python benchmarks/structured_overhead.py ARTIFACT --threads 2 --json benchmarks/results/structured-avx512.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/structured_overhead.py ARTIFACT ...

Not measured here: the server's HTTP and detokenization, speculative decoding, CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from json_schemas import CASES  # noqa: E402

from optc.runtime import Engine, SamplingParams  # noqa: E402
from optc.runtime.grammar import GrammarCompiler, GrammarSpec  # noqa: E402

MAX_TOKENS = 512  # constrained rows end with their JSON (tens of tokens) well before this
UNCONSTRAINED_TOKENS = 64  # about as long as the suite's JSON answers, so both are timed at similar contexts


def decode_step_times(engine: Engine, batch: int, constrained: bool, offset: int) -> list[float]:
    """Seconds per step while all `batch` rows decode; row i asks case (offset + i)'s prompt, with its schema
    where `constrained`."""
    requests = []
    for i in range(batch):
        case = CASES[(offset + i) % len(CASES)]
        grammar = GrammarSpec.json_schema(case.json_schema(strict=True)) if constrained else None
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS if constrained else UNCONSTRAINED_TOKENS,
                                grammar=grammar, ignore_eos=not constrained)
        requests.append(engine.add_request(case.prompt, params, chat=True))
    times = []
    while engine.has_unfinished():
        decoding = all(r.num_output_tokens >= 1 and not r.finish_reason for r in requests)
        start = time.perf_counter()
        stepped = engine.step()
        elapsed = time.perf_counter() - start
        if decoding and len(stepped) == batch and all(r.num_output_tokens >= 2 for r in requests):
            times.append(elapsed)
    return times


def compile_times(engine: Engine) -> dict[str, float]:
    """Cold compile seconds per case: a fresh compiler each (its tokenizer setup not counted)."""
    out = {}
    for case in CASES:
        compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, sorted(engine._eos_token_ids))
        spec = GrammarSpec.json_schema(case.json_schema(strict=True))
        start = time.perf_counter()
        compiler.matcher(spec)
        out[case.name] = time.perf_counter() - start
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifact")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10, help="rounds per configuration and batch")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.load(args.artifact)
    env = {"host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "isa": torch.backends.cpu.get_cpu_capability(), "load_before": os.getloadavg(),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip(),
           "cpu": _cpu_name()}
    compiled = compile_times(engine)
    for case in CASES:  # warm the engine's cache: the decode timing leaves compiling out
        engine.grammars.matcher(GrammarSpec.json_schema(case.json_schema(strict=True)))
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        steps: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
        round_medians: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
        for round_ in range(args.rounds):
            for name in (list(steps) if round_ % 2 == 0 else list(steps)[::-1]):  # ABBA: drift hits both alike
                times = decode_step_times(engine, batch, name == "json_schema", offset=round_ * batch)
                steps[name] += times
                round_medians[name].append(statistics.median(times))
        medians = {name: statistics.median(t) * 1e3 for name, t in steps.items()}
        per_round = sorted(c / u for c, u in zip(round_medians["json_schema"], round_medians["unconstrained"],
                                                 strict=True))
        row = {"batch": batch, "itl_ms": medians, "num_steps": {n: len(t) for n, t in steps.items()},
               "ratio": medians["json_schema"] / medians["unconstrained"],
               "round_ratios": {"min": per_round[0], "median": statistics.median(per_round), "max": per_round[-1]}}
        rows.append(row)
        print(f"batch {batch}: unconstrained {medians['unconstrained']:.2f} ms, json_schema "
              f"{medians['json_schema']:.2f} ms, ratio {row['ratio']:.3f} (rounds {per_round[0]:.3f}.."
              f"{per_round[-1]:.3f}; {row['num_steps']})", flush=True)
    ms = sorted(v * 1e3 for v in compiled.values())
    print(f"compile (cold, ms): median {statistics.median(ms):.1f}, max {ms[-1]:.1f}")
    env["load_after"] = os.getloadavg()
    result = {"env": env, "itl": rows, "compile_ms": {k: v * 1e3 for k, v in compiled.items()}}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
