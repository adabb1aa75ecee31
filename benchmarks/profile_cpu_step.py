"""Where a CPU decode step's time goes: the engine around the forward, the executor's node loop, each node's
Python (op adapter, kernel-table routing, launcher checks) and each node's kernel, per node op.

Loads an artifact on the CPU, starts `--batch` requests (a `--prompt-len`-token prompt each) and times
`--steps` decode steps, wall and CPU (medians). Then, over the same kind of steps, it times three nested
levels at once: `Engine.step`, the model's forward (the executor's run) and every node's implementation
call. Finally it records, during one decode step, each node's innermost kernel calls (ops.cpp's and
qdot.cpp's functions, torch's packed int4 matmul; a node whose launcher calls something else is recorded
as its whole implementation) with their arguments, and replays them back to back, as a step would run
with no Python between kernels: that is each node kind's kernel time. Reported per step:

    engine (outside the forward)   = Engine.step - forward
    executor loop                  = forward - sum of node calls (the wrappers' own cost is estimated
                                     and taken out)
    per node op: call, kernel, Python = call - kernel

Where the model has fused runs of nodes (the plan's, kernels/cpu_ext/step.py), the step is timed and broken down
both ways, node by node and fused (the modes' step timings interleaved round by round); the fused run is one
entry, its kernels inside it not split. The timers themselves cost about a microsecond a node (printed). At 1
thread the figures are the main thread's CPU time, the comparison on a loaded machine; with more threads, wall
time.

    python benchmarks/profile_cpu_step.py build/smollm2-gguf --batch 1 --steps 32 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

from optc.kernels import cpu_ext
from optc.runtime import Engine, SamplingParams

FUSED = "fused runs (one C++ call each)"  # the executor's planned runs (kernels/cpu_ext/step.py), when it has any


def start(engine: Engine, batch: int, prompt_len: int, steps: int) -> None:
    """Add `batch` requests and run until every one decodes (its prefill done and sampled)."""
    for i in range(batch):
        engine.add_request([10 + i] * prompt_len, SamplingParams(max_tokens=steps + 4, ignore_eos=True))
    while engine.stats().num_waiting or not engine.stats().num_running:
        engine.step()
    engine.step()


def finish(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def decode_steps(engine: Engine, batch: int, prompt_len: int, steps: int) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds of each of `steps` decode steps with `batch` running requests."""
    start(engine, batch, prompt_len, steps)
    times = []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    finish(engine)
    return times


class Levels:
    """Timers around Engine.step, the model's forward and each node's implementation (wall seconds)."""

    def __init__(self, engine: Engine, clock):
        self.engine, self.model, self.clock = engine, engine.model, clock
        self.executor = self.model.executor
        self.step, self.forward = [], []
        self.nodes: dict[str, float] = defaultdict(float)
        self.calls = 0

    @contextmanager
    def installed(self):
        model, executor = self.model, self.executor
        forward, impls = model.forward, list(executor._impls)
        nodes, clock = self.nodes, self.clock

        def timed_forward(*args, **kwargs):
            t0 = clock()
            out = forward(*args, **kwargs)
            self.forward.append(clock() - t0)
            return out

        def timed(impl, op):
            def call(node, inputs, params, step):
                t0 = clock()
                out = impl(node, inputs, params, step)
                nodes[op] += clock() - t0
                self.calls += 1
                return out
            return call

        fused = dict(executor._fused)

        def timed_run(fn):
            def call(values, step):
                t0 = clock()
                out = fn(values, step)
                nodes[FUSED] += clock() - t0
                self.calls += 1
                return out
            return call

        model.forward = timed_forward
        executor._impls = [timed(impl, n.op) for impl, n in zip(impls, executor.graph.nodes, strict=True)]
        executor._fused = {i: (stop, names, outs, timed_run(fn), dead)
                           for i, (stop, names, outs, fn, dead) in fused.items()}
        try:
            yield self
        finally:
            del model.forward
            executor._impls = impls
            executor._fused = fused

    def run(self, batch: int, prompt_len: int, steps: int) -> None:
        start(self.engine, batch, prompt_len, steps)
        self.step.clear(), self.forward.clear(), self.nodes.clear()
        self.calls = 0
        for _ in range(steps):
            t0 = self.clock()
            self.engine.step()
            self.step.append(self.clock() - t0)
        finish(self.engine)


