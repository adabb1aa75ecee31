"""Tool calls in a model's reply: the formats models write them in, parsed whole or as the reply streams.

A reply is content and tool calls, and each format (`Parser`) marks a call its own way:

- `hermes` (Hermes, Qwen 2.5, Qwen3, and this server's default tool prompt): any number of
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, the text around them content;
- `llama3_json` (Llama 3.x): the whole reply is `{"name": ..., "parameters": {...}}` (or `"arguments"`),
  or several separated by `;`, optionally after `<|python_tag|>`;
- `mistral`: content, then `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}` to the end.

A call is valid when its JSON parses, names a function (a string) and holds an object of arguments (finite
numbers only: the arguments are sent on as JSON text). Anything else (broken JSON, another shape, a reply
cut off by max_tokens, nesting deeper than Python's stack) stays content, verbatim: parsing never raises.
The whitespace between content and a valid call is dropped (the model's separator, not part of an answer),
and content is None when a reply holds calls and nothing else.

Streaming (`ToolCallStream`) runs the same scanner over the reply's text deltas, so the streamed content and
calls joined are exactly the whole reply's parse (`parse_tool_calls` is the stream fed once). A call is
emitted whole once it is complete (its closing tag, or the reply's end for the formats without one), in
two deltas shaped as OpenAI streams them: arguments are not streamed piece by piece, because a call whose
JSON turns out broken is content and a delta sent cannot be taken back. Text that may still begin a call
(a marker's first characters, the whitespace before them, an open call) is held back, as
runtime/text.py's `held_back` holds back the start of a stop string.

Not done here: checking names against the request's tools or arguments against their schemas (under
tool_choice `required` or a named function the grammar, tools.py's `forced_call_grammar`, guarantees both;
under `auto` the client sees what the model wrote), and reasoning (`<think>...</think>` is content).
"""

from __future__ import annotations

import json
import random
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from optc.runtime.text import held_back

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_MARKER = "[TOOL_CALLS]"
ID_ALPHABET = string.ascii_letters + string.digits
ID_LENGTH = 24  # OpenAI's: "call_" + 24 letters and digits
MISTRAL_ID_LENGTH = 9  # Mistral's chat templates refuse a history whose tool call ids are not 9 letters and digits


class Parser(StrEnum):
    """A tool-call format, by the name `--tool-call-parser` takes."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text

    def to_openai(self) -> dict[str, Any]:
        """The call as a non-streaming response's `message.tool_calls[i]`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class StreamDelta:
    """What one text delta of a reply adds: content to send ("" for none) and the chunk's `tool_calls`."""

    content: str
    tool_calls: tuple[dict[str, Any], ...]


class ToolCallStream:
    """The content and tool-call deltas of one reply, fed its text deltas in order; `finish()` at its end."""

    def __init__(self, parser: Parser, rng: random.Random | None = None) -> None:
        self.parser = parser
        self.rng = rng  # call ids: None draws them from `secrets`; tests pass a seeded Random
        self.calls: list[ToolCall] = []  # every call emitted so far: any means finish_reason "tool_calls"
        self._scanner = _SCANNERS[parser]()

    def feed(self, text: str) -> StreamDelta:
        return self._deltas(self._scanner.scan(text, is_final=False))

    def finish(self) -> StreamDelta:
        """Everything held back, decided now that the reply has ended."""
        return self._deltas(self._scanner.scan("", is_final=True))

    def _deltas(self, items: list[str | _Call]) -> StreamDelta:
        content, deltas = [], []
        for item in items:
            if isinstance(item, str):
                content.append(item)
                continue
            call = ToolCall(call_id(self.parser, self.rng), item.name, item.arguments)
            index = len(self.calls)
            self.calls.append(call)
            deltas += [{"index": index, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}},
                       {"index": index, "function": {"arguments": call.arguments}}]
        return StreamDelta("".join(content), tuple(deltas))


def parse_tool_calls(text: str, parser: Parser, rng: random.Random | None = None) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's content (None when it holds calls and nothing else) and tool calls."""
    stream = ToolCallStream(parser, rng)
    content = stream.feed(text).content + stream.finish().content
    return (None if stream.calls and not content else content), stream.calls


def call_id(parser: Parser, rng: random.Random | None = None) -> str:
    """A new tool call id: OpenAI's shape, or Mistral's 9 characters (its templates take no other)."""
    choice = rng.choice if rng is not None else secrets.choice
    if parser is Parser.MISTRAL:
        return "".join(choice(ID_ALPHABET) for _ in range(MISTRAL_ID_LENGTH))
    return "call_" + "".join(choice(ID_ALPHABET) for _ in range(ID_LENGTH))


@dataclass(frozen=True)
class _Call:
    name: str
    arguments: str


class _Scanner(ABC):
    """A format's reading of one reply: `scan(text)` appends text and returns what is decided (content
    strings and calls, in order); the rest waits in `buffer`. With `is_final` everything is decided."""

    def __init__(self) -> None:
        self.buffer = ""

    @abstractmethod
    def scan(self, text: str, is_final: bool) -> list[str | _Call]: ...

    def _take_content(self, end: int) -> list[str | _Call]:
        """The buffer's content before `end`, less the whitespace that touches `end` (it may touch a call)."""
        head = self.buffer[:end].rstrip()
        self.buffer = self.buffer[len(head):]
        return [head] if head else []

    def _take_all(self) -> list[str | _Call]:
        rest, self.buffer = self.buffer, ""
        return [rest] if rest else []


