"""The OpenAI API's request bodies (pydantic) and the error shape, as far as this server supports them.

Every model forbids unknown fields, takes each field only in its JSON type (strict: "0.5", true or 1.0 is not
an integer, "1" is not a number) and no NaN or infinity (JSON's `1e999` parses as infinity); a field the API
has but this server does not implement is an `ApiError` 400 naming the field, never silently ignored
(docs/SERVE.md lists every field). `top_k`, `ignore_eos`, `min_tokens`, `repetition_penalty`, `stop_token_ids`,
`structured_outputs` and `return_token_ids` are extensions (as in vLLM). Stop strings are bounded in number and
length (they are matched on every token), and so is `logit_bias`. Validation errors become 400s in OpenAI's
shape, not FastAPI's 422; so does text with a lone surrogate, which no tokenizer takes. Limits that need the
prompt's length (it and max_tokens must fit in the context), the vocabulary (logit_bias, stop_token_ids), a
grammar's compilation and the seed's range are the engine's, named by its InputError's `field`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from optc.runtime.grammar import GrammarKind, GrammarSpec
from optc.runtime.sampler import SamplingParams

MAX_LOGPROBS = 20
MAX_N = 16  # completions of one request
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop strings: scanned after every token
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_TOP_K = 2**31 - 1  # a bound the sampler's int64 tensors hold (10**30 made the engine step raise)
_TYPES = ("str", "int", "float", "bool", "dict", "list")  # names pydantic puts in a union member's location


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        default = "invalid_request_error" if 400 <= status < 500 else "server_error"
        self.type = type or {401: "authentication_error", 404: "not_found_error",
                             503: "service_unavailable"}.get(status, default)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is enforced either way


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` extension: exactly one of its constraints."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF / EBNF
    json_object: bool | None = None


class _Sampling(_Body):
    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # OpenAI's range; None = OpenAI's default, 1
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)  # extension; 0 or -1 = off; above the vocabulary = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension: generate max_tokens whatever the model says (benchmarks)
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)  # extension (vLLM): 1 = off
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    min_tokens: int = Field(0, ge=0)  # extension: EOS and stop_token_ids banned until this many tokens
    stop_token_ids: list[int] | None = None  # extension: tokens that end the output (kept in it)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # extension (vLLM)
    user: str | None = None  # an end-user id for the caller's own records; it changes nothing

    def check_supported(self) -> None:
        """400 naming the first field set to a value this server does not implement or bounds."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise ApiError(400, "'stop' strings must be non-empty", "stop")
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ApiError(400, f"'stop' takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters",
                           "stop")
        for i, stop in enumerate(stops):
            _check_text(stop, f"stop[{i}]", "stop")
        if self.user is not None:
            _check_text(self.user, "user", "user")
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit() or not -100.0 <= bias <= 100.0:
                raise ApiError(400, f"'logit_bias' maps token ids (integers as strings) to biases in [-100, 100]; "
                               f"got {key!r}: {bias}", "logit_bias")
        if len(self.logit_bias or {}) > MAX_LOGIT_BIAS:
            raise ApiError(400, f"'logit_bias' holds {len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS}",
                           "logit_bias")
        self.grammar()

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> list[SamplingParams]:
        """What the engine runs the request with: one SamplingParams per completion (`n`); a seeded request's
        completion i draws from seed + i (wrapping within the signed 64-bit range). A 400 for values the
        SamplingParams refuses."""
        seeds = [None] * self.n if self.seed is None else [self.seed] + [
            (self.seed + i + (1 << 63)) % (1 << 64) - (1 << 63) for i in range(1, self.n)]
        try:
            return [SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=max(0, self.top_k or 0), top_p=1.0 if self.top_p is None else self.top_p, seed=seed,
                max_tokens=max_tokens, stop=self.stops, ignore_eos=self.ignore_eos, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
                min_tokens=self.min_tokens, stop_token_ids=tuple(self.stop_token_ids or ()), grammar=self.grammar(),
            ) for seed in seeds]
        except ValueError as e:
            raise ApiError(400, str(e), getattr(e, "field", None)) from None

    def grammar(self) -> GrammarSpec | None:
        """The output's grammar: from response_format or structured_outputs (one of them), None for free text."""
        fmt, so = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text" and so is not None:
            raise ApiError(400, "give 'response_format' or 'structured_outputs', not both", "structured_outputs")
        if fmt is not None and fmt.type == "json_object":
            return GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "object"}', "response_format")
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ApiError(400, "'response_format' of type 'json_schema' needs 'json_schema': {'name': ..., "
                               "'schema': {...}}", "response_format")
            return GrammarSpec.json_schema(fmt.json_schema.schema_, "response_format")
        if fmt is not None and fmt.json_schema is not None:
            raise ApiError(400, "'response_format.json_schema' needs 'type': 'json_schema'", "response_format")
        if so is None:
            return None
        given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                   ("grammar", so.grammar), ("json_object", so.json_object)) if v}
        if len(given) != 1:
            raise ApiError(400, "'structured_outputs' takes exactly one of 'json', 'regex', 'choice', 'grammar' and "
                           f"'json_object'; got {sorted(given) or 'none'}", "structured_outputs")
        (kind, value), = given.items()
        if kind == "json":
            if isinstance(value, str):
                return GrammarSpec(GrammarKind.JSON_SCHEMA, value)
            return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(value))
        if kind == "json_object":
            return GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "object"}')
        if kind == "choice":
            return GrammarSpec(GrammarKind.CHOICE, json.dumps(value))
        return GrammarSpec(GrammarKind.REGEX if kind == "regex" else GrammarKind.GRAMMAR, value)

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None
    return_token_ids: bool = False  # extension: the choice also lists prompt_token_ids and token_ids

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1):
            raise ApiError(400, f"'best_of' = {self.best_of} is not supported by this server", "best_of")
        if self.suffix:
            raise ApiError(400, "'suffix' is not supported by this server", "suffix")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            if len(self.prompt) != 1:
                raise ApiError(400, f"'prompt' holds {len(self.prompt)} prompts; this server takes one per "
                               "request", "prompt")
        if isinstance(self.single_prompt, str):
            _check_text(self.single_prompt, "prompt", "prompt")

    @property
    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return prompt[0]
        return prompt


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ContentPart(BaseModel):
    """A part of a message's content as sent: its `type` is read first, so a part of another type (an image,
    audio, a file) is refused by its type, not by the fields a text part would have."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallMessage(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None  # None: an assistant turn of tool calls only
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.text_parts())

    def check(self) -> None:
        """400 for a message whose fields do not fit its role."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ApiError(400, f"a '{self.role}' message needs 'content' (only an assistant's tool calls go "
                           "without)", "messages")
        if self.tool_calls is not None and self.role != "assistant":
            raise ApiError(400, "only assistant messages carry 'tool_calls'", "messages")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ApiError(400, "a 'tool' message needs 'tool_call_id', and only it takes one", "messages")

    def to_dict(self) -> dict[str, Any]:
        """The message as chat templates take it: text content, OpenAI's other fields where given."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
            out["content"] = self.text() if self.content is not None else None
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def text_parts(self) -> list[TextPart]:
        """The content's parts as text parts; a 400 naming the first part of another type (or a malformed
        text part)."""
        if isinstance(self.content, str) or self.content is None:
            return []
        parts = []
        for j, part in enumerate(self.content):
            if part.type != "text":
                raise ApiError(400, f"content part {j} has type {part.type!r}; this server takes text parts only "
                               "({'type': 'text', 'text': ...})", "messages")
            try:
                parts.append(TextPart.model_validate(part.model_dump()))
            except ValidationError as e:
                error = e.errors()[0]
                where = ".".join(str(p) for p in error["loc"])
                raise ApiError(400, f"content part {j} ('text'): '{where}': {error['msg']}", "messages") from None
        return parts


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        _check_messages(self.messages)

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.to_dict() for m in self.messages]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    def check_supported(self) -> None:
        if self.prompt is not None:
            _check_text(self.prompt, "prompt", "prompt")
        _check_messages(self.messages or [])


class LoadLoraRequest(_Body):
    """vLLM's /v1/load_lora_adapter body: a name for requests' `model` and a peft adapter folder."""

    lora_name: str
    lora_path: str


class UnloadLoraRequest(_Body):
    """vLLM's /v1/unload_lora_adapter body (its lora_int_id is not used: names identify adapters)."""

    lora_name: str
    lora_int_id: int | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body; a 400 ApiError naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        # the first bad field's deepest error: for a union (`content`: a string or a list of parts) the member
        # the value came closest to, not the first member tried
        error = max((x for x in errors if x["loc"][:1] == errors[0]["loc"][:1]), key=lambda x: len(x["loc"]))
        param = str(error["loc"][0]) if error["loc"] else None
        # a union's error names the member it tried (`prompt.list[int].0`): the body's path is the rest
        loc = error["loc"]
        first = ".".join([str(p) for p in loc[:1]]
                         + [str(p) for p in loc[1:] if not (isinstance(p, str) and ("[" in p or p in _TYPES))])
        if error["type"] == "extra_forbidden":
            raise ApiError(400, f"'{first}' is not supported by this server", param) from None
        if error["type"] == "missing":
            raise ApiError(400, f"'{first}' is required", param) from None
        raise ApiError(400, f"'{first}': {error['msg']}", param) from None
    if hasattr(parsed, "check_supported"):
        parsed.check_supported()
    return parsed


def _check_messages(messages: list[ChatMessage]) -> None:
    for i, message in enumerate(messages):
        try:
            message.check()
            text = message.text()
        except ApiError as e:
            raise ApiError(400, f"'messages[{i}].content': {e.message}", "messages") from None
        _check_text(text, f"messages[{i}].content", "messages")


def _check_text(text: str, where: str, param: str) -> None:
    """400 naming `param` when `text` holds a lone surrogate (a `\\ud800`-`\\udfff` JSON escape without its
    pair): it has no UTF-8 form, so the tokenizer would raise (a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"'{where}' holds a lone surrogate {text[e.start]!r} at index {e.start}: it is not "
                       "Unicode text (a \\ud800-\\udfff escape needs its pair)", param) from None
