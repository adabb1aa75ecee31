"""What the routes of the `optc serve` app (runtime/server/app.py) share: the server's settings
(`ServerConfig`) and its state (`ServerState`): the AsyncEngine once it has loaded, whether the server is
draining, and how many requests it took. `ServerState.start` admits a request: a 503 while loading or
draining and when `max_num_seqs + max_waiting` requests are in flight, a 404 for a model name that is
neither the served model's nor a loaded adapter's, and a 400 naming the body's field for a request the
engine refuses. No routes here.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from optc.core.errors import UserError
from optc.runtime.engine import Engine
from optc.runtime.lora import UnknownAdapterError
from optc.runtime.sampler import SamplingParams
from optc.runtime.server.async_engine import FAILURE_WINDOW_S, Accepted, AsyncEngine, ChatPrompt, Output, Prompt
from optc.runtime.server.limits import CLIENT_TIMEOUT_S, MAX_BODY_BYTES
from optc.runtime.server.metrics import Metrics
from optc.runtime.server.protocol import ApiError
from optc.runtime.server.tool_parsers import Parser


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_waiting: int = 1024  # requests waiting beyond the running batch before 503
    allowed_origins: tuple[str, ...] = ()  # CORS; none = same-origin only
    log_requests: bool = False  # log request bodies (never by default)
    max_body_bytes: int = MAX_BODY_BYTES  # a larger request body is a 413, answered before it is read
    client_timeout_s: float = CLIENT_TIMEOUT_S  # a body slower than this is a 408 (headers: header_timeout_protocol)
    failure_window_s: float = FAILURE_WINDOW_S  # a second failed engine step within it stops the server
    tool_call_parser: Parser | None = None  # None: the model family's (runtime/server/tools.py)


class ServerState:
    def __init__(self, config: ServerConfig, load: Callable[[], Engine], on_loaded: Callable[[AsyncEngine], None],
                 on_fatal: Callable[[BaseException], None]):
        self.config = config
        self.load = load
        self.on_loaded = on_loaded
        self.on_fatal = on_fatal
        self.metrics = Metrics(config.model_name)
        self.engine: AsyncEngine | None = None
        self.is_draining = False
        self.num_requests = 0

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.engine is not None and self.engine.ready.is_set()

    def loaded_engine(self) -> Engine:
        """The Engine, once loaded; a 503 while it loads."""
        if not self.is_ready:
            raise ApiError(503, "the model is loading")
        return self.engine.engine

    async def tokenizer_call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(tokenizer) on the preparation thread (off the engine's); a template's refusal is a 400."""
        engine = self.loaded_engine()
        if engine.tokenizer is None:
            raise ApiError(400, "this artifact has no tokenizer")
        try:
            return await self.engine.prepare(fn)
        except UserError as e:
            raise ApiError(400, str(e).splitlines()[0], getattr(e, "field", None)) from None

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base, the served model name); 404 for another."""
        if model is None or model == self.config.model_name:
            return None
        loras = self.engine.engine.lora_names() if self.is_ready else []
        if model not in loras:
            served = ", ".join(repr(n) for n in [self.config.model_name, *loras])
            raise ApiError(404, f"model {model!r} does not exist; this server serves {served}", "model",
                           "model_not_found")
        return model

    async def start(self, prompt: Prompt | ChatPrompt, params: list[SamplingParams], is_streaming: bool,
                    params_of: Mapping[str, str], lora: str | None = None) -> tuple[Accepted, AsyncIterator[Output]]:
        """Queue a request (under adapter `lora`): its Accepted and the iterator of its outputs (a 400/404/503
        ApiError instead). `params_of` maps the engine's field names (InputError.field; none = "prompt") to the
        body's."""
        if self.is_draining or not self.is_ready:
            raise ApiError(503, "the server is shutting down" if self.is_draining else "the model is loading")
        limit = self.engine.engine.config.max_num_seqs + self.config.max_waiting
        if self.engine.num_in_flight >= limit:
            raise ApiError(503, f"the server is full ({limit} requests in flight: max_num_seqs + max_waiting)")
        self.num_requests += 1
        outputs = self.engine.generate(prompt, params, is_streaming, time.perf_counter(), lora)
        try:
            accepted = await anext(outputs)
        except UnknownAdapterError as e:  # unloaded since check_model
            raise ApiError(404, str(e), "model", "model_not_found") from None
        except (ValueError, UserError) as e:
            field = getattr(e, "field", None) or "prompt"
            param = params_of.get(field, field)
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            if param != field and field != "prompt":  # the body's name, where it is not the engine's
                message = message.replace(field, param)
            raise ApiError(400, message, param) from None
        return accepted, outputs
