"""Intake: turn one prompt and its SamplingParams into a Request the engine can queue, or refuse it.

A prompt (text, or token ids) is tokenized (with the chat template when asked: runtime/text.py) and
checked against what this engine can ever serve: not empty, within the context (max_position_embeddings
and max_seq_len) and the KV pool, every token id (the prompt's, logit_bias's, stop_token_ids') inside the
vocabulary, max_tokens resolved against the room the prompt leaves (request.fit_max_tokens); a refusal is
an InputError naming the field. It also gives the request its id (a counter, unless the caller names one),
a seeded torch.Generator when it samples (params.seed, else one drawn from the engine's seed), its
incremental detokenizer, and its grammar's Matcher (compiled here unless the caller compiled it already).
It does not queue, schedule or assign LoRA adapters: the Engine does.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from optc.core.errors import InputError
from optc.runtime.config import EngineConfig
from optc.runtime.grammar import GrammarCompiler, Matcher
from optc.runtime.kv_cache_manager import KVCacheManager
from optc.runtime.request import Request, fit_max_tokens
from optc.runtime.sampler import SamplingParams
from optc.runtime.text import IncrementalDetokenizer, prompt_token_ids

Prompt = str | Sequence[int]


class Intake:
    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig, kv_manager: KVCacheManager,
                 max_model_len: int, device: torch.device) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.kv_manager = kv_manager
        self.max_model_len = max_model_len
        self.device = device
        self._seeds = random.Random(config.seed)
        self._next_request_id = 0
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' grammar compiler for this tokenizer (built on first use: about a second)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InputError("this artifact has no tokenizer, so it cannot constrain output to a grammar",
                                     "response_format")
                self._grammars = GrammarCompiler(self.tokenizer, self.model.vocab_size,
                                                 sorted(set(self.model.eos_token_ids)))
            return self._grammars

    def request(
        self, prompt: Prompt, params: SamplingParams, chat: bool, request_id: str | None = None,
        matcher: Matcher | None = None,
    ) -> Request:
        """The Request of `prompt` under `params`, validated (InputError naming the field when it can never be
        served). `matcher`: params.grammar's, compiled already (the server compiles off the engine thread)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt_ids = prompt_token_ids(self.tokenizer, prompt, chat)
        capacity = self.kv_manager.num_token_capacity
        if not prompt_ids:
            raise InputError("the prompt is empty (0 tokens)", "prompt")
        if len(prompt_ids) > self.max_model_len:
            raise InputError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self._context_limit}", "prompt"
            )
        if len(prompt_ids) > capacity:
            raise InputError(
                f"the prompt has {len(prompt_ids)} tokens but the KV pool holds at most {capacity} "
                f"({self.kv_manager.num_blocks - 1} blocks of {self.config.block_size}); "
                "raise kv_cache_memory", "prompt"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise InputError(
                f"prompt token ids {bad[:8]} are outside the vocabulary [0, {self.model.vocab_size})", "prompt"
            )
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < self.model.vocab_size]
            if bad:
                raise InputError(f"{name} names token ids {bad[:8]} outside the vocabulary "
                                 f"[0, {self.model.vocab_size})", name)
        if params.grammar is not None and matcher is None:
            matcher = self.grammars.matcher(params.grammar)
        params = fit_max_tokens(params, len(prompt_ids), self.max_model_len, self._context_limit)
        if request_id is None:
            request_id, self._next_request_id = str(self._next_request_id), self._next_request_id + 1
        generator = None
        if not params.is_greedy:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
            generator = torch.Generator(device=self.device).manual_seed(seed)
        return Request(
            request_id, prompt_ids, params, max_num_tokens=min(self.max_model_len, capacity),
            generator=generator, arrival_time=time.perf_counter(),
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens), matcher=matcher,
        )

    @property
    def _context_limit(self) -> str:
        return (f"{self.max_model_len} (max_position_embeddings={self.model.max_position_embeddings}, "
                f"max_seq_len={self.config.max_seq_len})")
