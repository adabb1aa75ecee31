"""Choosing a node's implementation per M bucket by timing the candidates on the build machine.

`select_kernels` asks this module when a node of a `cpu` target has more than one implementation (its
supporting kernels and the op's torch reference): each candidate runs the node's op on weights of the
node's format and shape (random values: the time of these kernels does not depend on them) and x of
M rows for every M in M_BUCKETS, interleaved (A B A B ...) so that load on a shared machine hits all
of them alike, and the fastest time of each decides (load only ever adds time: on the shared 2-core
VM a preempted call takes ~24 ms whatever it computes, so medians of a few calls measure the load).
Timing runs on one torch thread, restored afterwards: with two threads on two busy cores every
parallel op waits ~20-60 ms at its barrier for the second thread (measured: a 8 x 576 x 1536 bf16
matmul 0.6 ms on one thread, 42-58 ms on two at load 9), which would time the load, not the kernel;
the kernels compared here split their work over N alike, so their ratio carries over.
A kernel that raises on the shape is a build-time error naming the node, the shape and the kernel.
Timings are cached per (op, format, shape, dtype, candidates), so a model's 30 identical layers cost
one measurement.

A kernel whose rows do not depend on the call's row count (`rows_independent`: bf16dot) and that wins one row
keeps every bucket up to SPECULATIVE_ROWS even where torch's GEMM is a little faster: a decode row and the same
row in a speculative verification then give the same bits, so speculative greedy output is plain decoding's.

Not here: which kernels support a node (`registry.candidates`), Triton autotuning (on first use, on
the GPU), or anything about the runtime's M: a bucket's choice holds for every M up to its bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from optc.core.errors import UserError
from optc.core.formats import DTYPES, Format
from optc.core.ir import REFERENCE_KERNEL, Node
from optc.core.ops import OPS, Param
from optc.kernels.registry import KernelQuery, KernelSpec

M_BUCKETS = (1, 8, 32, 128, 512)  # upper bounds, measured at the bound; the last one holds for any larger M
# a `rows_independent` kernel that wins one row keeps the buckets up to this bound: a speculative step's rows (a
# chain's k + 1 <= 17, a tree's nodes + 1 <= 64, several requests' together) then sum as the decode row does
SPECULATIVE_ROWS = 128
MIN_ROUNDS = 3  # timed rounds per bucket, at least
MAX_ROUNDS = 25  # and at most: more rounds only until ROUND_BUDGET_S is spent
ROUND_BUDGET_S = 0.3  # after the first MIN_ROUNDS, spent on the contenders
CONTENDER_RATIO = 2.0  # a candidate this much slower than the fastest after MIN_ROUNDS is not timed further


class KernelShapeError(UserError):
    """A kernel chosen for a node raised on the node's shape."""


@dataclass(frozen=True)
class Choice:
    """The measured choice for one node: per bucket the winner, and every candidate's fastest µs."""

    by_m: tuple[tuple[int | None, str], ...]  # (max_rows or None, kernel), increasing
    micros: dict[int, dict[str, float]]  # bucket -> candidate -> fastest µs

    @property
    def kernel(self) -> str:
        """What the node's `kernel` attr names: the first non-reference winner, else the reference."""
        return next((k for _, k in self.by_m if k != REFERENCE_KERNEL), REFERENCE_KERNEL)


