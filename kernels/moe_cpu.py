"""The moe block on the CPU with quantized experts through torch's packed matmuls: each expert that received
tokens runs its gate_up and down projections with `int8pack_linear` (int8_wo) or `int4pack_linear` (int4_g,
16-bit activations) on its own tokens, where the reference dequantizes that expert's whole weight per call.

The routing and the loop over experts are the op's (optc.core.ops.moe: `route`, `run_experts`), so the
kernel differs from the reference only in the per-expert matmul. `prepare_moe_packed` repacks each expert
once, with the linear kernels' own `prepare` (int8: the qweight aligned; int4: the packed layout and its
scales table), into parts keyed `{role}.{e}`: every expert a separate allocation, since the packed
matmuls need their operands aligned and a slice of a stacked tensor is not. The router stays float and
untouched. The artifact keeps the stacked format parts, which the reference reads.
"""

from __future__ import annotations

import torch

from optc.core.formats import Format, FormatKind
from optc.core.ops import Param
from optc.core.ops.moe import expert_parts, route, run_experts
from optc.kernels.int4_cpu import int4pack_linear, prepare_int4pack
from optc.kernels.int8_cpu import int8pack_linear, prepare_int8pack

_PACKED = {FormatKind.INT8_WO: (prepare_int8pack, int8pack_linear),
           FormatKind.INT4_G: (prepare_int4pack, int4pack_linear)}
EXPERTS = ("gate_up", "down")


def prepare_moe_packed(params: dict[str, Param]) -> dict[str, Param]:
    """A moe node's params -> the same with gate_up and down as per-expert prepared parts `{role}.{e}`."""
    out = dict(params)
    for name in EXPERTS:
        w = params[name]
        prepare = _PACKED[w.format.kind][0]
        num_experts = next(iter(w.parts.values())).shape[0]
        parts = {}
        for e in range(num_experts):
            one = prepare({"weight": Param(expert_parts(w.parts, e), w.format)})["weight"].parts
            parts.update({f"{role}.{e}": p for role, p in one.items()})
        out[name] = Param(parts, w.format)
    return out


def moe_packed(x: torch.Tensor, router: torch.Tensor, gate_up: dict[str, torch.Tensor], gate_up_format: Format,
               down: dict[str, torch.Tensor], down_format: Format, top_k: int, renormalize: bool, act: str = "silu",
               round_weights: bool = False, **routing) -> torch.Tensor:
    """moe_ref over experts prepared by `prepare_moe_packed`: x (T, H) -> (T, H) (`routing`: moe_ref's)."""
    assert gate_up_format.kind is down_format.kind, f"gate_up is {gate_up_format.kind}, down {down_format.kind}"
    linear = _PACKED[gate_up_format.kind][1]
    weights, ids = route(x, router, top_k, renormalize, round_weights, **routing)
    gate_up_roles, down_roles = _roles(gate_up), _roles(down)
    return run_experts(x, weights, ids, router.shape[0], act,
                       lambda e, h: linear(h, {r: gate_up[f"{r}.{e}"] for r in gate_up_roles}, gate_up_format),
                       lambda e, h: linear(h, {r: down[f"{r}.{e}"] for r in down_roles}, down_format))


def _roles(parts: dict[str, torch.Tensor]) -> list[str]:
    """The prepared roles of one expert (expert 0's keys without their `.0`)."""
    return [key.removesuffix(".0") for key in parts if key.endswith(".0")]
