"""AsyncEngine: the synchronous Engine behind an asyncio front, for the HTTP server.

One engine thread owns the Engine: it loads it, drains a thread-safe queue of commands (add a
request, abort one, run a function such as tokenization), steps the engine while requests are
unfinished and hands each request's outputs to that request's asyncio queue with
`loop.call_soon_threadsafe`. HTTP handlers only put commands and await their queue, so they never
block a step, and every request in flight is batched into the same steps (continuous batching).
Nothing here knows HTTP; the engine knows nothing of asyncio.

Prompts are tokenized (chat templates applied) and grammars compiled on a preparation thread with its own
copy of the tokenizer, never on the engine thread: a prompt of megabytes delays only itself. A request of
`n` completions is `n` engine requests over one prompt (runtime/engine.py's add_requests), answering into
one queue, each Output tagged with its completion's `index`.

A streaming request gets an `Output` after every step that gave it a token (new stable text, new
token ids and logprobs); any other request gets one `Output` when it finishes. The first item of a
queue is the request's `Accepted` (or the error that rejected it), so a handler can answer 400 before
it starts a response.

A step that raises fails the requests in flight with an `EngineFailed` naming the error (the server
answers them 500 with it), frees their KV blocks, and the engine serves on. A second failed step within
`failure_window_s` of the first means the engine is likely to keep failing: the thread fails every
request, calls `on_fatal(EngineFailedRepeatedly)` on the loop (the server exits with it, status 1) and
stops, rather than fail every request from then on. A tensor-parallel rank that died or hung
(TensorParallelError) is fatal at once: the engine can never step again. The thread closes the engine
when it ends, which stops the other ranks.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from optc.runtime.distributed import TensorParallelError
from optc.runtime.engine import Engine, EngineStats
from optc.runtime.grammar import Matcher
from optc.runtime.request import Request
from optc.runtime.sampler import Logprobs, SamplingParams
from optc.runtime.server.metrics import Metrics
from optc.runtime.server.tools import ToolRequest, tool_prompt
from optc.runtime.text import chat_token_ids, prompt_token_ids

log = logging.getLogger("optc.serve")
FAILURE_WINDOW_S = 60.0  # a second failed step this soon after the first stops the server

Prompt = str | list[int] | list[dict[str, Any]]  # text, token ids, or chat messages


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages (OpenAI's shape, content as text) and the request's tools (tools.py's ToolRequest)."""

    messages: list[dict[str, Any]]
    tools: ToolRequest | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One token's logprob with its text, and the most likely tokens (text, token id, logprob)."""

    text: str
    token_id: int
    logprob: float | None  # None for the first prompt token (nothing before it)
    top: tuple[tuple[str, int, float], ...]


@dataclass(frozen=True)
class Accepted:
    prompt_token_ids: list[int]


@dataclass(frozen=True)
class Output:
    text: str  # new stable text (streaming) or the whole text (at the finish of any other request)
    token_ids: list[int]  # new output tokens
    logprobs: list[TokenLogprob]  # of those tokens, when asked for
    finish_reason: str | None  # None while running
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_logprobs: list[TokenLogprob] | None = None  # with the finishing output, when asked for
    index: int = 0  # which of the request's n completions


class EngineFailed(Exception):
    """A step raised: the requests in flight are aborted and answered 500 with this message."""

    @staticmethod
    def of(error: BaseException) -> EngineFailed:
        first = str(error).splitlines()[0] if str(error) else ""
        return EngineFailed(f"the engine step failed ({type(error).__name__}: {first}); the requests in flight "
                            "were aborted")


class EngineFailedRepeatedly(RuntimeError):
    """Two steps failed within the failure window: the server stops (exit 1) rather than keep failing."""


@dataclass
class _Stream:
    request: Request
    queue: asyncio.Queue
    arrival_time: float
    is_streaming: bool
    index: int = 0
    last_token_time: float | None = None
    num_sent_tokens: int = 0