class Chooser:
    """Measures candidates for nodes and caches the result per shape for one pass run."""

    def __init__(self, buckets: tuple[int, ...] = M_BUCKETS):
        self.buckets = buckets
        self._cache: dict[tuple, Choice] = {}

    def choose(self, node: Node, query: KernelQuery, specs: list[KernelSpec]) -> Choice:
        """Time `specs` and the op's reference on the node's shape; the fastest per bucket wins (ties:
        the earlier in `specs`, the reference last)."""
        names = [s.name for s in specs] + [REFERENCE_KERNEL]
        key = (query, tuple(names))
        if key not in self._cache:
            self._cache[key] = self._measure(node, query, specs, names)
        return self._cache[key]

    def _measure(self, node: Node, query: KernelQuery, specs: list[KernelSpec], names: list[str]) -> Choice:
        params = {"weight": Param(random_parts(query.weight, query.weight_shape), query.weight)}
        attrs = {k: v for k, v in node.attrs.items() if k not in ("kernel", "kernel_by_m")}
        probe = Node(node.name, node.op, ["x"], list(node.outputs), attrs, dict(node.params))
        fns = {s.name: s.bind() for s in specs} | {REFERENCE_KERNEL: OPS[node.op].ref}
        micros: dict[int, dict[str, float]] = {}
        winners = []
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for m in self.buckets:
                times = self._time_bucket(probe, query, m, fns, params)
                micros[m] = {name: round(t * 1e6, 1) for name, t in times.items()}
                winners.append(min(times, key=lambda name: (times[name], names.index(name))))
        finally:
            torch.set_num_threads(threads)
        if any(s.rows_independent and s.name == winners[0] for s in specs):
            winners = [winners[0] if m <= SPECULATIVE_ROWS else w for m, w in zip(self.buckets, winners, strict=True)]
        by_m: list[tuple[int | None, str]] = []
        for i, (m, w) in enumerate(zip(self.buckets, winners, strict=True)):
            bound = None if i == len(self.buckets) - 1 else m
            if by_m and by_m[-1][1] == w:
                by_m[-1] = (bound, w)
            else:
                by_m.append((bound, w))
        return Choice(tuple(by_m), micros)

    @staticmethod
    def _time_bucket(node: Node, query: KernelQuery, m: int, fns: dict, params: dict) -> dict[str, float]:
        """Seconds per call of every candidate at M = m, after a first call that checks it runs."""
        k = query.weight_shape[1]
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DTYPES[query.dtype])  # (M, K)
        for name, fn in fns.items():  # warm-up (a kernel's prepare happens here) and the shape check
            try:
                fn(node, [x], params, None)
            except Exception as e:
                raise KernelShapeError(
                    f"kernel {name} cannot run node {node.name} ({node.op}, weight {list(query.weight_shape)} "
                    f"{_format_name(query.weight)}, x ({m}, {k}) {query.dtype}): {type(e).__name__}: {e}") from e
        return time_interleaved({name: (lambda f=fn: f(node, [x], params, None)) for name, fn in fns.items()})


def time_interleaved(calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Fastest seconds per call of each callable, timed in rounds A B A B ...: MIN_ROUNDS with every
    candidate, then more while ROUND_BUDGET_S lasts with the contenders only, those within CONTENDER_RATIO of
    the fastest so far. Every candidate gets the first rounds: dropping a slow one after one call let a single
    preempted call (up to ~0.4 s at load 13) decide; and a reference 100x slower than the kernels (an lm_head's
    dequantizing matmul, ~0.3 s a call) no longer spends the budget that would give the close ones their
    rounds (with three rounds under load, a 2.2 ms kernel once measured 6.6 ms and lost to a 3.5 ms one)."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    start = time.perf_counter()
    for r in range(MAX_ROUNDS):
        if r < MIN_ROUNDS:
            names = list(calls)
        else:
            best = min(min(s) for s in samples.values())
            names = [n for n in calls if min(samples[n]) <= CONTENDER_RATIO * best]
        for name in names:
            t0 = time.perf_counter()
            calls[name]()
            samples[name].append(time.perf_counter() - t0)
        if r + 1 == MIN_ROUNDS:
            start = time.perf_counter()  # the budget is the contenders'
        if r + 1 >= MIN_ROUNDS and time.perf_counter() - start > ROUND_BUDGET_S:
            break
    return {name: min(s) for name, s in samples.items()}


def random_parts(fmt: Format, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Stored parts of a weight of `shape` in `fmt` with random contents valid for the format."""
    g = torch.Generator().manual_seed(0)
    parts = {}
    for role, (part_shape, dtype) in fmt.part_shapes(shape).items():
        if role == "perm":
            parts[role] = torch.randperm(part_shape[0], generator=g).to(dtype)
        elif dtype.is_floating_point:
            parts[role] = (torch.rand(part_shape, generator=g) * 0.01 + 0.001).to(dtype)
        elif dtype == torch.int32:  # packed nibbles: any bits are valid codes
            parts[role] = torch.randint(-2**31, 2**31 - 1, part_shape, generator=g, dtype=torch.int64).to(dtype)
        else:  # int8 codes, uint8 zero points
            lo, hi = (-127, 128) if dtype == torch.int8 else (0, 16)
            parts[role] = torch.randint(lo, hi, part_shape, generator=g).to(dtype)
    return parts


def _format_name(fmt: Format | None) -> str:
    if fmt is None:
        return ""
    return fmt.kind.value + (f"/g{fmt.group_size}" if fmt.group_size else "")
