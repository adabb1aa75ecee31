"""The Mixture-of-Experts block: `moe` {num_experts, intermediate_size, top_k, scoring, renormalize, act,
round_weights?, routed_scale?, num_groups?, topk_groups?, float_router?}.

    router_logits = x @ router^T                       router (E, H), in x's dtype (fp32 when `float_router`)
    p = softmax(router_logits in fp32)                 (T, E)
    p = 0 outside the top `topk_groups` groups         when num_groups > 1 (DeepSeek-V2's group_limited_greedy:
                                                       E experts in num_groups groups, a group scored by its best p)
    w, ids = top_k(p)                                  (T, k): softmax-then-top-k
    w = w / sum(w)          when `renormalize`         (Mixtral always; Qwen3-MoE when norm_topk_prob)
    w = w * routed_scale                               (DeepSeek-V2's routed_scaling_factor; default 1)
    w = w in x's dtype      when `round_weights`       (Qwen3-MoE; Mixtral multiplies by the fp32 weight)
    y[t] = sum_j w[t, j] * down[e] @ act(gate[e] @ x[t]) * (up[e] @ x[t]),  e = ids[t, j]

The experts are stacked, one tensor per projection with a leading expert axis, as transformers 5 holds
them: gate_up (E, 2I, H) = [gate | up] rows per expert, down (E, H, I). A quantized expert tensor stores
each expert's parts stacked the same way (`Format.part_shapes` of a 3-D shape); `expert_parts` is one
expert's 2-D weight as its format's scheme reads it, so every format's reference linear serves the experts.

The reference is transformers' computation: tokens indexed by expert, a loop over the experts that
received tokens (in expert order), each one's gate/up and down matmuls on its tokens only, weighted and
added into the output with index_add. It reads the expert counts on the host (a CUDA graph cannot
capture it). The router is float: a quantized router is refused by `check` (verify names it).
DeepSeek-V2's shared experts are not here: they are a dense MLP beside the node (ordinary linear and gated_act
nodes, so every pass, kernel and TP split that takes a dense MLP takes them), added to its output.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from optc.core.formats import Format, linear_ref
from optc.core.ir import ModelConfig, Node
from optc.core.ops.elementwise import ACTIVATIONS
from optc.core.ops.spec import OpSpec

SCORINGS = ("softmax",)  # softmax over all experts, then top-k (Mixtral, Qwen3-MoE, DeepSeek-V2)
ROUTING_ATTRS = ("routed_scale", "num_groups", "topk_groups", "float_router")


def moe_ref(x: torch.Tensor, router: torch.Tensor, gate_up: dict[str, torch.Tensor], gate_up_format: Format,
            down: dict[str, torch.Tensor], down_format: Format, top_k: int, renormalize: bool, act: str = "silu",
            round_weights: bool = False, **routing) -> torch.Tensor:
    """x (T, H) -> (T, H): the experts' weighted sum of the `top_k` experts the router picks per token
    (`routing`: the optional routing attrs, `routing_kwargs`)."""
    weights, ids = route(x, router, top_k, renormalize, round_weights, **routing)  # (T, k) each
    return run_experts(x, weights, ids, router.shape[0], act,
                       lambda e, h: linear_ref(h, expert_parts(gate_up, e), gate_up_format),
                       lambda e, h: linear_ref(h, expert_parts(down, e), down_format))


def run_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int, act: str,
                gate_up: Callable[[int, torch.Tensor], torch.Tensor],
                down: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The routed tokens through their experts: each expert that received tokens runs `gate_up(e, x_e)`
    (T_e, 2I) and `down(e, h_e)` (T_e, H) on its tokens only, in expert order; outputs weighted and
    index_added (a kernel passes its own per-expert matmuls)."""
    out = torch.zeros_like(x)
    top_k = ids.shape[-1]
    flat = ids.flatten()  # (T * k,): row r is token r // k's choice r % k
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # host sync: which experts run
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        rows = order[start:start + n]
        start += n
        tokens = rows // top_k
        g, u = gate_up(e, x[tokens]).chunk(2, dim=-1)
        y = down(e, ACTIVATIONS[act](g) * u)
        out.index_add_(0, tokens, (y * weights.flatten()[rows, None]).to(out.dtype))
    return out


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool, round_weights: bool = False,
          routed_scale: float = 1.0, num_groups: int = 1, topk_groups: int = 1,
          float_router: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of each token: (weights (T, k), expert ids (T, k)); weights fp32 unless `round_weights`."""
    logits = F.linear(x.float(), router.float()) if float_router else F.linear(x, router.to(x.dtype))
    probs = F.softmax(logits.float(), dim=-1)  # (T, E)
    if num_groups > 1:  # group-limited: only the experts of the topk_groups best groups (by their best expert)
        grouped = probs.view(probs.shape[0], num_groups, -1)  # (T, G, E / G)
        best = grouped.amax(-1).topk(topk_groups, dim=-1).indices  # (T, topk_groups)
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)  # (T, G)
        probs = grouped.masked_fill(~keep[..., None], 0.0).view_as(probs)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scale != 1.0:
        weights = weights * routed_scale
    return (weights.to(x.dtype) if round_weights else weights), ids


def routing_kwargs(attrs: dict) -> dict:
    """The optional routing attrs a moe node passes `route` (none for softmax-then-top-k over all experts)."""
    return {a: attrs[a] for a in ROUTING_ATTRS if a in attrs}


def expert_parts(parts: dict[str, torch.Tensor], expert: int) -> dict[str, torch.Tensor]:
    """One expert's stored parts (each part's slice of the leading expert axis): a 2-D weight's parts."""
    return {role: p[expert] for role, p in parts.items()}


