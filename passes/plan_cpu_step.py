"""Plan the fused CPU decode step: record on the graph's nodes which runs of them step.cpp executes as one call.

After select_kernels, every node is asked whether the fused step takes it as bound (kernels/cpu_ext/step_takes.py:
its op, its kernel, every attribute it carries, its weight's format). The maximal runs of consecutive taken nodes
(two or more) become the plan: each of their nodes gets `step_run` (the run's index) and a linear whose per-M
kernel table leaves step.cpp above some row count gets `step_max_rows`; every other node gets `step_left_out`, the
reason. The runtime fuses exactly these runs (kernels/cpu_ext/step.py `fuse_planned`) and nothing else, so what
runs fused is fixed at build time, in graph.json, and `optc inspect` shows it. On `target: cuda` it is a no-op
(the plan is the CPU's); an earlier plan's attributes are replaced, so a second run reports no change.

It does not check that the machine loading the artifact can build the extension (that is the load's question).
"""

from __future__ import annotations

from collections import Counter

from optc.core.ir import Graph, Node
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.kernels.cpu_ext.step_takes import PLAN_ATTRS, max_rows, reason

ALONE = "a run of one node (nothing to fuse it with)"


class PlanCpuStep(Pass):
    """Record the runs of nodes the fused CPU decode step executes as one call, and why each other node is not."""

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        if ctx.target != "cpu":
            return PassResult(graph, store, changed=False,
                              stats={"target": ctx.target, "note": "no-op: the fused step is the CPU's"})
        plan = _plan(graph)
        stats = _stats(graph, plan)
        if all(_planned(n.attrs) == p for n, p in zip(graph.nodes, plan, strict=True)):
            return PassResult(graph, store, changed=False, stats=stats)
        graph = graph.copy()
        graph.nodes = [Node(n.name, n.op, n.inputs, n.outputs,
                            {**{k: v for k, v in n.attrs.items() if k not in PLAN_ATTRS}, **p}, n.params)
                       for n, p in zip(graph.nodes, plan, strict=True)]
        return PassResult(graph, store, changed=True, stats=stats)

    def ensures(self, graph: Graph) -> None:
        seen: set[int] = set()
        previous = None
        for n in graph.nodes:
            run = n.attrs.get("step_run")
            if run is not None and run != previous and run in seen:
                raise AssertionError(f"{n.name}: step run {run} is not one range of consecutive nodes")
            if run is not None:
                seen.add(run)
            previous = run


def _plan(graph: Graph) -> list[dict]:
    """Each node's plan attributes, in node order."""
    why = [reason(graph, n) for n in graph.nodes]
    plan: list[dict] = []
    index, i = 0, 0
    while i < len(graph.nodes):
        stop = i
        while stop < len(graph.nodes) and why[stop] is None:
            stop += 1
        # n_i, ..., n_stop-1 each taken, two or more -> {step_run: index} on each
        if stop - i >= 2:
            for n in graph.nodes[i:stop]:
                rows = max_rows(graph, n) if n.op == "linear" else None
                plan.append({"step_run": index, **({"step_max_rows": rows} if rows is not None else {})})
            index += 1
            i = stop
            continue
        plan.append({"step_left_out": why[i] or ALONE})
        i += 1
    return plan


def _planned(attrs: dict) -> dict:
    return {k: attrs[k] for k in PLAN_ATTRS if k in attrs}


def _stats(graph: Graph, plan: list[dict]) -> dict:
    fused = [(n, p) for n, p in zip(graph.nodes, plan, strict=True) if "step_run" in p]
    runs_ = Counter(p["step_run"] for _, p in fused)
    left_out = Counter(p["step_left_out"] for p in plan if "step_left_out" in p)
    bounded = [p["step_max_rows"] for _, p in fused if "step_max_rows" in p]
    return {"target": "cpu", "num_runs": len(runs_), "num_fused_nodes": len(fused),
            "num_left_out": sum(left_out.values()), **({"max_rows": min(bounded)} if bounded else {}),
            "left_out": dict(sorted(left_out.items()))}
