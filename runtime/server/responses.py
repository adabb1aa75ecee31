"""OpenAI response bodies and stream chunks, built from the AsyncEngine's outputs (plain dicts: the
server only writes them as JSON)."""

from __future__ import annotations

import json
import time
from typing import Any

from optc.runtime.server.async_engine import Output, TokenLogprob
from optc.runtime.server.tool_parsers import Parser, StreamDelta, ToolCallStream


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens}


def total_usage(results: list[tuple[str, Output, list, list[int]]]) -> dict[str, int]:
    """The usage of `n` completions (streaming.collect's results): the prompt once, every completion's tokens."""
    return usage(results[0][1].num_prompt_tokens, sum(last.num_output_tokens for _, last, _, _ in results))


def sse(chunk: dict[str, Any] | str) -> str:
    """One server-sent event: `data: {json}` (or `data: [DONE]`) and a blank line."""
    return f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n"


def completion_logprobs(entries: list[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (the top tokens and the
    chosen one, keyed by their text), text_offset (character offsets into the returned text)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        tokens.append(entry.text)
        token_logprobs.append(entry.logprob)
        offsets.append(text_offset)
        text_offset += len(entry.text)
        if entry.logprob is None:  # the first prompt token: nothing before it to condition on
            top_logprobs.append(None)
        else:
            top: dict[str, float] = {}
            for text, _, lp in (*entry.top, (entry.text, entry.token_id, entry.logprob)):
                top.setdefault(text, lp)  # tokens that decode alike: the likeliest one's value
            top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """The chat shape: per token its text, logprob, UTF-8 bytes and its top tokens."""
    def item(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [item(e.text, e.logprob) | {"top_logprobs": [item(t, lp) for t, _, lp in e.top]} for e in entries],
        "refusal": None,
    }


class ResponseIds:
    """The id, creation time and model that every chunk of one response repeats."""

    def __init__(self, prefix: str, request_number: int, model: str) -> None:
        self.id = f"{prefix}-{request_number}-{time.time_ns() % 10**9}"
        self.created = int(time.time())
        self.model = model

    def completion(self, choices: dict[str, Any] | list[dict[str, Any]] | None, usage_: dict[str, int] | None = None,
                   is_chunk: bool = False) -> dict[str, Any]:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": _choices(choices)}
        if usage_ is not None or not is_chunk:
            body["usage"] = usage_
        return body

    def chat(self, choices: dict[str, Any] | list[dict[str, Any]] | None, usage_: dict[str, int] | None = None,
             is_chunk: bool = False) -> dict[str, Any]:
        body = {"id": self.id, "object": "chat.completion.chunk" if is_chunk else "chat.completion",
                "created": self.created, "model": self.model, "choices": _choices(choices)}
        if usage_ is not None or not is_chunk:
            body["usage"] = usage_
        return body


def completion_chunk(ids: ResponseIds, out: Output, prefix: str, with_token_ids: bool) -> dict | None:
    """A stream chunk of a completion (`prefix`: the echoed prompt, on the first); None when it carries nothing."""
    if not (out.text or prefix or out.finish_reason or with_token_ids and out.token_ids):
        return None
    logprobs = completion_logprobs(out.logprobs) if out.logprobs else None
    choice = {"index": out.index, "text": prefix + out.text, "logprobs": logprobs, "finish_reason": out.finish_reason}
    if with_token_ids:
        choice["token_ids"] = out.token_ids
    return ids.completion(choice, is_chunk=True)


def chat_chunk(ids: ResponseIds, out: Output, first: bool, with_logprobs: bool) -> dict | None:
    """A stream chunk of a chat completion (the first names the role); None when it carries nothing."""
    if not (out.text or first or out.finish_reason):
        return None
    delta = {"role": "assistant", "content": out.text} if first else {"content": out.text}
    logprobs = chat_logprobs(out.logprobs) if with_logprobs and out.logprobs else None
    return ids.chat({"index": out.index, "delta": delta, "logprobs": logprobs, "finish_reason": out.finish_reason},
                    is_chunk=True)


def _choices(choices: dict[str, Any] | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A response's choices: one (a stream chunk's) or a list, each with its `index` first."""
    if not choices:
        return []
    return [{"index": 0, **c} for c in (choices if isinstance(choices, list) else [choices])]


class ToolChunks:
    """Stream chunks of a chat completion whose text may hold tool calls (`parser`'s format): each completion's
    text deltas go through its own ToolCallStream, which holds back what may still become a call and emits a
    call whole, shaped as OpenAI streams `tool_calls` deltas; a reply that made calls finishes "tool_calls"."""

    def __init__(self, ids: ResponseIds, parser: Parser, with_logprobs: bool) -> None:
        self.ids, self.parser, self.with_logprobs = ids, parser, with_logprobs
        self._streams: dict[int, ToolCallStream] = {}

    def chunk(self, out: Output, first: bool) -> dict | None:
        stream = self._streams.setdefault(out.index, ToolCallStream(self.parser))
        content, calls = _joined(stream.feed(out.text), stream.finish() if out.finish_reason is not None else None)
        if not (content or calls or first or out.finish_reason):
            return None
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if content or not calls:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = list(calls)
        finish_reason = out.finish_reason
        if finish_reason == "stop" and stream.calls:
            finish_reason = "tool_calls"
        logprobs = chat_logprobs(out.logprobs) if self.with_logprobs and out.logprobs else None
        return self.ids.chat({"index": out.index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": finish_reason}, is_chunk=True)


def _joined(delta: StreamDelta, last: StreamDelta | None) -> tuple[str, tuple[dict, ...]]:
    if last is None:
        return delta.content, delta.tool_calls
    return delta.content + last.content, delta.tool_calls + last.tool_calls
