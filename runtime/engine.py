"""Engine: serve a loaded model: tokenize, schedule, run steps, sample, detokenize, stop.

`Engine.load(path)` loads an artifact and sizes the KV pool; `generate` runs a list of prompts to
completion through the scheduler (continuous batching) and returns them in input order; `stream`
yields text deltas of one prompt; `add_request`/`step`/`abort` are the pieces a server drives. One
step = schedule -> one `model.forward` over all scheduled tokens -> advance computed counts ->
sample for the requests that reached their last token -> detokenize the new tokens (incrementally,
runtime/detokenizer.py) -> check stops. The engine owns the KV tensors; the scheduler and KV manager
below it see only block ids; the pool's size comes from runtime/kv_sizing.py. Pure-decode steps
replay CUDA graphs on a cuda device (runtime/cuda_graphs.py). With speculative decoding
(runtime/speculative.py) the step starts by giving decoding requests draft tokens, the forward scores
each draft, and verification appends the accepted ones plus one token, each checked for stops, and
rolls the computed count back over the rest. No HTTP here.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from optc.artifact import Manifest
from optc.errors import InputError
from optc.runtime import logprobs
from optc.runtime.batch import BatchBuilder
from optc.runtime.cuda_graphs import make_runner
from optc.runtime.detokenizer import IncrementalDetokenizer, find_stop
from optc.runtime.kv_cache_manager import KVCacheManager
from optc.runtime.kv_sizing import num_kv_blocks
from optc.runtime.request import FinishReason, Request
from optc.runtime.sampler import SamplingParams, sample
from optc.runtime.scheduler import Scheduler, SchedulerConfig
from optc.runtime.speculative import SpeculativeConfig, Speculator

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]  # generated tokens only
    finish_reason: str  # "stop" | "length"
    prompt_token_ids: list[int]


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_seq_len: int | None = None  # None = the model's max_position_embeddings
    num_blocks: int | None = None  # KV pool size in blocks (null block included); None = from memory
    kv_cache_memory: int | None = None  # KV pool bytes; None = CPU default or gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs
    cuda_graph_batch_sizes: tuple[int, ...] | None = None  # decode buckets; None = the runtime's default
    seed: int | None = None  # seeds the generators of requests without a seed

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InputError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise InputError(f"num_blocks must be >= 2, got {self.num_blocks}")

    @classmethod
    def from_manifest(cls, manifest: Manifest, **overrides: Any) -> EngineConfig:
        """Runtime settings of an artifact's manifest, then the caller's overrides."""
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - allowed)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; allowed: {sorted(allowed)}")
        runtime = manifest.runtime or {}
        values = {
            "block_size": manifest.kv_layout.block_size,
            "max_num_seqs": runtime.get("max_batch_size"),
            "max_num_batched_tokens": runtime.get("max_num_batched_tokens"),
            "max_seq_len": runtime.get("max_seq_len"),
            "kv_cache_memory": runtime.get("kv_cache_memory"),
            "gpu_memory_utilization": runtime.get("gpu_memory_utilization"),
            "cuda_graph_batch_sizes": tuple((manifest.cuda_graphs or {}).get("batch_sizes") or ()) or None,
        }
        values = {k: v for k, v in values.items() if v is not None}
        return cls(**{**values, **overrides})


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int  # usable blocks (the null block excluded)
    num_kv_blocks_used: int
    num_kv_blocks_free: int  # free blocks still holding a cached prefix count as free
    kv_usage: float
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


class Engine:
    def __init__(
        self, model: Any, tokenizer: Any, config: EngineConfig | None = None, speculator: Speculator | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        self.device = torch.device(model.device)
        self.max_model_len = min(model.max_position_embeddings, config.max_seq_len or 1 << 62)
        num_blocks = config.num_blocks or num_kv_blocks(model, config, self.max_model_len)
        self.kv_caches = model.allocate_kv_caches(num_blocks, config.block_size)
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.graph_runner = make_runner(  # None on the CPU or with enforce_eager: eager steps
            model, self.kv_caches, enforce_eager=config.enforce_eager, batch_sizes=config.cuda_graph_batch_sizes,
            max_num_seqs=config.max_num_seqs, max_seq_len=self.max_model_len, block_size=config.block_size)
        self.batch_builder = BatchBuilder(self.device)  # eager steps: one host->device copy each
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.kv_manager
        )
        self.vocab_size = model.vocab_size
        self.dtype = model.dtype
        self.cuda_graph_batch_sizes = self.graph_runner.config.batch_sizes if self.graph_runner else None
        self._eos_token_ids = frozenset(model.eos_token_ids)
        self._seeds = random.Random(config.seed)
        self._next_request_id = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
        self._num_steps = 0
        self.speculator = speculator

    @classmethod
    def load(
        cls, path: str | Path, device: str = "cpu", verify: bool = True,
        speculative: SpeculativeConfig | None = None, **overrides: Any,
    ) -> Engine:
        """Load an artifact; `overrides` are EngineConfig fields that replace the manifest's;
        `speculative` replaces the manifest's runtime.speculative (a draft artifact loads here too)."""
        from transformers import AutoTokenizer

        from optc.artifact import read
        from optc.runtime.loader import load_model
        from optc.runtime.speculative import make_speculator

        artifact = read(path, verify=verify, device=device)
        config = EngineConfig.from_manifest(artifact.manifest, **overrides)
        tokenizer = AutoTokenizer.from_pretrained(artifact.tokenizer_dir)
        model = load_model(artifact, device)
        engine = cls(model, tokenizer, config)
        engine.speculator = make_speculator(
            artifact, model, tokenizer, speculative, engine.kv_manager.num_blocks, config.block_size, verify)
        return engine

    # -- public API -------------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
    ) -> list[Completion]:
        """Run every prompt to completion, batched; completions in input order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InputError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        requests = [self._make_request(p, sp, chat) for p, sp in zip(prompts, params, strict=True)]
        for request in requests:
            self._add(request)
        try:
            while not all(r.is_finished for r in requests):
                self.step()
        except BaseException:
            for request in requests:
                self.abort(request.request_id)
            raise
        return [_completion(r) for r in requests]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, chat: bool = False
    ) -> Iterator[str]:
        """Yield text deltas of one prompt as it generates; closing the iterator aborts it."""
        request = self._make_request(prompt, params or SamplingParams(), chat)
        self._add(request)
        try:
            while not request.is_finished:
                self.step()
                delta = request.take_delta()
                if delta:
                    yield delta
        finally:
            self.abort(request.request_id)

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, chat: bool = False,
        request_id: str | None = None,
    ) -> Request:
        """Validate, tokenize and queue one prompt (InputError if it can never be served: empty, not
        Unicode, outside the vocabulary, or it and max_tokens longer than the context)."""
        request = self._make_request(prompt, params or SamplingParams(), chat, request_id)
        self._add(request)
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished."""
        if self.speculator is not None:
            self.speculator.release(request_id)
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """Run one model step; the requests that got a token in it (or, with max_tokens 0, finished)."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        for request_id in out.preempted_ids if self.speculator is not None else ():
            self.speculator.release(request_id)
        if out.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler scheduled nothing while requests wait (a bug)")
            return []
        for source, destination in self.kv_manager.take_copies():
            for cache in self.kv_caches:
                cache[destination].copy_(cache[source])
        starts = [r.num_computed_tokens for r in out.requests]
        pairs = list(zip(out.requests, out.num_new_tokens, strict=True))
        num_drafts = [len(r.draft_token_ids) for r in out.requests]
        # drafts run only in decode (one row for logprobs): one more logits row per draft token
        num_rows = [logprobs.num_logits_rows(r, r.num_computed_tokens, n - d) + d
                    for (r, n), d in zip(pairs, num_drafts, strict=True)]
        batch = (self.graph_runner or self.batch_builder).build(  # a replayed step: straight into the graph's buffers
            [r.query_token_ids(n) for r, n in pairs], starts, out.block_ids, self.config.block_size, num_rows,
        )
        logits = (self.graph_runner or self.model).forward(batch, self.kv_caches)  # (sum(num_rows), V) float32
        self.scheduler.update(out)
        self._num_steps += 1
        last_rows = logprobs.record_prompt_logprobs(out.requests, starts, num_rows, logits)
        ready = [b for b, r in enumerate(out.requests) if r.num_computed_tokens >= r.num_tokens]
        now = time.perf_counter()
        for request in [out.requests[b] for b in ready if out.requests[b].params.max_tokens == 0]:
            request.finish_time = now  # max_tokens 0: the prompt is scored, nothing is generated
            self.scheduler.finish(request.request_id, FinishReason.LENGTH)
        done = [out.requests[b] for b in ready]
        ready = [b for b in ready if out.requests[b].params.max_tokens > 0]
        plain = [b for b in ready if num_drafts[b] == 0]
        spec = [b for b in ready if num_drafts[b] > 0]
        new_tokens: dict[int, list[int]] = {}
        first_rows = {b: last_rows[b] - num_drafts[b] for b in ready}  # the row of each request's first new token
        if plain:
            sampled = [out.requests[b] for b in plain]
            rows = [last_rows[b] for b in plain]
            selected = logits if rows == list(range(logits.shape[0])) else logits[rows]  # no gather: no index copy
            token_ids = sample(selected, [r.params for r in sampled], [r.generator for r in sampled]).tolist()
            new_tokens.update((b, [t]) for b, t in zip(plain, token_ids, strict=True))
        if spec:
            verified = self.speculator.verify(
                [out.requests[b] for b in spec], [logits[first_rows[b] : last_rows[b] + 1] for b in spec])
            new_tokens.update(zip(spec, verified, strict=True))
        for b in ready:
            request = out.requests[b]
            for i, token_id in enumerate(new_tokens[b]):  # stops apply to every token: nothing after one
                row = first_rows[b] + i
                logprobs.record_logprobs([request], logits[row : row + 1], [token_id])
                request.append_token(token_id)
                self._num_generated_tokens += 1
                if request.first_token_time is None:
                    request.first_token_time = now
                self._check_stop(request, now)
                if request.is_finished:
                    break
            if num_drafts[b] and not request.is_finished:  # roll back over the rejected drafts
                request.num_computed_tokens = request.num_tokens - 1
                self.kv_manager.truncate(request, request.num_tokens)
        return done

    def stats(self) -> EngineStats:
        kv, scheduler = self.kv_manager, self.scheduler
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_kv_blocks=kv.num_blocks - 1,
            num_kv_blocks_used=kv.num_used_blocks,
            num_kv_blocks_free=kv.num_free_blocks,
            kv_usage=kv.num_used_blocks / (kv.num_blocks - 1),
            prefix_cache_hit_rate=kv.prefix_cache_hit_rate,
            num_prefix_cache_hit_tokens=kv.num_prefix_hit_tokens,
            num_prefix_cache_query_tokens=kv.num_prefix_query_tokens,
            num_preemptions=scheduler.num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens,
            num_computed_prompt_tokens=scheduler.num_computed_prompt_tokens,
            num_computed_tokens=scheduler.num_computed_tokens,
            num_generated_tokens=self._num_generated_tokens,
            num_steps=self._num_steps,
            **(self.speculator.stats.to_fields() if self.speculator is not None else {}),
        )

    # -- helpers ----------------------------------------------------------------------------------

    def _make_request(
        self, prompt: Prompt, params: SamplingParams, chat: bool, request_id: str | None = None,
    ) -> Request:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt_ids = self._tokenize(prompt, chat)
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
        params = self._fit_max_tokens(len(prompt_ids), params)
        if request_id is None:
            request_id, self._next_request_id = str(self._next_request_id), self._next_request_id + 1
        generator = None
        if not params.is_greedy:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
            generator = torch.Generator(device=self.device).manual_seed(seed)
        return Request(
            request_id, prompt_ids, params, max_num_tokens=min(self.max_model_len, capacity),
            generator=generator, arrival_time=time.perf_counter(),
            detokenizer=IncrementalDetokenizer(self.tokenizer),
        )

    @property
    def _context_limit(self) -> str:
        return (f"{self.max_model_len} (max_position_embeddings={self.model.max_position_embeddings}, "
                f"max_seq_len={self.config.max_seq_len})")

    def _fit_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> SamplingParams:
        """`params` with max_tokens None resolved to the room the prompt leaves in the context. A prompt and
        max_tokens that together overflow the context are an InputError naming both (as OpenAI and vLLM
        answer), never a silent cut. The KV pool, when smaller than the context, still cuts (finish "length")."""
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            if room == 0:
                raise InputError(f"the prompt has {num_prompt_tokens} tokens, the whole context "
                                 f"{self._context_limit}: no room for an output token", "prompt")
            return dataclasses.replace(params, max_tokens=room)
        if params.max_tokens > room:
            raise InputError(
                f"the prompt has {num_prompt_tokens} tokens and max_tokens is {params.max_tokens}: "
                f"{num_prompt_tokens + params.max_tokens} tokens, more than the context holds {self._context_limit}; "
                + (f"lower max_tokens to {room} or fewer" if room else "shorten the prompt"),
                "max_tokens" if room else "prompt",
            )
        return params

    def _add(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self._num_prompt_tokens += request.num_prompt_tokens

    def _tokenize(self, prompt: Prompt, chat: bool) -> list[int]:
        if not isinstance(prompt, str):
            if chat:
                raise InputError("chat=True needs text prompts, got token ids")
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise InputError("this engine has no tokenizer; pass token ids")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: from a "\ud800" JSON escape, or argv that is not UTF-8
            raise InputError(f"the prompt holds a lone surrogate {prompt[e.start]!r} at index {e.start}: it is not "
                             "Unicode text, so no tokenizer takes it", "prompt") from None
        if not chat:
            return list(self.tokenizer(prompt)["input_ids"])
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):  # transformers 5: BatchEncoding
            ids = ids["input_ids"]
        if len(ids) and not isinstance(ids[0], int):  # a batch of one
            ids = ids[0]
        return [int(t) for t in ids]

    def _check_stop(self, request: Request, now: float) -> None:
        params, token_id = request.params, request.token_ids[-1]
        reason = None
        if token_id in self._eos_token_ids and not params.ignore_eos:
            reason = FinishReason.STOP
        elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= request.max_num_tokens:
            reason = FinishReason.LENGTH
        delta = request.detokenizer.step(request.output_token_ids, final=reason is not None)
        request.text += delta
        cut = find_stop(request.text, len(delta), params.stop)
        if cut is not None:
            request.text, reason = request.text[:cut], FinishReason.STOP
        if reason is None:
            return
        request.finish_time = now
        self.scheduler.finish(request.request_id, reason)
        if self.speculator is not None:
            self.speculator.release(request.request_id)


def _completion(request: Request) -> Completion:
    return Completion(
        text=request.text,
        token_ids=request.output_token_ids,
        finish_reason=str(request.finish_reason),
        prompt_token_ids=list(request.prompt_token_ids),
    )