def check_moe(node: Node, formats: dict[str, Format]) -> str | None:
    """Why a moe node cannot run (its router quantized, an unknown scoring), or None."""
    if formats["router"].is_quantized:
        return (f"router {node.params['router']} is {formats['router'].kind.value}: the moe router stays float "
                "(quantization passes keep it dense)")
    a = node.attrs
    if not 1 <= a["top_k"] <= a["num_experts"]:
        return f"top_k {a['top_k']} must be in 1..num_experts ({a['num_experts']})"
    if node.attrs["scoring"] not in SCORINGS:
        return f"scoring {node.attrs['scoring']!r} is not supported; supported: {', '.join(SCORINGS)}"
    groups, topk_groups = a.get("num_groups", 1), a.get("topk_groups", 1)
    if a["num_experts"] % groups or not 1 <= topk_groups <= groups:
        return f"num_groups {groups} must divide num_experts ({a['num_experts']}) and 1 <= topk_groups " \
               f"({topk_groups}) <= num_groups"
    if node.attrs["act"] not in ACTIVATIONS:
        return f"act {node.attrs['act']!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
    return None


def _moe_call(fn, node, inputs, params, step):
    # moe(x) {num_experts, intermediate_size, top_k, scoring, renormalize, act, round_weights?, routed_scale?,
    #   num_groups?, topk_groups?, float_router?} [router, gate_up, down] -> y
    a, gate_up, down = node.attrs, params["gate_up"], params["down"]
    return [fn(inputs[0], params["router"].dense(), gate_up.parts, gate_up.format, down.parts, down.format,
               a["top_k"], a["renormalize"], a["act"], a.get("round_weights", False), **routing_kwargs(a))]


def _moe_shapes(node: Node, cfg: ModelConfig) -> dict:
    e, i, h = node.attrs["num_experts"], node.attrs["intermediate_size"], cfg.hidden_size
    return {"router": (e, h), "gate_up": (e, 2 * i, h), "down": (e, h, i)}


MOE = OpSpec(1, 1, ("num_experts", "intermediate_size", "top_k", "scoring", "renormalize", "act"),
             ("router", "gate_up", "down"), _moe_shapes, moe_ref, _moe_call, reference_syncs_host=True,
             check=check_moe)
