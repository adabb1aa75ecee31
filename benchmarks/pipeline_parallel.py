"""Pipeline parallelism on the CPU (gloo): throughput of P stages (x T tensor-parallel ranks) against one
rank, at one batch size, on a random Llama with layers worth cutting (default: random:llama-1k, 4 layers of
45 MB of float32 weights, built once under --work; or --artifact).

Per configuration (PxT, or PxT@M: micro-batches of at least M tokens, `pipeline_micro_batch_tokens`; 1 cuts
every step of two requests or more, a large M none), after one warm-up request:
- throughput: --batch requests of --prompt-len distinct tokens and --output-len greedy tokens each (EOS
  ignored) through `Engine.generate` in one batch: output tokens per second, prefill included;
- prefill: --batch requests of --prefill-len tokens and one output token each (one step when they fit the
  token budget of 2048): milliseconds;
- decode: the median `Engine.step` of --batch requests once their prompts are in. Rank 0 also times its
  own stage's compute (`Model.run_stage`) inside each decode step: the rest of the step is the wait for
  the later stages and the transfers. Configurations run interleaved,
--repeats times each, so that a shared machine's load moves them alike (the load average is printed).

Threads: one rank runs with the torch threads it is given (--threads, default all cores); with R > 1 ranks
every rank (rank 0 too) gets max(1, cores / R), as the engine gives its spawned ranks: the ranks share the
cores, so on a machine with fewer cores than ranks they take turns and P > 1 cannot be faster.

    python benchmarks/pipeline_parallel.py [--configs 1x1,2x1,2x1@1] [--batch 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

from optc.runtime import Engine, SamplingParams
from optc.testing import build_artifact

REPO = Path(__file__).resolve().parents[1]


class StageTimer:
    """Times rank 0's stage compute (Model.run_stage) while installed on a model."""

    def __init__(self, model) -> None:
        self.seconds = 0.0
        run = model.run_stage

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = run(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            return out

        model.run_stage = timed


def measure(artifact: Path, config: str, batch: int, prompt_len: int, output_len: int, prefill_len: int,
            threads: int) -> dict:
    sizes, _, micro = config.partition("@")
    pp, tp = (int(x) for x in sizes.split("x"))
    ranks = pp * tp
    torch.set_num_threads(threads if ranks == 1 else max(1, (os.cpu_count() or 1) // ranks))
    engine = Engine.load(artifact, pipeline_parallel_size=pp, tensor_parallel_size=tp, max_num_seqs=batch,
                         **({"pipeline_micro_batch_tokens": int(micro)} if micro else {}))
    try:
        vocab = engine.vocab_size
        prompts = [[(1000 + 7 * i + j) % vocab for j in range(prompt_len)] for i in range(batch)]
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        engine.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        t0 = time.perf_counter()
        completions = engine.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for c in completions)
        long = [[(3000 + 11 * i + j) % vocab for j in range(prefill_len)] for i in range(batch)]
        t0 = time.perf_counter()
        engine.generate(long, SamplingParams(max_tokens=1, ignore_eos=True))
        prefill_s = time.perf_counter() - t0
        timer = StageTimer(engine.model) if pp > 1 else None
        requests = [engine.add_request([(2000 + 5 * i + j) % vocab for j in range(prompt_len)], params)
                    for i in range(batch)]
        while any(r.num_output_tokens == 0 for r in requests):  # prefill
            engine.step()
        step_s, stage_s = [], []
        while engine.has_unfinished():
            before = timer.seconds if timer else 0.0
            t0 = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t0)
            stage_s.append((timer.seconds if timer else 0.0) - before)
        steps = len(step_s)
        return {"config": config, "pp": pp, "tp": tp, "ranks": ranks, "rank0_threads": torch.get_num_threads(),
                "pipeline_micro_batch_tokens": engine.config.pipeline_micro_batch_tokens,
                "output_tokens": tokens, "elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed,
                "prefill_ms": 1e3 * prefill_s,
                "decode_step_ms": 1e3 * statistics.median(step_s), "decode_steps": steps,
                "rank0_stage_ms": 1e3 * statistics.median(stage_s) if timer else None}
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, help="artifact folder (default: random:llama-1k float32, built once)")
    parser.add_argument("--work", type=Path, default=REPO / "build" / "bench-pp")
    parser.add_argument("--configs", default="1x1,2x1,2x1@1",
                        help="PxT[@M]: pipeline x tensor-parallel sizes [micro-batch tokens], comma-separated")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of one rank")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    artifact = args.artifact or args.work / "llama-1k-f32"
    if not artifact.exists():
        build_artifact(artifact, REPO / "recipes" / "tiny.yaml", "model=random:llama-1k",
                       "runtime={max_num_seqs: 64, max_seq_len: 1024}")
    load_start, rows = os.getloadavg(), []
    for repeat in range(args.repeats):
        for config in args.configs.split(","):
            row = measure(artifact, config, args.batch, args.prompt_len, args.output_len, args.prefill_len,
                          args.threads)
            rows.append({"repeat": repeat, **row})
            print(f"{config}: {row['output_tokens_per_s']:.1f} output tok/s, prefill {row['prefill_ms']:.0f} ms, "
                  f"decode step {row['decode_step_ms']:.1f} ms" + (f" (rank 0's stage {row['rank0_stage_ms']:.1f} ms)"
                                                       if row["rank0_stage_ms"] is not None else ""), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
              "commit": commit.stdout.strip(),
              "load_average": {"start": load_start, "end": os.getloadavg()}, "cpu_count": os.cpu_count(),
              "isa": os.environ.get("ATEN_CPU_CAPABILITY", "default"), "artifact": str(artifact),
              "threads": args.threads, "batch": args.batch, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "prefill_len": args.prefill_len, "rows": rows}
    print(f"{report['date']} {report['commit']}  load average (1, 5, 15 min) at start {load_start}, at end "
          f"{os.getloadavg()}, {os.cpu_count()} CPUs")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