class Recorder:
    """Records the innermost kernel calls of one step, tagged with the node op that made them."""

    def __init__(self):
        self.calls: list[tuple[str, object, tuple]] = []
        self.op: str | None = None
        self.inner = 0  # kernel calls recorded inside the current node

    def wrap(self, fn):
        def call(*args):
            if self.op is not None:
                self.calls.append((self.op, fn, args))
                self.inner += 1
            return fn(*args)
        return call


@contextmanager
def recording(executor, recorder: Recorder):
    """Route the C++ extension's ops.cpp and qdot.cpp functions and torch's int4pack matmul through `recorder`; a
    node whose implementation made no such call is recorded whole."""
    ext = cpu_ext.load()
    wrapped = {f: recorder.wrap(getattr(ext, f)) for f in ("rms_norm", "silu_mul", "rope_kv_store", "row_attention",
                                                           "qlinear")} if ext else {}
    # the other functions (bf16dot, lora_add, Run, best_isa) as they are
    proxies = {"load": SimpleNamespace(**{**vars(ext), **wrapped}) if ext else None}
    saved = {name: getattr(cpu_ext, name) for name in proxies}
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    impls = list(executor._impls)

    def node_call(impl, op):
        def call(node, inputs, params, step):
            recorder.op, recorder.inner = op, 0
            out = impl(node, inputs, params, step)
            if recorder.inner == 0:
                recorder.calls.append((op, impl, (node, inputs, params, step)))
            recorder.op = None
            return out
        return call

    fused = dict(executor._fused)

    def run_call(fn):  # a fused run is recorded whole
        def call(values, step):
            out = fn(values, step)
            if out is not None:
                recorder.calls.append((FUSED, fn, (values, step)))
            return out
        return call

    executor._fused = {i: (stop, names, outs, run_call(fn), dead) for i, (stop, names, outs, fn, dead) in fused.items()}
    for name, proxy in proxies.items():
        setattr(cpu_ext, name, (lambda p=proxy: p))
    torch.ops.aten._weight_int4pack_mm_for_cpu = recorder.wrap(mm)
    executor._impls = [node_call(impl, n.op) for impl, n in zip(impls, executor.graph.nodes, strict=True)]
    try:
        yield recorder
    finally:
        for name, fn in saved.items():
            setattr(cpu_ext, name, fn)
        torch.ops.aten._weight_int4pack_mm_for_cpu = mm
        executor._impls = impls
        executor._fused = fused


def replay(calls, rounds: int, clock) -> tuple[dict[str, float], float]:
    """(seconds per node op, seconds of the whole sequence) of the recorded calls run back to back:
    medians over `rounds`."""
    per_op: dict[str, list[float]] = defaultdict(list)
    totals = []
    for _ in range(rounds):
        t0 = clock()
        for _, fn, args in calls:
            fn(*args)
        totals.append(clock() - t0)
        spent: dict[str, float] = defaultdict(float)
        for op, fn, args in calls:
            t = clock()
            fn(*args)
            spent[op] += clock() - t
        for op, t in spent.items():
            per_op[op].append(t)
    return {op: statistics.median(v) for op, v in per_op.items()}, statistics.median(totals)


def wrapper_cost(clock) -> float:
    """Seconds one timing wrapper (a Python call, two clock reads, a dict update) adds to a call."""
    spent: dict[str, float] = defaultdict(float)

    def bare(a, b, c, d):
        return a

    def wrapped(a, b, c, d):
        t0 = clock()
        out = bare(a, b, c, d)
        spent["x"] += clock() - t0
        return out

    n = 20000
    times = []
    for fn in (bare, wrapped):
        t0 = clock()
        for _ in range(n):
            fn(1, 2, 3, 4)
        times.append((clock() - t0) / n)
    return times[1] - times[0]


