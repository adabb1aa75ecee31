"""GPTQ and AWQ for a moe block's experts, one expert at a time on the calibration tokens routed to it.

The block's input runs through the router (the op's `route`, the float router as the model has it), so
each expert sees exactly the tokens that choose it. GPTQ: expert e's gate_up is quantized from the
Hessian of those tokens' inputs, its down from the Hessian of its own activation act(gate) * up, computed
through the gate_up just quantized (true sequential, as GPTQ's linear groups are). AWQ: the down
projection's input scales are searched on the expert's activations and 1/s folds into that expert's up
rows (act(g) * (u / s) = (act(g) * u) / s, exact); gate_up gets no scales, since its input is the norm
output the router and every expert read (1/s cannot fold into the norm for one expert), only AWQ's clip
search on its routed tokens; then both are clipped and rounded. An expert chosen by fewer than
MIN_EXPERT_TOKENS calibration tokens has no statistics worth the name (a Hessian of rank below the token
count, a mean over a handful of rows): it is rounded to nearest instead, and the pass stats count it.
The router is never quantized. Each expert's parts are stacked along the expert axis, the format's
layout of a 3-D weight (`Format.part_shapes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from optc.core.formats import Format
from optc.core.ir import Node
from optc.core.ops import Param
from optc.core.ops.elementwise import ACTIVATIONS
from optc.core.ops.moe import route, routing_kwargs
from optc.frontend.quant.awq import fold_into_linear, input_mean, search_clip, search_scale
from optc.frontend.quant.calibrated import Calibration
from optc.frontend.quant.rtn import quantize_weight

MIN_EXPERT_TOKENS = 8  # fewer routed calibration tokens: the expert is rounded to nearest


@dataclass
class ExpertStats:
    """Per pass: experts quantized by the calibrated `method` and those rounded to nearest for want of tokens."""

    method: str
    calibrated: int = 0
    rtn_fallback: int = 0
    fallback_tokens: list[int] = field(default_factory=list)  # the routed tokens each fallback expert had

    def to_json(self) -> dict:
        """The pass stats' entries (none for a model without experts: its stats read as before)."""
        if not self.calibrated and not self.rtn_fallback:
            return {}
        return {f"experts_{self.method}": self.calibrated, "experts_rtn_fallback": self.rtn_fallback,
                **({"fallback_expert_tokens": sorted(self.fallback_tokens)} if self.fallback_tokens else {})}


Parts = dict[str, torch.Tensor]
# (expert's gate_up (2I, H), down (H, I), its routed inputs x_e (T_e, H), act, formats, names) -> their parts
ExpertQuantizer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, str, Format, Format, str, str],
                           tuple[Parts, Parts]]


def quantize_experts(run: Calibration, nodes: list[Node], node: Node, params: dict[str, Param],
                     quantize: ExpertQuantizer, format_of: Callable[[str], Format], stats: ExpertStats) -> None:
    """Quantize `node`'s experts (gate_up, down) with `quantize` (`gptq_expert`, `awq_expert`), each on its
    routed calibration tokens; record them in `run` (the rest of the block computes with them)."""
    gate_up_name, down_name = node.params["gate_up"], node.params["down"]
    if gate_up_name not in run.targets and down_name not in run.targets:
        return
    x = run.runner.run(nodes, params, until=node.inputs[0])[node.inputs[0]]
    x = x.reshape(-1, x.shape[-1])  # (T, H)
    a = node.attrs
    _, ids = route(x, params[node.params["router"]].dense(x.dtype), a["top_k"], a["renormalize"],
                   **routing_kwargs(a))
    gate_up_w, down_w = params[gate_up_name].parts["weight"], params[down_name].parts["weight"]
    gate_up_fmt, down_fmt = format_of(gate_up_name), format_of(down_name)
    gate_up_parts, down_parts = [], []
    for e in range(gate_up_w.shape[0]):
        tokens = (ids == e).any(dim=-1).nonzero()[:, 0]
        names = f"{gate_up_name} (expert {e})", f"{down_name} (expert {e})"
        if len(tokens) < MIN_EXPERT_TOKENS:
            stats.rtn_fallback += 1
            stats.fallback_tokens.append(len(tokens))
            gate_up_parts.append(quantize_weight(gate_up_w[e], gate_up_fmt, names[0]))
            down_parts.append(quantize_weight(down_w[e], down_fmt, names[1]))
            continue
        stats.calibrated += 1
        gu, dn = quantize(gate_up_w[e], down_w[e], x[tokens], a["act"], gate_up_fmt, down_fmt, *names)
        gate_up_parts.append(gu)
        down_parts.append(dn)
    for name, fmt, parts in ((gate_up_name, gate_up_fmt, gate_up_parts), (down_name, down_fmt, down_parts)):
        run.keep(name, fmt, {r: torch.stack([p[r] for p in parts]) for r in parts[0]}, params)


def gptq_expert(gptq: Callable[[torch.Tensor, torch.Tensor, Format, str], Parts], gate_up: torch.Tensor,
                down: torch.Tensor, x: torch.Tensor, act: str, gate_up_fmt: Format, down_fmt: Format,
                gate_up_name: str, down_name: str) -> tuple[Parts, Parts]:
    """One expert with `gptq(weight, inputs, fmt, name) -> parts`: gate_up on x, down on its activations
    through the quantized gate_up."""
    gate_up_parts = gptq(gate_up, x, gate_up_fmt, gate_up_name)
    return gate_up_parts, gptq(down, _activations(x, Param(gate_up_parts, gate_up_fmt).dense(torch.float32), act),
                               down_fmt, down_name)


def awq_expert(n_grid: int, clip: bool, gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, act: str,
               gate_up_fmt: Format, down_fmt: Format, gate_up_name: str,
               down_name: str) -> tuple[Parts, Parts]:
    """One expert with AWQ: down's input scales searched on the expert's activations and 1/s folded into its
    up rows; gate_up clipped on x; down clipped on the activations through the quantized gate_up."""
    down, gate_up = down.float(), gate_up.float()
    h = _activations(x, gate_up, act)  # (T_e, I)
    found = search_scale(input_mean(h), [down], lambda ws: h @ ws[0].T, down_fmt, n_grid)
    size = down.shape[1]
    gate_up = fold_into_linear(gate_up, found.scales, slice(size, 2 * size))  # the up rows / s
    down = down * found.scales
    gate_up_parts = quantize_weight(gate_up, gate_up_fmt, gate_up_name,
                                    clip=search_clip(x, gate_up, gate_up_fmt, n_grid) if clip else None)
    h = _activations(x, Param(gate_up_parts, gate_up_fmt).dense(torch.float32), act)
    return gate_up_parts, quantize_weight(down, down_fmt, down_name,
                                          clip=search_clip(h, down, down_fmt, n_grid) if clip else None)


def _activations(x: torch.Tensor, gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up of x (T, H) through a dense (2I, H) gate_up, fp32."""
    g, u = (x.float() @ gate_up.T).chunk(2, dim=-1)
    return ACTIVATIONS[act](g) * u
