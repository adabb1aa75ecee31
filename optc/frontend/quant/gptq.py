"""GPTQ (Frantar et al. 2022) for one linear layer, pure torch, fp32.

`Gptq(weight)` accumulates the Hessian H = 2/n · Σ xᵀx of the layer's calibration inputs
(`add_batch`), then `quantize(fmt)` quantizes the columns in order, feeding each column's
rounding error back into the columns not yet quantized through the Cholesky factor of H⁻¹, with
lazy block updates. Groups are int4 `group_size` wide, or one per output row for int8 and fp8 (fp8
`per_tensor`: every row's group gets the one scale of the whole weight).

`quantize_block` is the method's step in the calibrated driver (optc/frontend/quant/calibrated.py): the
passes that round with GPTQ (quantize_gptq for the integer formats, quantize_fp8 with `method: gptq`)
differ only in the format they ask it for, and share its options (`GptqOptions`). The rounding is the
format scheme's (`group_params`, `round_values`), so the same loop serves int grids and fp8's e4m3 grid.

Where it differs from the reference implementation (AutoGPTQ `fasterquant`), and why:
- A group's scale/zero are chosen from the *current* (error-updated) columns of that group, also
  for groups that start inside a lazy block; the reference reads the block-start copy there.
  So `block_size` must be a multiple of the group size.
- `act_order=True` uses static groups (AutoGPTQ's `static_groups=True`): every group's parameters
  come from the original weight before the pass (as for per-channel formats, whose one group per
  row is the whole row), then columns are processed by decreasing
  H diagonal. Our int4_g format has no g_idx, so groups must stay contiguous in the original input
  order; with static groups the stored parts still dequantize to exactly the weights the error
  feedback assumed.
- Scales are rounded to the storage dtype before rounding the weights (see `rtn.group_params`).

`Gptq` does not run the model: `quantize_block` collects its inputs on the calibration tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import StrEnum
from functools import partial
from typing import Any

import torch

from optc.core.errors import InputError
from optc.core.formats import Format
from optc.core.ir import Node
from optc.core.ops import Param
from optc.frontend.quant.blocks import linear_groups
from optc.frontend.quant.calibrated import Calibration
from optc.frontend.quant.experts import ExpertStats, gptq_expert, quantize_experts
from optc.frontend.quant.rtn import check_quantizable, group_params, pack_parts, quantize_values


class Rounding(StrEnum):
    """How a pass that offers both rounds weights to its format (its `method` option)."""

    RTN = "rtn"  # the nearest grid value, weight by weight: no calibration data
    GPTQ = "gptq"  # column by column, with error feedback through the calibration inputs' inverse Hessian


@dataclass(frozen=True)
class GptqOptions:
    """GPTQ's own options, part of the Options of every pass that rounds with it."""

    damp: float = field(default=0.01, metadata={"gt": 0.0, "max": 1.0, "help": "dampening, share of mean diag H"})
    block_size: int = field(default=128, metadata={"choices": (128, 256, 512), "help": "lazy update width"})
    act_order: bool = field(default=False, metadata={"help": "columns by decreasing diag H (static groups)"})

    def gptq_record(self) -> dict[str, Any]:
        """The manifest's quantization fields these options decide."""
        return {"damp": self.damp, "act_order": self.act_order}

    def rounding(self, method: str) -> Rounding:
        """A pass's `method` option as a Rounding; GPTQ's options set beside `rtn` are an error."""
        if method not in {m.value for m in Rounding}:
            raise InputError(f"method: {method!r} is not allowed; allowed: {', '.join(m.value for m in Rounding)}")
        rounding = Rounding(method)
        changed = [f.name for f in fields(GptqOptions) if getattr(self, f.name) != f.default]
        if rounding is Rounding.RTN and changed:
            raise InputError(f"{', '.join(changed)}: only with method: gptq (GPTQ's options); method is rtn")
        return rounding


@dataclass(frozen=True)
class GptqResult:
    parts: dict[str, torch.Tensor]
    weight: torch.Tensor  # (N, K) fp32: the quantized weight the error feedback used
    loss: float  # Σ (w - q)² / d², the GPTQ objective's proxy, as the reference reports it


