"""A request's outputs as the HTTP response reads them, until the client leaves: collected whole (`collect`, one
result per completion) or streamed as server-sent events (`stream`). A client that disconnects stops the
iteration, which aborts its request before the engine's next step; an engine failure once a stream has started
is reported inside the stream (its response status was sent already)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from optc.runtime.server import responses as r
from optc.runtime.server.async_engine import EngineFailed, Output
from optc.runtime.server.protocol import ApiError

log = logging.getLogger("optc.serve")


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def items(request: Request, outputs: AsyncIterator[Output]) -> AsyncIterator[Output]:
    """The outputs until the last; stops early (aborting the request) when the client disconnects."""
    watcher = asyncio.ensure_future(until_disconnect(request))
    try:
        while True:
            step = asyncio.ensure_future(anext(outputs))
            await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                return
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        watcher.cancel()
        await outputs.aclose()


async def collect(request: Request, outputs: AsyncIterator[Output],
                   n: int) -> list[tuple[str, Output, list, list[int]]] | None:
    """Per completion (by index): text, the finishing output, token logprobs and token ids; None if the client
    left before all finished."""
    texts: list[list[str]] = [[] for _ in range(n)]
    entries: list[list] = [[] for _ in range(n)]
    token_ids: list[list[int]] = [[] for _ in range(n)]
    last: list[Output | None] = [None] * n
    async for out in items(request, outputs):
        texts[out.index].append(out.text)
        entries[out.index].extend(out.logprobs)
        token_ids[out.index].extend(out.token_ids)
        if out.finish_reason is not None:
            last[out.index] = out
    if any(x is None for x in last):
        return None
    return [("".join(t), x, e, i) for t, x, e, i in zip(texts, last, entries, token_ids, strict=True)]


def stream(request: Request, outputs: AsyncIterator[Output], body: Any,
            chunk: Callable[[Output, bool], dict | None], wrap: Callable[..., dict]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        started: set[int] = set()  # completions whose first chunk went out
        last: dict[int, Output] = {}
        try:
            async for out in items(request, outputs):
                event = chunk(out, out.index not in started)
                if event is not None:
                    started.add(out.index)
                    yield r.sse(event)
                if out.finish_reason is not None:
                    last[out.index] = out
        except EngineFailed as e:  # the response has started: report in the stream
            yield r.sse(ApiError(500, str(e)).body())
            return
        except Exception:  # the response has started: report in the stream, keep internals in the log
            log.exception("a streaming request failed")
            yield r.sse(ApiError(500, "internal server error").body())
            return
        if len(last) < body.n:
            return
        if body.include_usage:
            usage = r.usage(last[0].num_prompt_tokens, sum(out.num_output_tokens for out in last.values()))
            yield r.sse(wrap(None, usage, is_chunk=True))
        yield r.sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
