"""Where a CPU decode step's time goes: torch ops against Python, per op and per graph node kind.

Loads an artifact on the CPU, starts `--batch` requests (a `--prompt-len`-token prompt each), then
times `--steps` decode steps (median) and runs them again under torch.profiler. Prints the step time,
the ops' self CPU time per step (largest first), their sum and what is left (Python: the engine,
the executor's node loop, the op adapters), and the time per node op measured by wrapping each node's
implementation (one timer around each call, so it includes that node's Python and its torch ops).

    python benchmarks/profile_cpu_step.py build/smollm2-bf16 --batch 1 --steps 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from optc.runtime import Engine, SamplingParams


def decode_steps(engine: Engine, batch: int, prompt_len: int, steps: int, window=None) -> list[float]:
    """Seconds of each of `steps` decode steps with `batch` running requests (after their prefill)."""
    for i in range(batch):
        engine.add_request([10 + i] * prompt_len, SamplingParams(max_tokens=steps + 4, ignore_eos=True))
    while engine.stats().num_waiting or not engine.stats().num_running:
        engine.step()
    engine.step()  # the step that finishes the prefills' sampling
    times = []
    if window is not None:
        window.__enter__()
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    if window is not None:
        window.__exit__(None, None, None)
    while engine.has_unfinished():
        engine.step()
    return times


def per_node_op(engine: Engine, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    """Seconds per step spent in each node op's implementation (Python included)."""
    executor = engine.model.executor
    spent: dict[str, float] = defaultdict(float)
    original = list(executor._impls)

    def timed(impl, op):
        def call(node, inputs, params, step):
            t0 = time.perf_counter()
            out = impl(node, inputs, params, step)
            spent[op] += time.perf_counter() - t0
            return out
        return call

    executor._impls = [timed(impl, n.op) for impl, n in zip(original, executor.graph.nodes, strict=True)]
    try:
        for _ in range(2):
            spent.clear()
            decode_steps(engine, batch, prompt_len, steps)
    finally:
        executor._impls = original
    return {op: t / steps for op, t in spent.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.load(args.artifact, max_num_seqs=args.batch, enable_prefix_caching=False)
    decode_steps(engine, args.batch, args.prompt_len, 4)  # warm-up
    step = statistics.median(decode_steps(engine, args.batch, args.prompt_len, args.steps))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        decode_steps(engine, args.batch, args.prompt_len, args.steps)
    ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    ops.sort(key=lambda e: -e.self_cpu_time_total)
    total_ops = sum(e.self_cpu_time_total for e in ops) / args.steps / 1e3  # ms per step (prefill steps excluded)
    print(f"{args.artifact}: batch {args.batch}, {torch.get_num_threads()} threads, decode step median "
          f"{step * 1e3:.2f} ms")
    print(f"torch ops' self CPU time {total_ops:.2f} ms per step (profiled steps run slower than the median above)")
    print(f"{'op':<44} {'ms/step':>8} {'calls/step':>10}")
    for e in ops[: args.top]:
        print(f"{e.key:<44} {e.self_cpu_time_total / args.steps / 1e3:8.3f} {e.count / args.steps:10.1f}")
    nodes = per_node_op(engine, args.batch, args.prompt_len, args.steps)
    print(f"\nper node op (Python of the node included), ms per step; sum {sum(nodes.values()) * 1e3:.2f}")
    for op, t in sorted(nodes.items(), key=lambda kv: -kv[1]):
        print(f"  {op:<20} {t * 1e3:8.3f}")


if __name__ == "__main__":
    main()
