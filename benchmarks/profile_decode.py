"""Where a decode step's GPU time goes, per kernel, on the 8B serving artifacts (needs CUDA).

Builds (or reuses) the 8B artifact of benchmarks/serving.py, times batch-`B` decode steps with and
without CUDA graphs, runs the eager ones under torch.profiler, and prints the GPU time per kernel name
per step, largest first.

    python benchmarks/profile_decode.py --config int4 --batch 1
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict
from pathlib import Path

import torch
from serving import CUDA_QUANT, cuda_artifact

from optc.runtime.engine import Engine
from optc.runtime.sampler import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def _steps(engine: Engine, batch: int, n: int, window=contextlib.nullcontext()) -> float:
    """Median seconds of `n` decode steps with `batch` running requests (after their prefill);
    `window` (a profiler) is entered around those `n` steps only."""
    for _ in range(batch):
        engine.add_request([1] * 128, SamplingParams(max_tokens=n + 8, ignore_eos=True))
    engine.step()
    while engine.stats().num_waiting:
        engine.step()
    times = []
    with window:
        for _ in range(n):
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=tuple(CUDA_QUANT), default="int4",
                   help="which 8B build of benchmarks/serving.py (default int4: RTN g128)")
    p.add_argument("--batch", type=int, default=1, help="running requests during the decode steps (default 1)")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed and profiled (default 20)")
    p.add_argument("--work", type=Path, default=REPO / "build" / "bench-serving",
                   help="where the artifact is built or found (default build/bench-serving)")
    args = p.parse_args()
    artifact, _ = cuda_artifact(args.work, args.config)
    for eager in (False, True):
        engine = Engine.load(artifact, device="cuda", verify=False, max_num_seqs=args.batch, enforce_eager=eager)
        _steps(engine, args.batch, 5)
        median = _steps(engine, args.batch, args.steps)
        print(f"{args.config} batch {args.batch} {'eager' if eager else 'graphs'}: step {median * 1e3:.2f} ms",
              flush=True)
        if eager:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            _steps(engine, args.batch, args.steps, prof)
        del engine
        torch.cuda.empty_cache()
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name][0] += event.device_time_total
            per_kernel[event.name][1] += 1
    total = sum(t for t, _ in per_kernel.values())
    print(f"GPU time in kernels: {total / args.steps / 1e3:.2f} ms per eager decode step")
    print(f"{'us/step':>9} {'share':>6} {'calls':>6}  kernel")
    for name, (t, calls) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"{t / args.steps:9.1f} {t / total:6.1%} {calls:6d}  {name[:110]}")


if __name__ == "__main__":
    main()
