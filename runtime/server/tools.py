"""Tool calling on the request side: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` validated, the
prompt that shows the tools to the model, and the grammar that forces a call when the request demands one.

- `tool_request(...)` validates the three fields (protocol.ChatCompletionRequest carries them as raw JSON, so
  protocol.py need not import this module): a 400 ApiError naming the field otherwise.
- `tool_prompt(...)` gives what the chat template gets. A template that takes tools (its source names
  `tools`) renders them itself, with the history as OpenAI sends it (`role: "tool"` messages, assistant
  `tool_calls`). For any other template the tools go into a system message (`DEFAULT_TOOL_PROMPT`, merged
  into a first system message) that asks for Hermes's format, and the history is rewritten as text the
  template takes: a call as `<tool_call>` in the assistant's content, tool results as a user turn of
  `<tool_response>`s. Under `tool_choice: "none"` the tools are not shown at all.
- `choose_parser(...)`: the reply's format (tool_parsers.py): Hermes when the default prompt asked for it,
  else the family's (`--tool-call-parser` overrides it).
- `forced_call_grammar(...)`: for `required` (any tool; one call, or one or more unless
  `parallel_tool_calls` is false) and a named function (exactly one call of it), a Lark grammar for
  llguidance that writes the call in the parser's format with each function's arguments under its
  `parameters` schema (`%json`), so the arguments always validate. JSON is written as json.dumps writes it
  (`", "`, `": "`, nothing else between tokens), the spacing chat templates show the model in its history.

Not done here: calling llguidance (the server compiles the grammar and reports a schema it cannot take),
streaming and parsing the reply (tool_parsers.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from optc.runtime.server.protocol import ApiError, _Body, parse
from optc.runtime.server.tool_parsers import HERMES_CLOSE, HERMES_OPEN, MISTRAL_MARKER, Parser

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's
MARKERS = (HERMES_OPEN, HERMES_CLOSE, MISTRAL_MARKER)  # the texts a forced call writes that may be single tokens
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # llguidance x-guidance
PARSERS = {  # an artifact's architecture -> the format its chat template's tools ask for
    "Qwen2ForCausalLM": Parser.HERMES, "Qwen3ForCausalLM": Parser.HERMES, "Qwen3MoeForCausalLM": Parser.HERMES,
    "LlamaForCausalLM": Parser.LLAMA3_JSON,
    "MistralForCausalLM": Parser.MISTRAL, "MixtralForCausalLM": Parser.MISTRAL,
}
DEFAULT_TOOL_PROMPT = """# Tools

You can call functions to help with the user's request. Their signatures, as JSON schemas, are within \
<tools></tools>:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and arguments within <tool_call></tool_call> tags, one \
call per pair of tags:
<tool_call>
{"name": "function_name", "arguments": {"argument_name": "value"}}
</tool_call>
When no function helps, answer directly."""


class FunctionDefinition(_Body):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of type "object"; none = no arguments
    strict: bool | None = None  # accepted; required and named calls are grammar-forced whatever it says


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ToolChoice(Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"  # a {"type": "function", ...} object


# A string or an object, told apart before validation: the tags, "str" and "dict", are names protocol.parse
# leaves out of an error's path, so a bad object reads "'tool_choice.function' is required".
_ToolChoiceField = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")] | Annotated[NamedToolChoice, Tag("dict")],
    Discriminator(lambda v: "dict" if isinstance(v, dict | NamedToolChoice) else "str")]


class ToolRequest(_Body):
    """A chat request's tool-calling fields, validated."""

    tools: list[Tool] | None = None
    tool_choice: _ToolChoiceField | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        names = self.names
        for i, tool in enumerate(self.tools or []):
            name, parameters = tool.function.name, tool.function.parameters
            if name in names[:i]:
                raise ApiError(400, f"'tools[{i}].function.name': {name!r} names two tools", "tools")
            if parameters is not None and parameters.get("type", "object") != "object":
                raise ApiError(400, f"'tools[{i}].function.parameters' of {name!r} must be a JSON schema of type "
                               f"'object', got type {parameters['type']!r}", "tools")
        if self.tool_choice not in (None, "none") and not names:
            raise ApiError(400, "'tool_choice' is only allowed when 'tools' are given", "tool_choice")
        if self.named is not None and self.named not in names:
            raise ApiError(400, f"'tool_choice' names function {self.named!r}, which is not in 'tools' (they are: "
                           f"{', '.join(names)})", "tool_choice")

    @property
    def names(self) -> list[str]:
        return [t.function.name for t in self.tools or []]

    @property
    def choice(self) -> ToolChoice:
        """What tool_choice asks; unset, OpenAI's default: `auto` with tools, `none` without."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return ToolChoice.NAMED
        return ToolChoice(self.tool_choice or ("auto" if self.tools else "none"))

    @property
    def named(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def shown_tools(self) -> list[Tool]:
        """The tools the prompt shows: none under `none`, so the model answers in text."""
        return [] if self.choice is ToolChoice.NONE else list(self.tools or [])


@dataclass(frozen=True)
class ToolPrompt:
    """What to pass to `tokenizer.apply_chat_template(list(messages), tools=tools, add_generation_prompt=True)`."""

    messages: tuple[dict[str, Any], ...]
    tools: list[dict[str, Any]] | None  # None: the template is not to render tools (none shown, or in messages)


def tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolRequest:
    """The request's raw tool fields validated; a 400 ApiError naming the first bad one."""
    return parse(ToolRequest, {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls})


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders tools itself (its source names `tools`)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    sources = template.values() if isinstance(template, Mapping) else [template]
    return any(re.search(r"\btools\b", source) for source in sources)


