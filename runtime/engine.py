"""Engine: serve a loaded model: tokenize, schedule, run steps, sample, detokenize, stop.

`Engine.load(path)` loads an artifact and sizes the KV pool; `generate` runs a list of prompts to
completion through the scheduler (continuous batching) and returns them in input order; `stream`
yields text deltas of one prompt; `add_request`/`step`/`abort` are the pieces a server drives. One
step = schedule -> one `model.forward` over all scheduled tokens -> advance computed counts ->
sample for the requests that reached their last token -> check stops. The engine owns the KV tensors;
the scheduler and KV manager below it see only block ids. Pure-decode steps replay CUDA graphs on a
cuda device (runtime/cuda_graphs.py). No HTTP here, no speculative decoding yet.
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

from optc.runtime import logprobs
from optc.runtime.batch import ForwardBatch
from optc.runtime.cuda_graphs import make_runner
from optc.runtime.kv_cache_manager import KVCacheManager
from optc.runtime.request import FinishReason, Request
from optc.runtime.sampler import SamplingParams, find_stop_string, sample
from optc.runtime.scheduler import Scheduler, SchedulerConfig

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # upper bound of the CPU default pool, bytes

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
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any], **overrides: Any) -> EngineConfig:
        """Runtime settings of an artifact's manifest, then the caller's overrides."""
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - allowed)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; allowed: {sorted(allowed)}")
        runtime = manifest.get("runtime") or {}
        values = {
            "block_size": (manifest.get("kv_layout") or {}).get("block_size"),
            "max_num_seqs": runtime.get("max_batch_size"),
            "max_num_batched_tokens": runtime.get("max_num_batched_tokens"),
            "max_seq_len": runtime.get("max_seq_len"),
            "kv_cache_memory": runtime.get("kv_cache_memory"),
            "gpu_memory_utilization": runtime.get("gpu_memory_utilization"),
            "cuda_graph_batch_sizes": tuple((manifest.get("cuda_graphs") or {}).get("batch_sizes") or ()) or None,
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


class Engine:
    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        self.device = torch.device(model.device)
        self.max_model_len = min(model.max_position_embeddings, config.max_seq_len or 1 << 62)
        num_blocks = config.num_blocks or self._num_blocks_from_memory()
        self.kv_caches = model.allocate_kv_caches(num_blocks, config.block_size)
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.graph_runner = make_runner(  # None on the CPU or with enforce_eager: eager steps
            model, self.kv_caches, enforce_eager=config.enforce_eager, batch_sizes=config.cuda_graph_batch_sizes,
            max_num_seqs=config.max_num_seqs, max_seq_len=self.max_model_len, block_size=config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.kv_manager
        )
        self._eos_token_ids = frozenset(model.eos_token_ids)
        self._seeds = random.Random(config.seed)
        self._next_request_id = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
        self._num_steps = 0

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu", verify: bool = True, **overrides: Any) -> Engine:
        """Load an artifact; `overrides` are EngineConfig fields that replace the manifest's."""
        from transformers import AutoTokenizer

        from optc.runtime.loader import load

        artifact = load(path, device, verify)  # positional: the loader calls it verify_hashes
        config = EngineConfig.from_manifest(artifact.manifest, **overrides)
        tokenizer = AutoTokenizer.from_pretrained(artifact.tokenizer_dir)
        return cls(artifact.model, tokenizer, config)

    # -- public API -------------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
    ) -> list[Completion]:
        """Run every prompt to completion, batched; completions in input order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
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
        request = self._make_request(prompt, params or SamplingParams(), chat, is_streaming=True)
        self._add(request)
        try:
            while not request.is_finished:
                self.step()
                delta = _take_delta(request)
                if delta:
                    yield delta
        finally:
            self.abort(request.request_id)

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, chat: bool = False,
        request_id: str | None = None, is_streaming: bool = False,
    ) -> Request:
        """Validate, tokenize and queue one prompt (ValueError if it can never be served)."""
        request = self._make_request(prompt, params or SamplingParams(), chat, request_id, is_streaming)
        self._add(request)
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished."""
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """Run one model step; the requests that got a token in it (or, with max_tokens 0, finished)."""
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler scheduled nothing while requests wait (a bug)")
            return []
        for source, destination in self.kv_manager.take_copies():
            for cache in self.kv_caches:
                cache[destination].copy_(cache[source])
        starts = [r.num_computed_tokens for r in out.requests]
        pairs = list(zip(out.requests, out.num_new_tokens, strict=True))
        num_rows = [logprobs.num_logits_rows(r, r.num_computed_tokens, n) for r, n in pairs]
        batch = ForwardBatch.build(
            [r.token_ids[r.num_computed_tokens : r.num_computed_tokens + n] for r, n in pairs],
            starts, out.block_ids, self.config.block_size, num_rows,
        ).to(self.device)
        logits = (self.graph_runner or self.model).forward(batch, self.kv_caches)  # (sum(num_rows), V) float32
        self.scheduler.update(out)
        self._num_steps += 1
        last_rows = logprobs.record_prompt_logprobs(out.requests, starts, num_rows, logits)
        rows = [b for b, r in enumerate(out.requests) if r.num_computed_tokens == r.num_tokens]
        now = time.perf_counter()
        for request in [out.requests[b] for b in rows if out.requests[b].params.max_tokens == 0]:
            request.finish_time = now  # max_tokens 0: the prompt is scored, nothing is generated
            self.scheduler.finish(request.request_id, FinishReason.LENGTH)
        done = [out.requests[b] for b in rows]
        sampled = [r for r in done if r.params.max_tokens > 0]
        rows = [last_rows[b] for b in rows if out.requests[b].params.max_tokens > 0]
        if not rows:
            return done
        selected = logits[rows]
        token_ids = sample(selected, [r.params for r in sampled], [r.generator for r in sampled]).tolist()
        logprobs.record_logprobs(sampled, selected, token_ids)
        for request, token_id in zip(sampled, token_ids, strict=True):
            request.append_token(token_id)
            self._num_generated_tokens += 1
            if request.first_token_time is None:
                request.first_token_time = now
            self._check_stop(request, now)
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
        )

    # -- helpers ----------------------------------------------------------------------------------

    def _make_request(
        self, prompt: Prompt, params: SamplingParams, chat: bool,
        request_id: str | None = None, is_streaming: bool = False,
    ) -> Request:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt_ids = self._tokenize(prompt, chat)
        capacity = self.kv_manager.num_token_capacity
        if not prompt_ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_model_len} "
                f"(max_position_embeddings={self.model.max_position_embeddings}, "
                f"max_seq_len={self.config.max_seq_len})"
            )
        if len(prompt_ids) > capacity:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but the KV pool holds at most {capacity} "
                f"({self.kv_manager.num_blocks - 1} blocks of {self.config.block_size}); "
                "raise kv_cache_memory"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:8]} are outside the vocabulary [0, {self.model.vocab_size})"
            )
        if request_id is None:
            request_id, self._next_request_id = str(self._next_request_id), self._next_request_id + 1
        generator = None
        if not params.is_greedy:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
            generator = torch.Generator(device=self.device).manual_seed(seed)
        return Request(
            request_id, prompt_ids, params, max_num_tokens=min(self.max_model_len, capacity),
            generator=generator, arrival_time=time.perf_counter(), is_streaming=is_streaming,
        )

    def _add(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self._num_prompt_tokens += request.num_prompt_tokens

    def _tokenize(self, prompt: Prompt, chat: bool) -> list[int]:
        if not isinstance(prompt, str):
            if chat:
                raise ValueError("chat=True needs text prompts, got token ids")
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer; pass token ids")
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
        if params.stop or request.is_streaming:
            request.text = self._decode(request.output_token_ids)
            cut = find_stop_string(request.text, params.stop)
            if cut is not None:
                request.text, reason = request.text[:cut], FinishReason.STOP
        if reason is None:
            return
        if not (params.stop or request.is_streaming):
            request.text = self._decode(request.output_token_ids)
        request.finish_time = now
        self.scheduler.finish(request.request_id, reason)

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _num_blocks_from_memory(self) -> int:
        config, model = self.config, self.model
        bytes_per_block = model.kv_bytes_per_block(config.block_size)
        if config.kv_cache_memory is not None:
            budget = config.kv_cache_memory
        elif self.device.type == "cuda":
            activation_bytes = self._profile_activation_bytes()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * config.gpu_memory_utilization) - (total - free) - activation_bytes
        else:
            blocks_per_request = -(-self.max_model_len // config.block_size)
            wanted = config.max_num_seqs * blocks_per_request * bytes_per_block
            budget = min(DEFAULT_CPU_KV_CACHE_MEMORY, wanted)
        num_blocks = budget // bytes_per_block + 1
        if num_blocks < 2:
            raise ValueError(
                f"the KV pool budget of {budget} bytes is less than one block ({bytes_per_block} bytes); "
                "raise kv_cache_memory or gpu_memory_utilization"
            )
        return int(num_blocks)

    def _profile_activation_bytes(self) -> int:
        """Peak CUDA memory of one full-budget step, run on a throwaway 1-block cache (every token
        written to block 0), so the KV pool leaves room for it."""
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        size = self.config.block_size
        caches = self.model.allocate_kv_caches(1, size)
        batch = ForwardBatch.build([[0] * num_tokens], [0], [[0] * -(-num_tokens // size)], size)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.model.forward(batch.to(self.device), caches)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del caches
        torch.cuda.empty_cache()
        return int(peak)


def _completion(request: Request) -> Completion:
    return Completion(
        text=request.text,
        token_ids=request.output_token_ids,
        finish_reason=str(request.finish_reason),
        prompt_token_ids=list(request.prompt_token_ids),
    )


def _take_delta(request: Request) -> str:
    """New text of a streaming request that can no longer change (not a stop-string prefix, no
    half-decoded UTF-8 character); everything once the request has finished."""
    text, end = request.text, len(request.text)
    if not request.is_finished:
        end -= max((len(s) for s in request.params.stop), default=1) - 1
        while end > request.num_emitted_chars and text[end - 1] == "\ufffd":
            end -= 1
    delta = text[request.num_emitted_chars : max(end, request.num_emitted_chars)]
    request.num_emitted_chars += len(delta)
    return delta
