"""Request: one prompt being served, from arrival to finish.

A request holds its tokens (prompt, then output) and how many of them have K/V in the cache
(`num_computed_tokens`). The scheduler moves `num_computed_tokens` towards `num_tokens`; the engine
appends sampled tokens. Blocks are not here: the KVCacheManager maps request ids to block ids.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import torch

from optc.core.errors import InputError
from optc.runtime.grammar import Matcher
from optc.runtime.sampler import Logprobs, SamplingParams
from optc.runtime.text import IncrementalDetokenizer, held_back


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS token or stop string
    LENGTH = "length"  # max_tokens, or the context / KV pool is full
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_num_tokens: int  # prompt + output never exceed this (context or KV pool size)
    generator: torch.Generator | None = None  # None for greedy requests
    arrival_time: float = 0.0
    detokenizer: IncrementalDetokenizer = field(default_factory=lambda: IncrementalDetokenizer(None))
    token_ids: list[int] = field(init=False)  # prompt, then output
    num_computed_tokens: int = 0
    draft_token_ids: list[int] = field(default_factory=list)  # speculative, unverified: after token_ids
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks
    num_cached_tokens: int = 0  # prefix-cache hit at the last admission
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    text: str = ""  # detokenized output so far (current after every step), cut before a stop string
    num_emitted_chars: int = 0  # streaming: text already handed out by take_delta
    logprobs: list[Logprobs] = field(default_factory=list)  # per output token, with params.logprobs
    prompt_logprobs: list[Logprobs | None] = field(default_factory=list)  # per prompt token (None first)
    matcher: Matcher | None = None  # params.grammar's state over the output so far (runtime/grammar.py)
    lora_name: str | None = None  # the LoRA adapter it runs under (runtime/lora.py); None: the base model
    lora_slot: int = -1  # that adapter's slot in the model's LoraSlots
    lora_key: bytes | None = None  # that adapter's name and weights' hash: its first prefix-cache block's parent

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def query_token_ids(self, num_tokens: int) -> list[int]:
        """The next `num_tokens` uncomputed tokens: its own, then its draft tokens."""
        start, end = self.num_computed_tokens, self.num_computed_tokens + num_tokens
        if end <= self.num_tokens:
            return self.token_ids[start:end]
        return self.token_ids[start:] + self.draft_token_ids[: end - self.num_tokens]

    def take_delta(self) -> str:
        """New output text that can no longer change (streaming): all of it once the request has
        finished, else up to the characters that could still start a stop string."""
        end = len(self.text) if self.is_finished else len(self.text) - held_back(self.text, self.params.stop)
        delta = self.text[self.num_emitted_chars : max(end, self.num_emitted_chars)]
        self.num_emitted_chars += len(delta)
        return delta


def fit_max_tokens(params: SamplingParams, num_prompt_tokens: int, max_model_len: int, context: str) -> SamplingParams:
    """`params` with max_tokens None resolved to the room the prompt leaves in the context (`context` says
    how the limit of `max_model_len` tokens comes about). A prompt and max_tokens that together overflow the
    context are an InputError naming both (as OpenAI and vLLM answer), never a silent cut. The KV pool, when
    smaller than the context, still cuts (finish "length")."""
    room = max_model_len - num_prompt_tokens
    if params.max_tokens is None:
        if room == 0:
            raise InputError(f"the prompt has {num_prompt_tokens} tokens, the whole context {context}: no room "
                             "for an output token", "prompt")
        return dataclasses.replace(params, max_tokens=room)
    if params.max_tokens > room:
        raise InputError(
            f"the prompt has {num_prompt_tokens} tokens and max_tokens is {params.max_tokens}: "
            f"{num_prompt_tokens + params.max_tokens} tokens, more than the context holds {context}; "
            + (f"lower max_tokens to {room} or fewer" if room else "shorten the prompt"),
            "max_tokens" if room else "prompt",
        )
    return params
