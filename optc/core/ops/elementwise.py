"""The elementwise ops between nodes: the residual add and the SwiGLU activation.

`silu_mul` takes the gate and up halves as two (T, I) values (the fused gate-up linear's split
outputs) or, for `silu_mul_ref(x)`, one (T, 2 * I) = [gate | up] tensor. Numerical policy (as
transformers, in the input dtype): silu(gate) rounded to the dtype, then multiplied by up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optc.core.ops.spec import OpSpec, no_params


def add_ref(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


def silu_mul_ref(x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up; gate, up = x.chunk(2, -1) when `up` is None, else gate = x."""
    gate, up = x.chunk(2, dim=-1) if up is None else (x, up)
    return F.silu(gate) * up


def _binary_call(fn, node, inputs, params, step):
    # add(x, y) -> x + y;  silu_mul(gate, up) -> silu(gate) * up
    return [fn(inputs[0], inputs[1])]


ADD = OpSpec(2, 1, (), (), no_params, add_ref, _binary_call)
SILU_MUL = OpSpec(2, 1, (), (), no_params, silu_mul_ref, _binary_call)
