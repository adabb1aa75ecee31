"""The elementwise ops between nodes: the residual add and the gated MLP activation.

`gated_act` {act} computes act(gate) * up: SwiGLU (`silu`: Llama, Qwen, Phi) or GeGLU (`gelu_tanh`:
Gemma's tanh-approximated GELU). It takes the gate and up halves as two (T, I) values (the fused
gate-up linear's split outputs) or, for `gated_act_ref(x)`, one (T, 2 * I) = [gate | up] tensor.
Numerical policy (as transformers, in the input dtype): act(gate) rounded to the dtype, then
multiplied by up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optc.core.ops.spec import OpSpec, no_params

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def add_ref(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


def gated_act_ref(x: torch.Tensor, up: torch.Tensor | None = None, act: str = "silu") -> torch.Tensor:
    """act(gate) * up; gate, up = x.chunk(2, -1) when `up` is None, else gate = x."""
    gate, up = x.chunk(2, dim=-1) if up is None else (x, up)
    return ACTIVATIONS[act](gate) * up


def _add_call(fn, node, inputs, params, step):
    # add(x, y) -> x + y
    return [fn(inputs[0], inputs[1])]


def _gated_act_call(fn, node, inputs, params, step):
    # gated_act(gate, up) {act} -> act(gate) * up
    return [fn(inputs[0], inputs[1], act=node.attrs["act"])]


ADD = OpSpec(2, 1, (), (), no_params, add_ref, _add_call)
GATED_ACT = OpSpec(2, 1, ("act",), (), no_params, gated_act_ref, _gated_act_call)
