"""GPTQ for a moe block's experts, one expert at a time on the calibration tokens routed to it.

The block's input runs through the router (the op's `route`, the float router as the model has it), so
each expert sees exactly the tokens that choose it. Expert e's gate_up is quantized from the Hessian of
those tokens' inputs; its down from the Hessian of its own activation act(gate) * up, computed through
the gate_up just quantized (true sequential, as GPTQ's linear groups are). An expert chosen by fewer
than MIN_EXPERT_TOKENS calibration tokens has no Hessian worth the name (rank below the token count,
all-zero columns GPTQ treats as dead): it is rounded to nearest instead, and the pass stats count it.
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
from optc.core.ops.moe import route
from optc.frontend.quant.calibrated import Calibration
from optc.frontend.quant.rtn import quantize_weight

MIN_EXPERT_TOKENS = 8  # fewer routed calibration tokens: the expert is rounded to nearest


@dataclass
class ExpertStats:
    """Per pass: experts quantized with GPTQ and those rounded to nearest for want of tokens."""

    gptq: int = 0
    rtn_fallback: int = 0
    fallback_tokens: list[int] = field(default_factory=list)  # the routed tokens each fallback expert had

    def to_json(self) -> dict:
        """The pass stats' entries (none for a model without experts: its stats read as before)."""
        if not self.gptq and not self.rtn_fallback:
            return {}
        return {"experts_gptq": self.gptq, "experts_rtn_fallback": self.rtn_fallback,
                **({"fallback_expert_tokens": sorted(self.fallback_tokens)} if self.fallback_tokens else {})}


def quantize_experts(run: Calibration, nodes: list[Node], node: Node, params: dict[str, Param],
                     gptq: Callable[[torch.Tensor, torch.Tensor, Format, str], dict[str, torch.Tensor]],
                     format_of: Callable[[str], Format], stats: ExpertStats) -> None:
    """Quantize `node`'s experts (gate_up, down) with `gptq(weight, inputs, fmt, name) -> parts`, each on its
    routed calibration tokens; record them in `run` (the rest of the block computes with them)."""
    gate_up_name, down_name = node.params["gate_up"], node.params["down"]
    if gate_up_name not in run.targets and down_name not in run.targets:
        return
    x = run.runner.run(nodes, params, until=node.inputs[0])[node.inputs[0]]
    x = x.reshape(-1, x.shape[-1])  # (T, H)
    a = node.attrs
    _, ids = route(x, params[node.params["router"]].dense(x.dtype), a["top_k"], a["renormalize"])
    gate_up_w, down_w = params[gate_up_name].parts["weight"], params[down_name].parts["weight"]
    gate_up_fmt, down_fmt = format_of(gate_up_name), format_of(down_name)
    gate_up_parts, down_parts = [], []
    for e in range(gate_up_w.shape[0]):
        tokens = (ids == e).any(dim=-1).nonzero()[:, 0]
        xe = x[tokens]
        where = f"{gate_up_name} (expert {e})"
        if len(tokens) < MIN_EXPERT_TOKENS:
            stats.rtn_fallback += 1
            stats.fallback_tokens.append(len(tokens))
            gate_up_parts.append(quantize_weight(gate_up_w[e], gate_up_fmt, where))
            down_parts.append(quantize_weight(down_w[e], down_fmt, f"{down_name} (expert {e})"))
            continue
        stats.gptq += 1
        gate_up_parts.append(gptq(gate_up_w[e], xe, gate_up_fmt, where))
        quantized = Param(gate_up_parts[-1], gate_up_fmt).dense(torch.float32)
        g, u = (xe.float() @ quantized.T).chunk(2, dim=-1)
        down_parts.append(gptq(down_w[e], ACTIVATIONS[a["act"]](g) * u, down_fmt, f"{down_name} (expert {e})"))
    for name, fmt, parts in ((gate_up_name, gate_up_fmt, gate_up_parts), (down_name, down_fmt, down_parts)):
        run.keep(name, fmt, {r: torch.stack([p[r] for p in parts]) for r in parts[0]}, params)
