"""The kernel table: per kernel name, the IR op it implements, the target it runs on (`cpu`, `cuda`),
a `supports` predicate over the node's shapes, formats and dtypes, its launcher, an optional
`prepare` that repacks the node's weights once into the layout the launcher reads (named by
`layout`, which `optc inspect` shows), and the CUDA capability it needs beyond the runtime's floor.

A launcher has its op's torch reference signature (optc.core.ops), so the op's own node -> arguments
adapter binds it: `impls(names)` returns `OPS[op].bind(launcher)` per name, wrapped so that a kernel
with `prepare` gets its node's params through it, prepared on the node's first call and kept. A
prepared layout lives only in the loaded model; the artifact stores the format's own parts, so the
reference (any device) still reads it. `select_kernels` (compiler) asks `select(query, target)` which
kernel serves a node (or `candidates(...)`, every one that could, when it measures them); the runtime
loader asks `impls(names)` for the names recorded in the graph. The table is plain data (its entries per
target in kernels/table_cuda.py and kernels/table_cpu.py, their types in kernels/spec.py): importing
this module imports no Triton; a kernel module is imported when its kernel is bound.

Per-M choice: a node may carry `kernel_by_m`, a list of [max_rows, kernel] pairs in increasing
max_rows (the last max_rows None: no bound), written by `select_kernels` from measurements on the build
machine. The node's `kernel` is then one of the kernels in that list (what the loader binds), and every
implementation `impls` returns routes a call of M rows (the op's `rows`: an lm_head's selected rows) to
the first pair with M <= max_rows; `torch` in the list is the op's reference. A node without it runs
its `kernel` for every M.
"""

from __future__ import annotations

from optc.core.ir import REFERENCE_KERNEL
from optc.core.ops import OPS, Impl
from optc.kernels.spec import TARGETS, KernelQuery, KernelSpec, PreparedImpl
from optc.kernels.table_cpu import CPU_KERNELS
from optc.kernels.table_cuda import CUDA_KERNELS, GATED_ACTS, MAX_GROUP, MAX_HIDDEN

__all__ = ["GATED_ACTS", "KERNELS", "MAX_GROUP", "MAX_HIDDEN", "TARGETS", "ByM", "KernelQuery", "KernelSpec",
           "PreparedImpl", "candidates", "compile_extensions", "impls", "select"]

KERNELS: dict[str, KernelSpec] = {s.name: s for s in CUDA_KERNELS + CPU_KERNELS}


class ByM:
    """The executor's Impl for one kernel name: a node with `kernel_by_m` runs, per call, the
    implementation its table names for the call's rows (M: the op's `rows`); any other node
    runs the kernel. Implementations are shared through `bound`, so a prepared layout is made once."""

    def __init__(self, name: str, bound: _Bound):
        self.name = name
        self.bound = bound
        self._routes: dict[str, tuple[list[int | None], list[Impl]]] = {}  # node name -> (bounds, impls)

    def __call__(self, node, inputs, params, step):
        table = node.attrs.get("kernel_by_m")
        if not table:
            return self.bound.get(self.name)(node, inputs, params, step)
        route = self._routes.get(node.name)
        if route is None:
            route = self._routes[node.name] = ([b for b, _ in table], [self.bound.get(k, node.op) for _, k in table])
        m = OPS[node.op].rows(inputs, step)
        bounds, fns = route
        for bound, fn in zip(bounds, fns, strict=True):
            if bound is None or m <= bound:
                return fn(node, inputs, params, step)
        return fns[-1](node, inputs, params, step)


class _Bound:
    """Kernel name -> its bound Impl, each bound once (the op reference for `torch`)."""

    def __init__(self):
        self._impls: dict[str, Impl] = {}

    def get(self, name: str, op: str | None = None) -> Impl:
        if name == REFERENCE_KERNEL:
            return OPS[op].ref
        if name not in self._impls:
            self._impls[name] = KERNELS[name].bind()
        return self._impls[name]


def candidates(query: KernelQuery, target: str, enabled: tuple[str, ...] = ()) -> list[KernelSpec]:
    """Every kernel for `target` and the query's op that supports it, in table order; a kernel that is
    not on by default counts only when `enabled` names it."""
    return [k for k in KERNELS.values() if k.target == target and k.op == query.op
            and (k.by_default or k.name in enabled) and k.supports(query)]


def select(query: KernelQuery, target: str, enabled: tuple[str, ...] = ()) -> KernelSpec | None:
    """The first of `candidates`, else None (the torch reference)."""
    return next(iter(candidates(query, target, enabled)), None)


def impls(names: set[str] | list[str]) -> dict[str, Impl]:
    """Kernel name -> bound implementation (routing per M where a node says so), for the executor's
    `impls` table."""
    unknown = sorted(set(names) - set(KERNELS))
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown}; known: {', '.join(sorted(KERNELS))}")
    bound = _Bound()
    return {name: ByM(name, bound) for name in sorted(names)}


def compile_extensions(names: set[str] | list[str]) -> None:
    """Compile the C++ extensions the named kernels call (KernelSpec.extension), each once per machine: a runtime
    does it when it loads a model, not at its first request."""
    for name in sorted(set(names) & set(KERNELS)):
        KERNELS[name].compile_extension()
