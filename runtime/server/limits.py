"""What a client may cost the server before its request is parsed: the body's size and how long its headers
and body may take to arrive.

- `BodyLimits` (ASGI middleware) reads a request's whole body before the app sees it: a `Content-Length`
  over `max_body_bytes` is answered 413 at once, without reading the body; a body that grows past it
  (chunked) is answered 413 as soon as it does; a body that has not arrived `timeout_s` after its headers
  is answered 408. The app then reads the buffered body (and later the connection's disconnect) as usual.
- `header_timeout_protocol(timeout_s)`: uvicorn's h11 protocol, closing a connection whose request line
  and headers are not complete `timeout_s` after the connection opened (or, on a kept-alive connection,
  after the next request's first byte) with a 408. uvicorn has no such limit of its own: a client that
  sends one header byte at a time would hold its connection forever.

Both answer in OpenAI's error shape. Nothing here knows the engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MAX_BODY_BYTES = 8 * 2**20  # a 128k-token prompt as token ids is ~1 MiB of JSON
CLIENT_TIMEOUT_S = 30.0


def error_body(status: int, message: str) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return json.dumps({"error": error}).encode()


class BodyLimits:
    def __init__(self, app: Callable, max_body_bytes: int = MAX_BODY_BYTES, timeout_s: float = CLIENT_TIMEOUT_S):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _answer(send, 413, self._too_large(f"{int(length)} bytes"))
            return
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client left: nobody to answer
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_body_bytes:
                        await _answer(send, 413, self._too_large(f"more than {self.max_body_bytes} bytes"))
                        return
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await _answer(send, 408, f"the request body did not arrive within {self.timeout_s:g} s "
                                     f"({size} bytes came)")
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # the disconnect, when it comes

        await self.app(scope, replay, send)

    def _too_large(self, size: str) -> str:
        return f"the request body has {size}; this server takes at most {self.max_body_bytes} (--max-body-bytes)"


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's H11Protocol with a deadline on each request's line and headers (module docstring)."""

    class HeaderTimeoutProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                if self._deadline is None:  # the first byte of the next request on a kept-alive connection
                    self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._deadline = self.loop.call_later(timeout_s, self._cut_off)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _cut_off(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            body = error_body(408, f"the request line and headers did not arrive within {timeout_s:g} s")
            head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
            self.transport.write(head + body)
            self.transport.close()

    return HeaderTimeoutProtocol


async def _answer(send: Send, status: int, message: str) -> None:
    body = error_body(status, message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
