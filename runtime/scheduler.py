"""Scheduler: which requests run in the next model step, and how many tokens each.

Scheduling model. Every request has tokens (prompt, then output) and a number of them whose K/V are
computed; a step moves each scheduled request's computed count towards its token count, by at most
what is left of one per-step token budget (`max_num_batched_tokens`). There are no separate prefill
and decode phases: a prompt longer than the budget is prefilled in chunks over several steps, a
decode is a request one token behind, and a request's speculative draft tokens
(`Request.draft_token_ids`, after its tokens) are simply more tokens to catch up on: the budget or a
full KV pool trims them (drafts go before any preemption), and the engine rolls the computed count
back over the ones verification rejects. Only blocks of verified tokens enter the prefix cache. Each
step first serves the running requests in arrival order, so decodes and unfinished chunked prefills
are never starved by new prompts; then, with whatever budget is left and while fewer than
`max_num_seqs` requests run, admits waiting requests strictly first-come-first-served (the head of
the queue blocks the ones behind it), each starting after its prefix-cache hit. When a running
request cannot get blocks, the most recently admitted running request is preempted by recompute: its
blocks are freed, its computed count drops to 0, and it returns to the front of the waiting queue
with its tokens (prompt and output so far) to be prefilled again later; a step that preempted admits
nobody. The scheduler sees requests and block ids, never tensors; the model runner runs the step
(copying the output's `block_copies` first) and samples for requests whose computed count reaches
their token count; the engine then calls `update`, and `finish` for those that stop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from optc.core.errors import InputError
from optc.runtime.kv_cache_manager import KVCacheManager
from optc.runtime.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise InputError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise InputError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per scheduled request
    block_ids: list[list[int]] = field(default_factory=list)  # per request: all its blocks, group after group
    preempted_ids: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination): before the step

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.num_preemptions = 0
        self.num_computed_tokens = 0  # tokens run through the model, recomputation included
        self.num_computed_prompt_tokens = 0  # of those, tokens at prompt positions

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens + len(request.draft_token_ids) - request.num_computed_tokens, budget)
            block_ids = self.kv_manager.allocate_slots(request, num_new)
            if block_ids is None and request.draft_token_ids:  # drop the drafts before preempting anyone
                request.draft_token_ids.clear()
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                block_ids = self.kv_manager.allocate_slots(request, num_new)
            while block_ids is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
                block_ids = self.kv_manager.allocate_slots(request, num_new)
            if block_ids is None:
                break
            del request.draft_token_ids[max(0, request.num_computed_tokens + num_new - request.num_tokens) :]
            self._add(out, request, num_new, block_ids)
            budget -= num_new
            i += 1
        while (
            not out.preempted_ids and self.waiting and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            hit_ids, num_hit = self.kv_manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            block_ids = self.kv_manager.allocate_slots(request, num_new, hit_ids)
            if block_ids is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            request.num_cached_tokens = num_hit
            self.running.append(request)
            self._add(out, request, num_new, block_ids)
            budget -= num_new
        out.block_copies = self.kv_manager.take_copies()
        return out

    def update(self, out: SchedulerOutput) -> None:
        """The step ran: advance computed counts and cache the blocks that became full."""
        for request, num_new in zip(out.requests, out.num_new_tokens, strict=True):
            start = request.num_computed_tokens
            request.num_computed_tokens = start + num_new
            self.num_computed_tokens += num_new
            self.num_computed_prompt_tokens += max(0, min(start + num_new, request.num_prompt_tokens) - start)
            # drafts are not in token_ids: only verified tokens are hashed and cached
            self.kv_manager.cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request (stop, length or abort) and free its blocks; None if it is not here."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        return request

    def abort(self, request_id: str) -> Request | None:
        return self.finish(request_id, FinishReason.ABORT)

    def _add(self, out: SchedulerOutput, request: Request, num_new: int, block_ids: list[int]) -> None:
        out.requests.append(request)
        out.num_new_tokens.append(num_new)
        out.block_ids.append(block_ids)

    def _preempt(self, request: Request) -> None:
        self.kv_manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.draft_token_ids.clear()
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
