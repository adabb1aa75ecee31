"""What an op is: `OpSpec` (signature, traits, torch reference and the node -> arguments adapter),
and `Param`, a node's weight as its implementations receive it.

An implementation of an op is a plain function over tensors (the torch reference here, a Triton
launcher in optc.kernels) with the reference's signature. The op's `call` adapter is the only code
that reads a node: it turns `(node, inputs, params, step)` into that function's arguments and its
result back into the node's outputs, so `spec.bind(fn)` makes any such function an executor `Impl`.
`step` (optc.core.execute.Step) carries positions, the batch layout, the KV caches and the rope table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from optc.core.formats import Format, dequantize
from optc.core.ir import ModelConfig, Node

Impl = Callable[[Node, list, dict, Any], list]  # (node, inputs, params, step) -> outputs


@dataclass(frozen=True)
class Param:
    parts: dict[str, torch.Tensor]
    format: Format

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.parts, self.format, dtype)


@dataclass(frozen=True)
class OpSpec:
    num_inputs: int
    num_outputs: int | None  # None: given by attrs (linear split)
    attrs: tuple[str, ...]
    params: tuple[str, ...]
    param_shapes: Callable[[Node, ModelConfig], dict[str, tuple[int, ...]]]
    reference: Callable  # the torch reference, over the arguments `call` gives it
    call: Callable[..., list]  # (fn, node, inputs, params, step) -> outputs: the node -> arguments adapter
    optional_params: tuple[str, ...] = ()
    touches_kv_cache: bool = False  # reads or writes the paged KV cache (kv_layout records its layout)
    reference_syncs_host: bool = False  # the reference reads device values on the host: no CUDA-graph capture
    rows: Callable[[list, Any], int] = None  # (inputs, step) -> the M a per-M kernel choice routes on
    # (node, role -> its param's format) -> why the node cannot run (verify raises it), or None
    check: Callable[[Node, dict[str, Format]], str | None] | None = None

    def __post_init__(self) -> None:
        if self.rows is None:
            object.__setattr__(self, "rows", matmul_rows)

    def bind(self, fn: Callable) -> Impl:
        """An executor Impl that runs `fn` (the reference's signature) on a node."""
        return partial(self.call, fn)

    @property
    def ref(self) -> Impl:
        return self.bind(self.reference)


def matmul_rows(inputs: list, step: Any) -> int:
    """The rows of a matmul over the first input (T, ..., K): its product of leading dimensions."""
    x = inputs[0]
    return x.numel() // x.shape[-1]


def heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """(T, H * D) values between nodes -> (T, H, D) views."""
    return x.view(x.shape[0], num_heads, head_dim)


def no_params(node: Node, cfg: ModelConfig) -> dict:
    return {}


def vocab_weight(node: Node, cfg: ModelConfig) -> dict:
    return {"weight": (cfg.vocab_size, cfg.hidden_size)}