def choose_parser(architecture: str, takes_tools: bool, override: Parser | None = None) -> Parser:
    """The format of replies: Hermes when the template has no tools (the default prompt asks for it, whatever
    `override` says), else `override` or the family's (Hermes for a family not listed)."""
    if not takes_tools:
        return Parser.HERMES
    return override or PARSERS.get(architecture, Parser.HERMES)


def tool_prompt(tokenizer: Any, messages: Sequence[Mapping[str, Any]], request: ToolRequest) -> ToolPrompt:
    """The chat template's input for OpenAI-shaped `messages` (content as text or None; assistant `tool_calls`
    with `arguments` as JSON text; `role: "tool"` with `tool_call_id`) and the request's tools."""
    tools = [t.model_dump(exclude_none=True) for t in request.shown_tools]
    if template_takes_tools(tokenizer):
        return ToolPrompt(tuple(_for_tool_template(m) for m in messages), tools or None)
    rewritten: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if message["role"] == "tool" and i > 0 and messages[i - 1]["role"] == "tool":
            rewritten[-1]["content"] += "\n" + _tool_response(message)  # one user turn: templates may refuse two
        elif message["role"] == "tool":
            rewritten.append({"role": "user", "content": _tool_response(message)})
        else:
            rewritten.append({k: v for k, v in message.items() if k != "tool_calls"}
                             | {"content": _with_calls_as_text(message)})
    if tools:
        listed = DEFAULT_TOOL_PROMPT.replace("{tools}", "\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if rewritten and rewritten[0]["role"] in ("system", "developer"):
            rewritten[0] = {**rewritten[0], "content": rewritten[0]["content"] + "\n\n" + listed}
        else:
            rewritten.insert(0, {"role": "system", "content": listed})
    return ToolPrompt(tuple(rewritten), None)


def marker_token_ids(tokenizer: Any) -> dict[str, int]:
    """The call markers the tokenizer holds as single added tokens, by text: a grammar must name those by id
    (llguidance takes added tokens as special, not as the text they spell)."""
    added = tokenizer.get_added_vocab()
    return {marker: added[marker] for marker in MARKERS if marker in added}


def forced_call_grammar(request: ToolRequest, parser: Parser, marker_ids: Mapping[str, int] | None = None
                        ) -> str | None:
    """A Lark grammar (llguidance's dialect) for the reply under tool_choice `required` or a named function,
    None under `auto` and `none`. `marker_ids`: `marker_token_ids(tokenizer)`."""
    if request.choice not in (ToolChoice.REQUIRED, ToolChoice.NAMED):
        return None
    tools = [t for t in request.shown_tools if request.named in (None, t.function.name)]
    is_many = request.choice is ToolChoice.REQUIRED and request.parallel_tool_calls is not False
    key = "parameters" if parser is Parser.LLAMA3_JSON else "arguments"
    marker = {m: f"<[{marker_ids[m]}]>" if m in (marker_ids or {}) else json.dumps(m) for m in MARKERS}
    call, separator, before, after = {
        Parser.HERMES: (f'{marker[HERMES_OPEN]} "\\n" function "\\n" {marker[HERMES_CLOSE]}', '"\\n"', "", ""),
        Parser.LLAMA3_JSON: ("function", '"; "', "", ""),
        Parser.MISTRAL: ("function", '", "', f'{marker[MISTRAL_MARKER]} "["', '"]"'),
    }[parser]
    calls = f"call ({separator} call)*" if is_many else "call"
    lines = ["start: " + " ".join(p for p in (before, calls, after) if p), f"call: {call}",
             "function: " + " | ".join(f"function_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        head = json.dumps(f'{{"name": "{tool.function.name}", "{key}": ')  # the name matches FUNCTION_NAME
        lines += [f'function_{i}: {head} arguments_{i} "}}"',
                  f"arguments_{i}: %json {json.dumps(_arguments_schema(tool.function.parameters))}"]
    return "\n".join(lines) + "\n"


def _arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's parameters schema as the root of its own `%json` (so its `$ref`s resolve), an object."""
    return {"type": "object", **(parameters or {}), "x-guidance": JSON_STYLE}


def _for_tool_template(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as templates with tools read it: no None content (Qwen3's tests `'</think>' in content`) and
    arguments as objects where they parse (Llama 3's template writes them with `tojson`)."""
    out = {**message, "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _object_or_text(c["function"])}}
                             for c in message["tool_calls"]]
    return out


def _object_or_text(function: Mapping[str, Any]) -> Any:
    try:
        value = json.loads(function["arguments"])
    except (TypeError, ValueError, RecursionError):  # not JSON text, or nested deeper than Python's stack
        return function["arguments"]
    return value if isinstance(value, dict) else function["arguments"]


def _with_calls_as_text(message: Mapping[str, Any]) -> str:
    """A message's content, and an assistant's calls after it as Hermes's `<tool_call>` blocks."""
    parts = [message.get("content") or ""]
    for c in message.get("tool_calls") or []:
        name, arguments = c["function"]["name"], c["function"]["arguments"]
        parts.append(f'{HERMES_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}\n'
                     f'{HERMES_CLOSE}')
    return "\n".join(p for p in parts if p)


def _tool_response(message: Mapping[str, Any]) -> str:
    return f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
