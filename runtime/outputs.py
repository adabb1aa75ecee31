"""What an engine hands out: a finished request's `Completion` and the `EngineStats` counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]  # generated tokens only
    finish_reason: str  # "stop" | "length"
    prompt_token_ids: list[int]


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int  # usable blocks (the null block excluded)
    num_kv_blocks_used: int
    num_kv_blocks_free: int  # free blocks still holding a cached prefix count as free
    kv_usage: float
    kv_bytes_per_token: float  # KV bytes one token holds over every layer, scales included (with a draft: both)
    prefix_cache_hit_rate: float  # hit tokens / looked-up tokens, over admissions
    num_prefix_cache_hit_tokens: int
    num_prefix_cache_query_tokens: int  # prompt tokens looked up in the prefix cache (the rate's denominator)
    num_preemptions: int
    num_prompt_tokens: int  # prompt tokens of every request added
    num_computed_prompt_tokens: int  # prompt tokens run through the model (recomputation included)
    num_computed_tokens: int
    num_generated_tokens: int
    num_steps: int
    num_drafts: int = 0  # verifications of a request that had draft tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_position: tuple[int, ...] = ()  # [i]: drafts accepted at position i
    spec_acceptance_rate: float = 0.0  # accepted / drafted tokens
    spec_mean_acceptance_length: float = 0.0  # 1 + accepted / drafts: tokens per verification
