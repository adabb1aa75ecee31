"""The EAGLE draft head: its shape, its tensors, and its forward (the one definition training and
decoding share).

EAGLE (Li et al. 2024) drafts with one small decoder layer over the target's own features. Entry p
of the head's sequence pairs the target's feature f_p (the lm_head's input at position p, which
predicted token p + 1) with the token that followed, t_{p+1}:

    x_p = fc(concat(embed(t_{p+1}), f_p))          embed: the target's embedding, read, not copied
    y_p = x_p + attention(rope(rms_norm(x_p)))     causal over entries <= p (the head's own K/V);
                                                   `input_norm` off (EAGLE-1's heads): no rms_norm
    f^_{p+1} = y_p + mlp(rms_norm(y_p))            gated silu MLP
    logits of t_{p+2} = f^_{p+1} @ lm_rows^T       lm_rows: the target's lm_head rows of `vocab_ids`

The feature is the lm_head's input (after the final norm), as EAGLE's reference code takes the base
model's last hidden state, so the predicted feature goes to the lm_head with no norm of its own. The
logits cover a reduced vocabulary (EAGLE-3's trick): the `vocab_ids` the target emitted most often on
the training data; a draft is always one of them, and verification stays lossless whatever the draft.

Drafting k tokens: the real entries (features the target computed) extend the head's cache; then each
draft feeds the predicted feature back with the drafted token, on cache entries that are dropped
afterwards. Not here: training (passes/train_draft_head.py) or the per-request decode state
(runtime/eagle.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

PREFIX = "eagle"  # the head's tensor names: eagle.fc.weight, ...


@dataclass(frozen=True)
class EagleHeadConfig:
    """The head's shape; `vocab_ids`: the target token of each of its logits."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_ids: tuple[int, ...]
    input_norm: bool = True  # an RMSNorm before attention; EAGLE-1's published heads have none


    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor the head owns (the embedding and lm_head are the target's)."""
        h, d = self.hidden_size, self.head_dim
        qkv = (self.num_heads + 2 * self.num_kv_heads) * d
        shapes = {"fc.weight": (h, 2 * h), "fc.bias": (h,), "input_layernorm.weight": (h,),
                  "qkv_proj.weight": (qkv, h), "o_proj.weight": (h, self.num_heads * d),
                  "post_attention_layernorm.weight": (h,), "gate_up_proj.weight": (2 * self.intermediate_size, h),
                  "down_proj.weight": (h, self.intermediate_size)}
        if not self.input_norm:
            del shapes["input_layernorm.weight"]
        return {f"{PREFIX}.{k}": v for k, v in shapes.items()}

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "vocab_ids": list(self.vocab_ids)}

    @staticmethod
    def from_json(d: dict[str, Any]) -> EagleHeadConfig:
        return EagleHeadConfig(**{**d, "vocab_ids": tuple(d["vocab_ids"])})


def init_weights(config: EagleHeadConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Float32 starting weights: norms at one, linears N(0, 0.02), the fc's feature half near identity
    (the head starts by passing the feature through, which is what a next feature most resembles)."""
    weights = {}
    for name, shape in config.tensor_shapes().items():
        if name.endswith("layernorm.weight"):
            weights[name] = torch.ones(shape)
        elif name.endswith("bias"):
            weights[name] = torch.zeros(shape)
        else:
            weights[name] = torch.randn(shape, generator=generator) * 0.02
    h = config.hidden_size
    weights[f"{PREFIX}.fc.weight"][:, h:] += torch.eye(h)
    return weights


class EagleHead:
    """The head's forward over weights in a dict (trainable tensors in training, loaded ones in decoding)."""

    def __init__(self, config: EagleHeadConfig, weights: dict[str, torch.Tensor], embedding: torch.Tensor,
                 lm_rows: torch.Tensor, linear: Callable[..., torch.Tensor] = F.linear) -> None:
        """`embedding`: the target's (V, H) table; `lm_rows`: (N, H) the target lm_head's rows of vocab_ids;
        `linear`: F.linear's signature, the matmul of every projection (decoding on the CPU: bf16dot's)."""
        self.config = config
        self.linear = linear
        self.w = {k.removeprefix(f"{PREFIX}."): v for k, v in weights.items()}
        self.embedding, self.lm_rows = embedding, lm_rows
        c = config
        self._inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self._split = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)

    def forward(self, token_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Predicted next features (T, H) for T new entries (tokens t_{p+1}, features f_p, positions p),
        attending to `cache` (K, V: (L, H_kv, D), the entries before them) and causally among
        themselves, or as `mask` (T, L + T) bool says; also the K, V of the new entries (T, H_kv, D)."""
        c, w = self.config, self.w
        dtype = w["fc.weight"].dtype
        x = torch.cat([self.embedding[token_ids].to(dtype), features.to(dtype)], dim=-1)
        x = self.linear(x, w["fc.weight"], w["fc.bias"])  # x: (T, H)
        normed = _rms_norm(x, w["input_layernorm.weight"], c.rms_norm_eps) if c.input_norm else x
        q, k, v = self.linear(normed, w["qkv_proj.weight"]).split(self._split, dim=-1)
        t = x.shape[0]
        q, k = self._rope(q.view(t, c.num_heads, c.head_dim), positions), self._rope(
            k.view(t, c.num_kv_heads, c.head_dim), positions)
        v = v.view(t, c.num_kv_heads, c.head_dim)
        keys, values = (k, v) if cache is None else (torch.cat([cache[0], k]), torch.cat([cache[1], v]))
        past = keys.shape[0] - t
        # mask: entry i sees every cached entry and new entries <= i
        if mask is None:
            mask = torch.ones(t, keys.shape[0], dtype=torch.bool).tril(past)
        group = c.num_heads // c.num_kv_heads
        a = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.repeat_interleave(group, 1).transpose(0, 1),
            values.repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask)  # a: (H, T, D)
        x = x + self.linear(a.transpose(0, 1).reshape(t, -1), w["o_proj.weight"])
        gate, up = self.linear(_rms_norm(x, w["post_attention_layernorm.weight"], c.rms_norm_eps),
                            w["gate_up_proj.weight"]).chunk(2, dim=-1)
        x = x + self.linear(F.silu(gate) * up, w["down_proj.weight"])
        return x, (k, v)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """(T, N) float32 logits over vocab_ids."""
        return self.linear(features.to(self.lm_rows.dtype), self.lm_rows).float()

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: (T, heads, D), rotate-half rope as Llama's
        angles = positions.float()[:, None] * self._inv_freq[None, :]  # (T, D/2)
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :].to(x.dtype)
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