class _HermesScanner(_Scanner):
    def __init__(self) -> None:
        super().__init__()
        self.is_after_call = False  # whitespace right after a valid call is dropped
        self.searched_to = 0  # an open call's closing tag is not before this index: each delta is searched once

    def scan(self, text: str, is_final: bool) -> list[str | _Call]:
        self.buffer += text
        items: list[str | _Call] = []
        while self.buffer:
            if self.is_after_call:
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    break
                self.is_after_call = False
            buffer = self.buffer
            start = buffer.find(HERMES_OPEN)
            end = buffer.find(HERMES_CLOSE, max(start + len(HERMES_OPEN), self.searched_to)) if start >= 0 else -1
            if start < 0 and is_final:
                return items + self._take_all()
            if start < 0 or (end < 0 and not is_final):  # a marker may be starting, or a call is open
                items += self._take_content(start if start >= 0 else len(buffer) - held_back(buffer, (HERMES_OPEN,)))
                self.searched_to = max(0, len(self.buffer) - len(HERMES_CLOSE) + 1) if start >= 0 else 0
                return items
            # a JSON string may hold the closing tag (a forced call's grammar allows any string): the call ends
            # at the first closing tag after a valid call; with none, at the first one, once the reply has ended
            call = None
            while end >= 0 and (call := _call_of(_json_value(buffer[start + len(HERMES_OPEN):end]),
                                                 ("arguments",))) is None:
                end = buffer.find(HERMES_CLOSE, end + len(HERMES_CLOSE))
            if call is None and not is_final:  # a later closing tag may still end a valid call
                items += self._take_content(start)
                self.searched_to = max(0, len(self.buffer) - len(HERMES_CLOSE) + 1)
                return items
            if call is None:
                end = buffer.find(HERMES_CLOSE, start + len(HERMES_OPEN))
            body_end = end if end >= 0 else len(buffer)  # at the reply's end, an unclosed call reads to the end
            stop = body_end + len(HERMES_CLOSE) if end >= 0 else body_end
            if call is None:
                call = _call_of(_json_value(buffer[start + len(HERMES_OPEN):body_end]), ("arguments",))
            if call is None:
                items.append(buffer[:stop])
            else:
                head = buffer[:start].rstrip()
                items += [head, call] if head else [call]
                self.is_after_call = True
            self.buffer, self.searched_to = buffer[stop:], 0
        return items


class _Llama3Scanner(_Scanner):
    def __init__(self) -> None:
        super().__init__()
        self.is_content = False  # the reply does not start as a call: all of it is content

    def scan(self, text: str, is_final: bool) -> list[str | _Call]:
        if self.is_content:
            return [text] if text else []
        self.buffer += text
        head = self.buffer.lstrip()
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG):].lstrip()
        elif PYTHON_TAG.startswith(head) and not is_final:
            return []  # empty so far, or the tag's first characters
        if is_final:
            calls = _calls_of_sequence(head) if head.startswith("{") else None
            return calls or self._take_all()
        if not head or head.startswith("{"):
            return []
        self.is_content = True
        return self._take_all()


class _MistralScanner(_Scanner):
    def __init__(self) -> None:
        super().__init__()
        self.is_in_calls = False  # the marker came: the rest is held to the end

    def scan(self, text: str, is_final: bool) -> list[str | _Call]:
        self.buffer += text
        items: list[str | _Call] = []
        if not self.is_in_calls:
            start = self.buffer.find(MISTRAL_MARKER)
            if start < 0:
                if is_final:
                    return self._take_all()
                return self._take_content(len(self.buffer) - held_back(self.buffer, (MISTRAL_MARKER,)))
            items, self.is_in_calls = self._take_content(start), True
        if not is_final:
            return items
        calls = _json_value(self.buffer.lstrip()[len(MISTRAL_MARKER):])
        parsed = [_call_of(c, ("arguments",)) for c in calls] if isinstance(calls, list) and calls else [None]
        if None in parsed:
            return items + self._take_all()
        self.buffer = ""
        return items + parsed


_SCANNERS: dict[Parser, type[_Scanner]] = {
    Parser.HERMES: _HermesScanner, Parser.LLAMA3_JSON: _Llama3Scanner, Parser.MISTRAL: _MistralScanner}


def _json_value(text: str) -> Any:
    """The JSON value `text` holds (whitespace around it allowed), or None: broken JSON, NaN or Infinity."""
    try:
        return json.loads(text, parse_constant=_refuse)
    except (ValueError, RecursionError):  # JSONDecodeError and _refuse's; nesting deeper than Python's stack
        return None


def _calls_of_sequence(text: str) -> list[str | _Call] | None:
    """Llama 3's calls: JSON objects separated by `;` and whitespace, filling `text`; None if it holds other."""
    decoder = json.JSONDecoder(parse_constant=_refuse)
    calls: list[str | _Call] = []
    position = 0
    while position < len(text):
        try:
            value, position = decoder.raw_decode(text, position)
        except (ValueError, RecursionError):
            return None
        call = _call_of(value, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        rest = text[position:].lstrip()
        if rest and not rest.startswith(";"):
            return None
        if rest:
            rest = rest[1:].lstrip()
            if not rest:
                return None  # a separator with no call after it
        position = len(text) - len(rest)
    return calls


def _call_of(value: Any, argument_keys: tuple[str, ...]) -> _Call | None:
    """The call a JSON value is: an object with a string `name` and an object under one of `argument_keys`
    (and nothing else), or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    keys = [k for k in argument_keys if k in value]
    if len(keys) != 1 or set(value) != {"name", keys[0]} or not isinstance(value[keys[0]], dict):
        return None
    try:  # json.loads reads 1e999 as infinity, which has no JSON text
        return _Call(value["name"], json.dumps(value[keys[0]], ensure_ascii=False, allow_nan=False))
    except (ValueError, RecursionError):
        return None


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")