class Gptq:
    """Hessian accumulator and quantizer for one linear of weight (N, K)."""

    def __init__(self, weight: torch.Tensor, name: str = "weight"):
        if weight.dim() != 2:
            raise ValueError(f"{name}: GPTQ needs a 2-D weight, got shape {list(weight.shape)}")
        self.weight = weight
        self.name = name
        self.num_samples = 0
        self.hessian = torch.zeros(weight.shape[1], weight.shape[1], dtype=torch.float32, device=weight.device)

    def add_batch(self, x: torch.Tensor) -> None:
        """Accumulate H over the rows of x (..., K); a running mean, so batches may differ in size."""
        x = x.reshape(-1, x.shape[-1]).float()
        if x.shape[1] != self.hessian.shape[0]:
            raise ValueError(f"{self.name}: input has {x.shape[1]} features, "
                             f"the weight {self.hessian.shape[0]}")
        num = x.shape[0]
        self.hessian *= self.num_samples / (self.num_samples + num)
        self.num_samples += num
        x = x * (2 / self.num_samples) ** 0.5
        self.hessian += x.T @ x

    def quantize(self, fmt: Format, damp: float = 0.01, block_size: int = 128,
                 act_order: bool = False) -> dict[str, torch.Tensor]:
        """The stored parts of `fmt` (see optc.core.formats)."""
        return self.run(fmt, damp, block_size, act_order).parts

    def run(self, fmt: Format, damp: float = 0.01, block_size: int = 128,
            act_order: bool = False) -> GptqResult:
        check_quantizable(tuple(self.weight.shape), fmt, self.name)
        if self.num_samples == 0:
            raise ValueError(f"{self.name}: GPTQ needs calibration inputs; add_batch was never called")
        n, k = self.weight.shape
        g = fmt.scheme.group_width(fmt, k)
        per_channel = fmt.group_size is None  # one group per row: its parameters come from the original weight
        if block_size % g and not per_channel:
            raise InputError(f"{self.name}: block_size {block_size} must be a multiple of group size {g}")
        w = self.weight.float().clone()
        h = self.hessian.clone()
        dead = torch.diagonal(h) == 0  # inputs that were always zero: their weights do not matter
        h[dead, dead] = 1
        w[:, dead] = 0
        static = act_order or per_channel
        scales = torch.zeros(n, k // g, device=w.device)
        zeros = torch.zeros(n, k // g, device=w.device)
        if static:  # every group's parameters from the original weight
            scales, zeros = group_params(w.reshape(n, k // g, g), fmt)
        perm = torch.arange(k, device=w.device)
        if act_order:  # columns with the largest H diagonal first
            perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        w, h = w[:, perm], h[perm][:, perm]
        hinv = _inverse_cholesky(h, damp, self.name)
        q_int = torch.zeros_like(w)
        q_deq = torch.zeros_like(w)
        loss = torch.zeros((), device=w.device)
        columns = perm.tolist()  # one device read, not one per column
        for i1 in range(0, k, block_size):
            i2 = min(i1 + block_size, k)
            w1, hinv1 = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
            err1 = torch.zeros_like(w1)
            for i in range(i2 - i1):
                col = columns[i1 + i]  # the column's index in the original (stored) order
                grp = col // g
                if not static and (i1 + i) % g == 0:
                    scales[:, grp], zeros[:, grp] = group_params(w1[:, i:i + g], fmt)
                s, z = scales[:, grp], zeros[:, grp]
                q = quantize_values(w1[:, i], s, z, fmt)
                q_int[:, i1 + i] = q
                q_deq[:, i1 + i] = (q - z) * s  # the formats.dequantize arithmetic
                d = hinv1[i, i]
                e = (w1[:, i] - q_deq[:, i1 + i]) / d
                loss += (e * e).sum()
                w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
                err1[:, i] = e
            w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
        inv = torch.argsort(perm)
        q_int, q_deq = q_int[:, inv], q_deq[:, inv]
        return GptqResult(pack_parts(q_int, scales, zeros, fmt), q_deq, float(loss) / 2)


def quantize_block(run: Calibration, nodes: list[Node], params: dict[str, Param], options: GptqOptions,
                   format_of: Callable[[str], Format], experts: ExpertStats | None = None) -> None:
    """The calibrated driver's step for GPTQ: quantize the block's target linears to `format_of(name)`, one
    group of linears sharing an input at a time, each group's Hessian from its input computed through the
    groups already quantized before it (true sequential); then a moe node's experts, each on the tokens
    routed to it (optc/frontend/quant/experts.py; `experts` counts them)."""
    for group in linear_groups(nodes):
        names = [n.params["weight"] for n in group if n.params["weight"] in run.targets]
        if not names:
            continue
        x = run.runner.run(nodes, params, until=group[0].inputs[0])[group[0].inputs[0]]
        hessian = None
        for name in names:
            gptq = Gptq(params[name].parts["weight"], name)
            if hessian is None:
                gptq.add_batch(x)
                hessian = (gptq.hessian, gptq.num_samples)
            gptq.hessian, gptq.num_samples = hessian  # same input, same H (run() copies it)
            fmt = format_of(name)
            run.keep(name, fmt, gptq.quantize(fmt, options.damp, options.block_size, options.act_order), params)
    for node in (n for n in nodes if n.op == "moe"):
        quantize_experts(run, nodes, node, params, partial(gptq_expert, partial(_gptq_parts, options=options)),
                         format_of, experts if experts is not None else ExpertStats("gptq"))


def _gptq_parts(weight: torch.Tensor, x: torch.Tensor, fmt: Format, name: str,
                options: GptqOptions) -> dict[str, torch.Tensor]:
    """One weight quantized with GPTQ on inputs x (..., K)."""
    gptq = Gptq(weight, name)
    gptq.add_batch(x)
    return gptq.quantize(fmt, options.damp, options.block_size, options.act_order)


def _inverse_cholesky(h: torch.Tensor, damp: float, name: str) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp·mean(diag H)·I)⁻¹, as in the reference."""
    h = h.clone()
    h.diagonal().add_(damp * torch.diagonal(h).mean())
    lower, info = torch.linalg.cholesky_ex(h)
    if int(info) != 0:
        raise InputError(f"{name}: the Hessian is not positive definite after dampening {damp}; "
                         "use a larger damp or more calibration samples")
    return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)
