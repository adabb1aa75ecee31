"""The ops that read a weight matrix: `embedding` (a row lookup), `linear` and `lm_head` (x @ W^T).

The matmul reference is optc.formats.linear_ref for every weight format (dense, int8_wo, int4_g):
W is dequantized in x's dtype before the matmul; the Triton w4a16 / w8a16 launchers share its
signature. A linear with a `split` attr is the fusion of sibling linears: its output is split
along features into the siblings' outputs. `lm_head` computes the logits of the step's selected
rows only, in float32.
"""

from __future__ import annotations

import torch.nn.functional as F

from optc.formats import linear_ref
from optc.ir import ModelConfig, Node
from optc.ops.spec import OpSpec, vocab_weight


def _embedding_call(fn, node, inputs, params, step):
    # embedding(input_ids) [weight] -> hidden
    return [fn(inputs[0], params["weight"].dense())]


def _linear_call(fn, node, inputs, params, step):
    # linear(x) {split?} [weight, bias?] -> y, or its split along features
    w = params["weight"]
    y = fn(inputs[0], w.parts, w.format, params["bias"].dense() if "bias" in params else None)
    split = node.attrs.get("split")
    return list(y.split(split, dim=-1)) if split else [y]


def _lm_head_call(fn, node, inputs, params, step):
    # lm_head(hidden) [weight] -> float32 logits of the rows step.logits_indices selects (None: all)
    x = inputs[0] if step.logits_indices is None else inputs[0][step.logits_indices]
    w = params["weight"]
    return [fn(x, w.parts, w.format).float()]


def _linear_shapes(node: Node, cfg: ModelConfig) -> dict:
    n, k = node.attrs["out_features"], node.attrs["in_features"]
    return {"weight": (n, k), "bias": (n,)}


EMBEDDING = OpSpec(1, 1, (), ("weight",), vocab_weight, F.embedding, _embedding_call)
LINEAR = OpSpec(1, None, ("in_features", "out_features"), ("weight",), _linear_shapes, linear_ref, _linear_call,
                optional_params=("bias",))
LM_HEAD = OpSpec(1, 1, (), ("weight",), vocab_weight, linear_ref, _lm_head_call)
