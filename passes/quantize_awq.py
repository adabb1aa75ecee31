"""Quantize every dense linear weight with AWQ scales and clipping, block by block on calibration tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from optc.core.ir import Graph, Node
from optc.core.ops import Param
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.frontend.quant.awq import ScaleSearch, input_mean, search_clip, search_scale
from optc.frontend.quant.blocks import (
    BlockRunner,
    branch,
    dense_param,
    fold_target,
    linear_groups,
)
from optc.frontend.quant.calibrated import Calibration, run_calibrated
from optc.frontend.quant.experts import ExpertStats, awq_expert, quantize_experts
from optc.frontend.quant.options import WeightQuantOptions, ensure_quantized
from optc.frontend.quant.rtn import quantize_weight

ROPE_OPS = ("rope", "rope_kv_store")


class QuantizeAwq(Pass):
    """Quantize every dense linear weight with AWQ scales and clipping, block by block on calibration tokens."""

    @dataclass(frozen=True)
    class Options(WeightQuantOptions):
        bits: int = field(default=4, metadata={"choices": (4,), "help": "AWQ is int4 grouped"})
        zero_point: bool = field(default=True, metadata={"help": "asymmetric with a zero point per group"})
        n_grid: int = field(default=20, metadata={"min": 1, "max": 100, "help": "α grid points in [0, 1)"})
        clip: bool = field(default=True, metadata={"help": "search a clip value per group (not for q/k)"})
        search_samples: int = field(default=8, metadata={
            "min": 1, "help": "calibration windows the scale search runs the block on (statistics use all)"})

    def requires(self, graph: Graph) -> None:
        self.options.refuse_requantizing(graph, self.name)

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        o = self.options
        searches: list[dict] = []  # per scaled group: its weights, the α chosen and every α's loss
        experts = ExpertStats("awq")

        def stats() -> dict:
            alphas = [g["alpha"] for g in searches]
            return {"scaled_groups": len(alphas),
                    "mean_alpha": round(sum(alphas) / len(alphas), 4) if alphas else None, **experts.to_json(),
                    "scale_searches": searches}

        return run_calibrated(self.name, "awq", graph, store, ctx,
                              partial(self._quantize_block, searches=searches, experts=experts),
                              {**o.record(), "n_grid": o.n_grid, "clip": o.clip, "search_samples": o.search_samples},
                              stats)

    def ensures(self, graph: Graph) -> None:
        ensure_quantized(graph, self.name)

    def _quantize_block(self, run: Calibration, nodes: list[Node], params: dict[str, Param],
                        searches: list[dict], experts: ExpertStats) -> None:
        o = self.options
        consumers = run.graph.consumers()
        groups = [g for g in linear_groups(nodes) if all(n.params["weight"] in run.targets for n in g)]
        for group in groups:  # 1. scales, folded one group at a time
            found = self._scale_group(run.graph, nodes, group, run.runner, params, run.folded)
            if found is not None:
                searches.append({"weights": [n.params["weight"] for n in group], "alpha": found.alpha,
                                 "losses": list(found.losses)})
        env = run.runner.run(nodes, params)  # 2. inputs of every linear with the scaled weights
        for group in groups:  # 3. clip and round
            x = env[group[0].inputs[0]]
            for n in group:
                name = n.params["weight"]
                fmt = o.format(run.graph.tensors[name].format.dtype)
                w = params[name].parts["weight"]
                feeds_rope = any(c.op in ROPE_OPS for v in n.outputs for c in consumers.get(v, []))
                clip = search_clip(x, w, fmt, o.n_grid) if o.clip and not feeds_rope else None
                run.keep(name, fmt, quantize_weight(w, fmt, name, clip=clip), params)
        for node in (n for n in nodes if n.op == "moe"):  # 4. experts, each on its routed tokens
            quantize_experts(run, nodes, node, params, partial(awq_expert, o.n_grid, o.clip),
                             lambda name: o.format(run.graph.tensors[name].format.dtype), experts)

    def _scale_group(self, graph: Graph, nodes: list[Node], group: list[Node], runner: BlockRunner,
                     params: dict[str, Param], folded: dict[str, torch.Tensor]) -> ScaleSearch | None:
        """Search the group's scales, fold 1/s into the op before it and s into its weights; -> the search."""
        x_name = group[0].inputs[0]
        target = fold_target(graph, nodes, x_name)
        block_tensors = {t for n in nodes for t in n.params.values()}
        if target is None or target.tensor not in block_tensors or target.tensor not in params:
            return None  # nothing in this block to fold 1/s into: the group is clipped and rounded only
        inside, out = branch(nodes, x_name)
        if out is None:
            return None
        x = runner.run(nodes, params, until=x_name)[x_name]
        names = [n.params["weight"] for n in group]
        rows, step = runner.first(self.options.search_samples)
        base = {"positions": step.positions, x_name: x[:rows]}

        def forward(ws: list[torch.Tensor]) -> torch.Tensor:  # the residual branch's output
            trial = {**params, **{t: dense_param(w) for t, w in zip(names, ws, strict=True)}}
            return runner.run(inside, trial, env=base, step=step)[out]

        fmt = self.options.format(graph.tensors[names[0]].format.dtype)
        found = search_scale(input_mean(x), [params[t].parts["weight"] for t in names], forward, fmt,
                             self.options.n_grid)
        s = found.scales
        for t in names:
            params[t] = dense_param(params[t].parts["weight"] * s)
        prev_name = target.tensor
        prev = target.fold(params[prev_name].parts["weight"], s)  # in fp32, then rounded once
        # round to the stored dtype now, so later calibration sees the artifact's values
        prev = prev.to(graph.tensors[prev_name].format.torch_dtype)
        params[prev_name] = dense_param(prev)
        folded[prev_name] = prev
        return found
