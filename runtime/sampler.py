"""Sampling: SamplingParams and the sampler (a pure function of logits, params and generators).

`sample` turns one row of float32 logits per request into one token id per request. Every step is
row-wise and each sampled request draws from its own `torch.Generator`, so a seeded request gets the
same tokens whatever else is in the batch. Greedy rows (temperature 0) take the argmax and use no
randomness. Stop strings are matched on detokenized text, in runtime/text.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from optc.core.errors import InputError
from optc.kernels.cpu_ext import ops as cpu_ops
from optc.runtime.grammar import GrammarSpec

# Seeds are signed 64-bit integers, as in vLLM. torch.Generator.manual_seed also takes [2**63, 2**64),
# but those alias the negatives (-1 is 2**64 - 1), and a larger int is its ValueError.
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 63) - 1


GREEDY_BELOW = 1e-5  # a temperature below this samples greedily


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (anything below GREEDY_BELOW) = greedy
    top_k: int = 0  # 0 = all tokens
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None  # None = drawn from the engine's generator
    max_tokens: int | None = 16  # None = up to the context; prompt + max_tokens must fit in it (the engine checks)
    stop: tuple[str, ...] = ()  # stop strings, checked on the detokenized output
    ignore_eos: bool = False  # keep generating after EOS (benchmarks)
    logprobs: int | None = None  # None = none; k = each output token's logprob and the k most likely
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (no prefix cache)
    presence_penalty: float = 0.0  # OpenAI's: minus this from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: minus this times each token's count in the output
    repetition_penalty: float = 1.0  # CTRL's (HF, vLLM): a prompt or output token's logit / r if > 0, else * r
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many output tokens
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end the request (finish "stop"), kept in the output
    grammar: GrammarSpec | None = None  # structured output: only tokens the grammar allows (runtime/grammar.py)
    skip_special_tokens: bool = True  # leave special tokens out of the text (False: a parser reads them)

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        if not 0.0 <= self.temperature < math.inf:
            raise InputError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}",
                             "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}", "top_k")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise InputError(f"seed must be in [{MIN_SEED}, {MAX_SEED}] (a signed 64-bit integer), got {self.seed}",
                             "seed")
        # max_tokens 0 only scores the prompt: it needs prompt_logprobs, and generates nothing
        if self.max_tokens is not None and self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise InputError(f"max_tokens must be >= 1 (0 with prompt_logprobs), got {self.max_tokens}", "max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise InputError(f"{name} must be >= 0 or None, got {getattr(self, name)}", name)
        if any(not isinstance(s, str) or not s for s in stop):
            raise InputError(f"stop strings must be non-empty strings, got {stop!r}", "stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InputError(f"{name} must be in [-2, 2] (OpenAI's range), got {getattr(self, name)}", name)
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise InputError(f"repetition_penalty must be in (0, 100] (1 = off), got {self.repetition_penalty}",
                             "repetition_penalty")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise InputError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}",
                             "min_tokens")
        for token_id, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise InputError(f"logit_bias of token {token_id} must be in [-100, 100], got {bias}", "logit_bias")

    @property
    def shapes_logits(self) -> bool:
        """Whether the logits need more than temperature / top-k / top-p (runtime/logits_processors.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.grammar is not None)

    @property
    def is_greedy(self) -> bool:
        # below GREEDY_BELOW, logits / temperature overflows float32 to inf and softmax gives NaN: argmax
        # is the limit of sampling as temperature -> 0 (vLLM's _SAMPLING_EPS is the same 1e-5)
        return self.temperature < GREEDY_BELOW


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """One token per row. logits: (B, V) float32; returns (B,) int64 on the logits' device."""
    token_ids = cpu_ops.top_k(logits, 1)[:, 0]  # argmax, in one SIMD pass on the CPU (262,144 logits: 0.15 ms by torch)
    rows = [b for b, p in enumerate(params) if not p.is_greedy]
    if not rows:
        return token_ids
    device = logits.device
    index = torch.tensor(rows, device=device)
    temperature = torch.tensor([params[b].temperature for b in rows], device=device)
    top_k = torch.tensor([params[b].top_k for b in rows], device=device)
    top_p = torch.tensor([params[b].top_p for b in rows], device=device)
    scaled = logits.index_select(0, index) / temperature[:, None]
    probs = apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)
    for j, b in enumerate(rows):
        token_ids[b] = torch.multinomial(probs[j], 1, generator=generators[b])[0]
    return token_ids


@dataclass(frozen=True)
class Logprobs:
    """log p(token_id | the tokens before it) and the `num_top` most likely tokens with theirs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[Logprobs]:
    """Logprobs of `token_ids` under the model's own distribution: log_softmax of the raw logits,
    before temperature, top-k and top-p (what OpenAI's API and evaluation harnesses score).

    logits: (N, V) float32; token_ids: (N,) int64, the token that follows each row; num_top >= 0.
    """
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None].to(logprobs.device))[:, 0].tolist()
    ids = token_ids.tolist()
    if num_top == 0:
        return [Logprobs(t, lp, ()) for t, lp in zip(ids, chosen, strict=True)]
    top_values, top_ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    return [
        Logprobs(t, lp, tuple(zip(i, v, strict=True)))
        for t, lp, i, v in zip(ids, chosen, top_ids.tolist(), top_values.tolist(), strict=True)
    ]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set the logits outside each row's top-k / top-p set to -inf.

    logits: (B, V); top_k: (B,) int, 0 = off; top_p: (B,) float, 1 = off. Top-k first, then top-p
    on the renormalized survivors: a token is dropped when the probability mass strictly before it
    (in descending order) already reaches top_p, so the most likely token always survives.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab_size, device=logits.device)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)
    drop = ranks[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False  # a top_p that rounds to 0 in float32 (5e-324) would drop every token: softmax of NaN
    drop = torch.zeros_like(drop).scatter(-1, order, drop)
    return logits.masked_fill(drop, float("-inf"))

