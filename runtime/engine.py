"""Engine: serve a loaded model: schedule requests, hand each step to the model runner, process its
output (append tokens, detokenize, stop).

`Engine.load(path)` loads an artifact (and a speculative draft artifact), sizes one KV budget for
both, and builds the model runner; `generate` runs a list of prompts to completion through the
scheduler (continuous batching) and returns them in input order; `stream` yields text deltas of one
prompt; `add_request`/`step`/`abort` are the pieces a server drives. A prompt becomes a validated
Request in runtime/intake.py. One step = (give decoding requests draft tokens) -> schedule ->
`runner.execute` (block copies, one forward over all scheduled tokens, sampling or verification,
logprobs: runtime/model_runner.py) -> advance computed counts -> append each request's new tokens, each
checked for stops after incremental detokenization (runtime/text.py) -> roll a request's computed count
back over the drafts verification rejected.
The scheduler and KV manager below see only block ids; the runner owns every tensor. No HTTP here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from optc.core.errors import InputError
from optc.core.lora import LoraAdapter
from optc.core.settings import SpeculativeConfig, SpeculativeMethod
from optc.runtime.config import EngineConfig
from optc.runtime.grammar import GrammarCompiler, Matcher
from optc.runtime.intake import Intake, Prompt
from optc.runtime.kv_cache_manager import KVCacheManager
from optc.runtime.kv_sizing import num_kv_blocks
from optc.runtime.lora import LoraNames, UnknownAdapterError
from optc.runtime.model import kv_windows
from optc.runtime.model_runner import ModelRunner
from optc.runtime.outputs import Completion, EngineStats
from optc.runtime.request import FinishReason, Request, RequestStatus
from optc.runtime.sampler import SamplingParams
from optc.runtime.scheduler import Scheduler, SchedulerConfig
from optc.runtime.speculative import Speculator, make_speculator
from optc.runtime.text import find_stop

log = logging.getLogger("optc.engine")


class Engine:
    def __init__(
        self, model: Any, tokenizer: Any, config: EngineConfig | None = None,
        speculative: SpeculativeConfig | None = None, draft_model: Any = None, group: Any = None,
        draft_head: Any = None,
    ) -> None:
        """`draft_model` serves a `draft` speculative config; its KV pool shares the target's budget.
        `draft_head` (runtime/eagle.py's load_eagle_head) serves an `eagle` one.
        `group`: rank 0's TensorParallelGroup (runtime/distributed.py) when `model` is its shard."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        self.device = torch.device(model.device)
        self.max_model_len = min(model.max_position_embeddings, config.max_seq_len or 1 << 62)
        models = [model] if draft_model is None else [model, draft_model]
        # LoRA slots before the KV budget: one computed from free memory leaves them room
        self.loras: LoraNames | None = None
        if config.max_loras:
            if group is not None:
                raise InputError("LoRA adapters run on one rank (tensor parallelism takes none)", "max_loras")
            self.loras = LoraNames(model.enable_lora(config.max_loras, config.max_lora_rank))
        num_blocks = config.num_blocks or num_kv_blocks(models, config, self.max_model_len)
        if group is not None:  # every rank allocates the smallest pool any rank holds
            num_blocks = group.agree_num_blocks(num_blocks)
        # a token in every KV-cache group of every model (a pool block holds a group's layers)
        self._kv_bytes_per_token = sum(m.kv_bytes_per_block(config.block_size) * len(kv_windows(m))
                                       for m in models) / config.block_size
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                         kv_windows(model), config.max_num_batched_tokens)
        self.runner = ModelRunner(model, config, num_blocks, self.max_model_len,
                                  make_speculator(speculative, draft_model, config, num_blocks, self.max_model_len,
                                                  draft_head, model.vocab_size),
                                  group=group, stage_group=group if group and group.pipeline_size > 1 else None)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.kv_manager
        )
        self.vocab_size = model.vocab_size
        self.dtype = model.dtype
        self.cuda_graph_batch_sizes = self.runner.cuda_graph_batch_sizes
        self._eos_token_ids = frozenset(model.eos_token_ids)
        self.intake = Intake(model, tokenizer, config, self.kv_manager, self.max_model_len, self.device)
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
        self._num_steps = 0
        self._forks: dict[str, list[Request]] = {}  # a request's siblings (n > 1), queued once its prompt is computed

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' grammar compiler for this tokenizer (built on first use: about a second)."""
        return self.intake.grammars

    @property
    def speculator(self) -> Speculator | None:
        return self.runner.speculator

    @classmethod
    def load(
        cls, path: str | Path, device: str = "cpu", verify: bool = True,
        speculative: SpeculativeConfig | None = None, chat_template: str | None = None, **overrides: Any,
    ) -> Engine:
        """Load an artifact; `overrides` are EngineConfig fields that replace the manifest's (e.g.
        `tensor_parallel_size=N`: rank 0 of N, which starts the others; `close()` stops them; under
        torchrun every N, 1 included, joins torchrun's group; `pipeline_parallel_size=P`: P stages of N
        ranks each, rank 0 the first stage's first);
        `speculative` replaces the manifest's runtime.speculative (a draft artifact loads here too);
        `chat_template` (Jinja text) replaces the tokenizer's, or gives a base model one."""
        from transformers import AutoTokenizer

        from optc.core.artifact import read
        from optc.runtime.distributed import launched_by_torchrun, start
        from optc.runtime.eagle import load_eagle_head
        from optc.runtime.loader import load_model
        from optc.runtime.speculative import load_draft

        artifact = read(path, verify=verify, device=device)
        config = EngineConfig.from_manifest(artifact.manifest, **overrides)
        tokenizer = AutoTokenizer.from_pretrained(artifact.tokenizer_dir)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        distributed = config.tensor_parallel_size * config.pipeline_parallel_size > 1 or launched_by_torchrun()
        group = start(config, artifact, device, verify) if distributed else None
        try:
            refs = config.use_references
            model = (group.load_model(artifact, device, refs) if group
                     else load_model(artifact, device, use_references=refs))
            speculative = speculative or (SpeculativeConfig.parse(config.speculative) if config.speculative else None)
            draft_model = (load_draft(speculative, artifact, model, tokenizer, verify)
                           if speculative is not None and speculative.draft is not None else None)
            draft_head = (load_eagle_head(artifact, model)
                          if speculative is not None and speculative.method is SpeculativeMethod.EAGLE else None)
            return cls(model, tokenizer, config, speculative, draft_model, group, draft_head)
        except BaseException:
            group and group.close()
            raise

    # -- public API -------------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False, loras: Sequence[str | None] | None = None,
    ) -> list[Completion]:
        """Run every prompt to completion, batched; completions in input order. `loras[i]`: prompt i's adapter
        name (None: the base model)."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InputError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        requests = [self.intake.request(p, sp, chat) for p, sp in zip(prompts, params, strict=True)]
        for request, lora in zip(requests, loras or [None] * len(requests), strict=True):
            self._set_lora(request, lora)
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
        request = self.intake.request(prompt, params or SamplingParams(), chat)
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
        request_id: str | None = None, matcher: Matcher | None = None, lora: str | None = None,
    ) -> Request:
        """Validate, tokenize and queue one prompt (InputError if it can never be served: empty, not
        Unicode, outside the vocabulary, or it and max_tokens longer than the context, or a grammar that does
        not compile; UnknownAdapterError for a `lora` adapter name not loaded). `matcher`: params.grammar's,
        compiled already (the server compiles off this thread)."""
        request = self.intake.request(prompt, params or SamplingParams(), chat, request_id, matcher)
        self._set_lora(request, lora)
        self._add(request)
        return request

    def load_lora(self, name: str, path: str | Path) -> LoraAdapter:
        """Load the peft adapter in folder `path` under `name` into a free slot (AdapterError naming the file and
        tensor when it does not fit this model; InputError without LoRA slots, or when they are all held)."""
        if self.loras is None:
            raise InputError("this engine has no LoRA slots: start it with max_loras >= 1 (--max-loras)", "lora_name")
        return self.loras.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Unload adapter `name`: no request may name it from now on, and its slot is freed once the requests
        running under it finish (UnknownAdapterError when it is not loaded)."""
        if self.loras is None:
            raise UnknownAdapterError(f"the model {name!r} does not exist (no adapters are loaded)", "lora_name")
        self.loras.unload(name)
        self._release_loras()

    def lora_names(self) -> list[str]:
        """The adapters requests may name now."""
        return [] if self.loras is None else self.loras.names()

    def add_requests(
        self, prompt: Prompt, params: Sequence[SamplingParams], request_ids: Sequence[str],
        matcher: Matcher | None = None, lora: str | None = None,
    ) -> list[Request]:
        """Several completions of one prompt (OpenAI's `n`), one per params: the first is queued now, the others
        once its prompt's K/V is computed, so that they find its full blocks in the prefix cache instead of
        computing them again. All are validated before any is queued."""
        requests = [self.intake.request(prompt, p, False, i, matcher and matcher.copy())
                    for p, i in zip(params, request_ids, strict=True)]
        for request in requests:
            self._set_lora(request, lora)
        self._add(requests[0])
        if len(requests) > 1:
            self._forks[requests[0].request_id] = requests[1:]
        return requests

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished."""
        for forks in self._forks.values():  # a sibling not queued yet
            for fork in forks:
                if fork.request_id == request_id:
                    forks.remove(fork)
                    fork.status, fork.finish_reason = RequestStatus.FINISHED, FinishReason.ABORT
                    return True
        if self.speculator is not None:
            self.speculator.release(request_id)
        aborted = self.scheduler.abort(request_id) is not None
        self._queue_forks(request_id)
        self._release_loras()
        return aborted

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (with one rank: nothing); the engine steps no more."""
        if self.runner.group is not None:
            self.runner.group.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or any(self._forks.values())

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
        num_drafts = [len(r.draft_token_ids) for r in out.requests]
        result = self.runner.execute(out)
        self.scheduler.update(out)
        self._num_steps += 1
        for request in out.requests if self._forks else ():
            if request.num_computed_tokens >= request.num_prompt_tokens:
                self._queue_forks(request.request_id)
        now = time.perf_counter()
        for request in [out.requests[b] for b in result.ready if out.requests[b].params.max_tokens == 0]:
            request.finish_time = now  # max_tokens 0: the prompt is scored, nothing is generated
            self.scheduler.finish(request.request_id, FinishReason.LENGTH)
        for b, token_ids in result.token_ids.items():
            request = out.requests[b]
            for i, token_id in enumerate(token_ids):  # stops apply to every token: nothing after one
                if b in result.logprobs:
                    request.logprobs.append(result.logprobs[b][i])
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
        if self.loras is not None and self.loras.unloading:
            self._release_loras()
        return [out.requests[b] for b in result.ready]

    def stats(self) -> EngineStats:
        kv, scheduler = self.kv_manager, self.scheduler
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_kv_blocks=kv.num_blocks - 1,
            num_kv_blocks_used=kv.num_used_blocks,
            num_kv_blocks_free=kv.num_free_blocks,
            kv_usage=kv.num_used_blocks / (kv.num_blocks - 1),
            kv_bytes_per_token=self._kv_bytes_per_token,
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

    def _set_lora(self, request: Request, name: str | None) -> None:
        if name is None:
            return
        if self.loras is None:
            raise UnknownAdapterError(f"the model {name!r} does not exist (no adapters are loaded)", "model")
        self.loras.assign(request, name)

    def _release_loras(self) -> None:
        """Free the slots of adapters being unloaded whose requests have finished."""
        if self.loras is None or not self.loras.unloading:
            return
        self.loras.release([*self.scheduler.running, *self.scheduler.waiting,
                            *(f for fs in self._forks.values() for f in fs)])

    def _queue_forks(self, request_id: str) -> None:
        for fork in self._forks.pop(request_id, ()):
            self._add(fork)

    def _add(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self._num_prompt_tokens += request.num_prompt_tokens

    def _check_stop(self, request: Request, now: float) -> None:
        params, token_id = request.params, request.token_ids[-1]
        reason = None
        if token_id in self._eos_token_ids and not params.ignore_eos or token_id in params.stop_token_ids:
            reason = FinishReason.STOP
        elif request.matcher is not None and not request.matcher.consume(token_id):
            log.warning("request %s: token %d is outside its grammar (%s); it stops here", request.request_id,
                        token_id, request.matcher.error)
            reason = FinishReason.STOP
        elif request.matcher is not None and request.matcher.is_complete:
            reason = FinishReason.STOP  # the grammar allows nothing more
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
    return Completion(text=request.text, token_ids=request.output_token_ids,
                      finish_reason=str(request.finish_reason), prompt_token_ids=list(request.prompt_token_ids))