def breakdown(engine: Engine, args, clock) -> None:
    """Print the timed levels and the per-node-op split of the engine's decode step as it is bound now."""
    levels = Levels(engine, clock)
    runs = []
    with levels.installed():
        for _ in range(args.rounds):
            levels.run(args.batch, args.prompt_len, args.steps)
            forwards = len(levels.forward)
            runs.append((statistics.median(levels.step), statistics.median(levels.forward),
                         {op: t / forwards for op, t in levels.nodes.items()}, levels.calls / forwards))
    step_t, fwd_t = (statistics.median(r[i] for r in runs) for i in (0, 1))
    node_t = {op: statistics.median(r[2][op] for r in runs) for op in runs[0][2]}
    calls = runs[0][3]
    overhead = wrapper_cost(clock)
    node_sum = sum(node_t.values()) - calls * overhead
    print(f"  timed levels, {'thread CPU' if clock is time.thread_time else 'wall'} time, ms per step (median of "
          f"{args.rounds} x {args.steps} steps; a timer costs {overhead * 1e6:.2f} us, {calls:.0f} calls a step):")
    print(f"    Engine.step {step_t * 1e3:8.3f}: outside the forward {(step_t - fwd_t) * 1e3:.3f}, "
          f"forward {fwd_t * 1e3:.3f} (executor loop {(fwd_t - node_sum - calls * overhead) * 1e3:.3f}, "
          f"calls {node_sum * 1e3:.3f})")
    recorder = Recorder()
    start(engine, args.batch, args.prompt_len, 4)
    with recording(engine.model.executor, recorder):
        engine.step()
    finish(engine)
    kernel_t, sequence_t = replay(recorder.calls, args.rounds * 4, clock)
    print(f"    its kernels replayed back to back: {sequence_t * 1e3:.3f} ({len(recorder.calls)} calls)")
    counts = defaultdict(int)
    for n in engine.model.executor.graph.nodes:
        counts[n.op] += 1
    counts[FUSED] = max(len(engine.model.executor._fused), 1)
    print(f"    {'node op':<30} {'call':>8} {'kernel':>8} {'Python':>8} {'us/node':>8}")
    for op, t in sorted(node_t.items(), key=lambda kv: -kv[1]):
        call = t - counts[op] * overhead
        kernel = kernel_t.get(op, 0.0)
        print(f"    {op:<30} {call * 1e3:8.3f} {kernel * 1e3:8.3f} {(call - kernel) * 1e3:8.3f} "
              f"{(call - kernel) / counts[op] * 1e6:8.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5, help="repeats of the timed levels and of the replay")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    engine = Engine.load(args.artifact, max_num_seqs=args.batch, enable_prefix_caching=False)
    executor = engine.model.executor
    fused = dict(executor._fused)
    modes = {"node by node": {}, **({"planned runs fused": fused} if fused else {})}
    decode_steps(engine, args.batch, args.prompt_len, 4)  # warm-up: prepared layouts, first calls
    times: dict[str, list] = defaultdict(list)
    for _ in range(args.rounds):  # the modes interleaved, round by round
        for mode, runs in modes.items():
            executor._fused = dict(runs)
            times[mode] += decode_steps(engine, args.batch, args.prompt_len, args.steps)
    print(f"{args.artifact}: batch {args.batch}, {torch.get_num_threads()} threads, qdot "
          f"{cpu_ext.ISA_NAMES.get(cpu_ext.isa(), 'absent')}, torch {torch.backends.cpu.get_cpu_capability()}, "
          f"load {load:.2f}")
    # one thread: the main thread's CPU time (what a loaded machine does not inflate); more: wall time
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    for mode, runs in modes.items():
        wall, cpu = (statistics.median(t[i] for t in times[mode]) for i in (0, 1))
        print(f"{mode}: decode step median of {len(times[mode])}: wall {wall * 1e3:.2f} ms, CPU {cpu * 1e3:.2f} ms")
        executor._fused = dict(runs)
        breakdown(engine, args, clock)
    executor._fused = fused
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
