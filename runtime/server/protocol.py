"""The OpenAI API's request bodies (pydantic) and the error shape, as far as this server supports them.

Every model forbids unknown fields, takes each field only in its JSON type (strict: "0.5", true or 1.0 is not
an integer, "1" is not a number) and no NaN or infinity (JSON's `1e999` parses as infinity), and fields the
API has but this server does not implement are
accepted only at their neutral value (`n` 1, penalties 0, no tools, a text response format): any
other value is an `ApiError` 400 naming the field, never silently ignored. `top_k`, `ignore_eos` and
`return_token_ids` are extensions (as in vLLM). Validation errors become 400s in OpenAI's shape, not FastAPI's 422;
so does text with a lone surrogate, which no tokenizer takes. Limits that need the prompt's length (it and
max_tokens must fit in the context) and the seed's range are the engine's, named by its InputError's `field`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_LOGPROBS = 20
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
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the caller's own records; it changes nothing

    def check_supported(self) -> None:
        """400 naming the first field set to a value this server does not implement."""
        unsupported = {
            "n": self.n != 1,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "logit_bias": bool(self.logit_bias),
        }
        for name, is_set in unsupported.items():
            if is_set:
                raise ApiError(400, f"'{name}' = {getattr(self, name)!r} is not supported by this server", name)
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise ApiError(400, "'stop' strings must be non-empty", "stop")
        for i, stop in enumerate(stops):
            _check_text(stop, f"stop[{i}]", "stop")
        if self.user is not None:
            _check_text(self.user, "user", "user")

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


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.text_parts())

    def text_parts(self) -> list[TextPart]:
        """The content's parts as text parts; a 400 naming the first part of another type (or a malformed
        text part)."""
        if isinstance(self.content, str):
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


class ResponseFormat(_Body):
    type: str


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.response_format is not None and self.response_format.type != "text":
            raise ApiError(400, f"'response_format' of type {self.response_format.type!r} is not supported "
                           "(only 'text')", "response_format")
        for name in ("tools", "tool_choice"):
            if getattr(self, name) not in (None, [], "none"):
                raise ApiError(400, f"'{name}' is not supported by this server (no tool calling)", name)
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        _check_messages(self.messages)

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    def check_supported(self) -> None:
        if self.prompt is not None:
            _check_text(self.prompt, "prompt", "prompt")
        _check_messages(self.messages or [])


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