class AsyncEngine:
    def __init__(self, load: Callable[[], Engine], loop: asyncio.AbstractEventLoop, metrics: Metrics,
                 on_fatal: Callable[[BaseException], None] = lambda error: None,
                 failure_window_s: float = FAILURE_WINDOW_S) -> None:
        self._load = load
        self._failure_window_s = failure_window_s
        self._last_failure: float | None = None  # perf_counter of the last failed step
        self._loop = loop
        self._on_fatal = on_fatal
        self.metrics = metrics
        metrics.bind(lambda: self.stats)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._is_stopping = False
        self.engine: Engine | None = None  # set by the engine thread once loaded
        self.ready = asyncio.Event()  # set (on the loop) once the engine is loaded
        self.load_error: BaseException | None = None
        self.stats: EngineStats | None = None  # the latest snapshot, replaced after every step
        self.num_in_flight = 0  # requests added and not yet finished (event-loop side)
        self._next_id = 0
        self._thread = threading.Thread(target=self._run, name="optc-engine", daemon=True)
        self._preparer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="optc-prepare")
        self._tokenizer: Any = None  # the preparation thread's copy of the engine's tokenizer

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._is_stopping = True
        self._wake.set()
        self._thread.join(timeout)
        self._preparer.shutdown(wait=False, cancel_futures=True)

    # -- event-loop side --------------------------------------------------------------------------

    async def generate(
        self, prompt: Prompt | ChatPrompt, params: Sequence[SamplingParams], is_streaming: bool, arrival_time: float,
        lora: str | None = None,
    ) -> AsyncIterator[Accepted | Output]:
        """(Under LoRA adapter `lora`) Accepted, then Outputs (of `len(params)` completions, by index) until each
        has had a finish_reason.
        Raises the engine's ValueError / UserError for a prompt it cannot serve. Closing the iterator early
        aborts every completion."""
        request_ids = [f"req-{self._next_id}-{i}" for i in range(len(params))]
        self._next_id += 1
        results: asyncio.Queue = asyncio.Queue()
        self.num_in_flight += 1
        num_finished, is_finished = 0, False
        try:
            prompt_ids, matcher = await self.prepare(lambda tokenizer: self._prepare(tokenizer, prompt, params[0]))
            self._send(("add", request_ids, prompt_ids, list(params), matcher, is_streaming, arrival_time, results,
                        lora))
            while True:
                item = await results.get()
                if isinstance(item, BaseException):
                    is_finished = True
                    raise item
                yield item
                if isinstance(item, Output) and item.finish_reason is not None:
                    num_finished += 1
                    if num_finished == len(params):
                        is_finished = True
                        return
        finally:
            self.num_in_flight -= 1
            if not is_finished:
                for request_id in request_ids:
                    self.abort(request_id)

    async def prepare(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(tokenizer) on the preparation thread (its own copy of the tokenizer: not the engine's)."""
        return await self._loop.run_in_executor(self._preparer, fn, self._tokenizer)

    def _prepare(self, tokenizer: Any, prompt: Prompt | ChatPrompt,
                 params: SamplingParams) -> tuple[list[int], Matcher | None]:
        matcher = self.engine.grammars.matcher(params.grammar) if params.grammar is not None else None
        return prompt_ids_of(tokenizer, prompt), matcher

    async def render_metrics(self) -> bytes:
        """The Prometheus exposition of /metrics."""
        return self.metrics.render()

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine thread (the tokenizer and the engine are not thread-safe)."""
        future = self._loop.create_future()
        self._send(("call", fn, future))
        return await future

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._load()
            self._tokenizer = copy.deepcopy(engine.tokenizer)
            if engine.tokenizer is not None:
                engine.grammars  # noqa: B018 -- built here, once (about a second), not in a first request
            self.stats = engine.stats()
            self.engine = engine
        except BaseException as e:  # reported by the server, which exits
            self.load_error = e
            self._loop.call_soon_threadsafe(self.ready.set)
            return
        self._loop.call_soon_threadsafe(self.ready.set)
        try:
            self._serve(self.engine)
        finally:
            self.engine.close()

    def _serve(self, engine: Engine) -> None:
        while not self._is_stopping:
            if not engine.has_unfinished():
                self._wake.wait()
            self._wake.clear()
            self._drain(engine)
            if not engine.has_unfinished():
                self.stats = engine.stats()  # aborts may have emptied the engine: no step will follow
                continue
            try:
                stepped = engine.step()
            except TensorParallelError as e:  # no later step can succeed: the server exits with it
                log.error("%s", e)
                self._fail_all(engine, EngineFailed(str(e)))
                self._loop.call_soon_threadsafe(self._on_fatal, e)
                return
            except Exception as e:
                log.exception("engine step failed; aborting the requests in flight")
                self._fail_all(engine, EngineFailed.of(e))
                now = time.perf_counter()
                if self._last_failure is not None and now - self._last_failure <= self._failure_window_s:
                    fatal = EngineFailedRepeatedly(
                        f"a second engine step failed {now - self._last_failure:.1f} s after the first (window: "
                        f"{self._failure_window_s:g} s): {type(e).__name__}: {e}; stopping the server")
                    fatal.__cause__ = e
                    log.error("%s", fatal)
                    self._loop.call_soon_threadsafe(self._on_fatal, fatal)
                    return
                self._last_failure = now
                self.stats = engine.stats()
                continue
            now = time.perf_counter()
            for request in stepped:
                stream = self._streams.get(request.request_id)
                if stream is not None:
                    self._emit(engine, stream, now)
            self.stats = engine.stats()
        self._fail_all(engine, EngineFailed("the server stopped"))

    def _drain(self, engine: Engine) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                self._add(engine, *command[1:])
            elif kind == "abort":
                stream = self._streams.pop(command[1], None)
                if stream is not None and engine.abort(command[1]):
                    self.metrics.observe_finish(stream.request, "abort", stream.arrival_time, time.perf_counter())
            else:
                _, fn, future = command
                try:
                    result, error = fn(engine), None
                except Exception as e:
                    result, error = None, e
                self._loop.call_soon_threadsafe(_resolve, future, result, error)

    def _add(self, engine: Engine, request_ids: list[str], prompt_ids: list[int], params: list[SamplingParams],
             matcher: Matcher | None, is_streaming: bool, arrival_time: float, results: asyncio.Queue,
             lora: str | None = None) -> None:
        try:
            requests = engine.add_requests(prompt_ids, params, request_ids, matcher, lora)
        except Exception as e:  # ValueError / UserError: the handler answers 400; anything else 500
            self._put(results, e)
            return
        for index, request in enumerate(requests):
            self._streams[request.request_id] = _Stream(request, results, arrival_time, is_streaming, index)
        self._put(results, Accepted(list(prompt_ids)))

    def _emit(self, engine: Engine, stream: _Stream, now: float) -> None:
        request = stream.request
        num_tokens = request.num_output_tokens
        if num_tokens > stream.num_sent_tokens:
            if stream.last_token_time is None:
                self.metrics.observe_first_token(now - stream.arrival_time)
            else:
                self.metrics.observe_inter_token(now - stream.last_token_time)
            stream.last_token_time = now
        finished = request.finish_reason is not None
        if not (stream.is_streaming or finished):
            return
        start = stream.num_sent_tokens if stream.is_streaming else 0
        text = request.take_delta() if stream.is_streaming else request.text
        token_ids = request.output_token_ids[start:]
        stream.num_sent_tokens = num_tokens
        prompt_logprobs = None
        if finished:
            self._streams.pop(request.request_id, None)
            self.metrics.observe_finish(request, str(request.finish_reason), stream.arrival_time, now)
            if request.params.prompt_logprobs is not None:
                first = request.prompt_token_ids[0]
                prompt_logprobs = [TokenLogprob(token_text(engine, first), first, None, ())]
                prompt_logprobs += [_token_logprob(engine, e) for e in request.prompt_logprobs[1:]]
        logprobs = [_token_logprob(engine, e) for e in request.logprobs[start:]]
        self._put(stream.queue, Output(
            text, token_ids, logprobs, str(request.finish_reason) if finished else None,
            request.num_prompt_tokens, num_tokens, prompt_logprobs, stream.index,
        ))

    def _fail_all(self, engine: Engine, error: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            engine.abort(request_id)
            self._put(stream.queue, error)
        self._streams.clear()

    def _put(self, results: asyncio.Queue, item: Any) -> None:
        self._loop.call_soon_threadsafe(results.put_nowait, item)


def prompt_ids_of(tokenizer: Any, prompt: Prompt | ChatPrompt) -> list[int]:
    """A prompt's token ids: chat messages through the chat template (with the tools' prompt), text through the
    tokenizer, ids as they are."""
    if isinstance(prompt, ChatPrompt) and prompt.tools is not None:
        shown = tool_prompt(tokenizer, prompt.messages, prompt.tools)
        return chat_token_ids(tokenizer, shown.messages, **({"tools": shown.tools} if shown.tools else {}))
    if isinstance(prompt, ChatPrompt):
        return chat_token_ids(tokenizer, prompt.messages)
    return prompt_token_ids(tokenizer, prompt)


def token_text(engine: Engine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id]) if engine.tokenizer is not None else str(token_id)


def _token_logprob(engine: Engine, entry: Logprobs) -> TokenLogprob:
    top = tuple((token_text(engine, t), t, lp) for t, lp in entry.top)
    return TokenLogprob(token_text(engine, entry.token_id), entry.token_id, entry.logprob, top)


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)

