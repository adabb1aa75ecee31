"""The FastAPI app of `optc serve`: OpenAI's completions, chat completions and models endpoints, plus
/health, /metrics, /tokenize and /detokenize, over one AsyncEngine.

Every error is OpenAI's shape with a status: 400 for an invalid or unsupported body and for requests
the engine refuses (a prompt, or prompt + max_tokens, longer than the context: the message gives the
numbers; `param` is the field the engine's InputError names), 401 for a missing or
wrong key on /v1/* (compared in constant time), 404 for another model name, 503 while loading or
draining and when `max_num_seqs + max_waiting` requests are already in flight, 413 for a body over
`max_body_bytes` and 408 for a client too slow to send it (runtime/server/limits.py), a 500 naming the
failure for the requests in flight when an engine step raises (EngineFailed), and a 500 that says nothing
about the internals for anything else. A client that disconnects has its request aborted before the engine's
next step; a streaming response is SSE ending with `data: [DONE]`. What the routes share (the settings, the
loaded engine, admission of a request) is runtime/server/state.py's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from optc.core.errors import UserError
from optc.runtime.engine import Engine
from optc.runtime.grammar import GrammarKind, GrammarSpec
from optc.runtime.lora import UnknownAdapterError
from optc.runtime.sampler import SamplingParams
from optc.runtime.server import responses as r
from optc.runtime.server.async_engine import Accepted, AsyncEngine, ChatPrompt, EngineFailed
from optc.runtime.server.limits import BodyLimits
from optc.runtime.server.metrics import CONTENT_TYPE
from optc.runtime.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraRequest,
    TokenizeRequest,
    UnloadLoraRequest,
    parse,
)
from optc.runtime.server.state import ServerConfig, ServerState
from optc.runtime.server.streaming import collect, stream
from optc.runtime.server.tool_parsers import Parser, parse_tool_calls
from optc.runtime.server.tools import (
    ToolChoice,
    ToolRequest,
    choose_parser,
    forced_call_grammar,
    marker_token_ids,
    template_takes_tools,
    tool_request,
)
from optc.runtime.text import chat_token_ids

log = logging.getLogger("optc.serve")


def create_app(config: ServerConfig, load: Callable[[], Engine],
               on_loaded: Callable[[AsyncEngine], None] = lambda engine: None,
               on_fatal: Callable[[BaseException], None] = lambda error: None,
               engine_class: Callable[..., AsyncEngine] = AsyncEngine) -> FastAPI:
    """The app; `load` builds the Engine on the engine thread, `on_loaded` runs on the event loop once
    loading ended (check `engine.load_error`), `on_fatal(error)` once the engine can step no more (a
    tensor-parallel rank died). `engine_class`: AsyncEngine, or replicas.py's RemoteEngine (`load` starts replicas)."""
    state = ServerState(config, load, on_loaded, on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine = engine_class(load, asyncio.get_running_loop(), state.metrics, on_fatal, config.failure_window_s)
        state.engine.start()
        waiter = asyncio.create_task(_when_loaded(state))
        yield
        waiter.cancel()
        state.engine.stop()

    app = FastAPI(title="optc", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(BodyLimits, max_body_bytes=config.max_body_bytes, timeout_s=config.client_timeout_s)
    if config.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    _add_error_handlers(app)

    async def check_key(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @app.get("/health")
    async def health() -> Response:
        if state.is_draining or not state.is_ready:
            return JSONResponse({"status": "draining" if state.is_draining else "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await state.engine.render_metrics(), media_type=CONTENT_TYPE)

    @v1.get("/models")
    async def models() -> Response:
        engine = state.loaded_engine()
        base = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "optc",
                "max_model_len": engine.max_model_len, "vocab_size": engine.model.vocab_size}
        adapters = await state.engine.call(lambda e: [(n, str(e.loras.adapters[n].path)) for n in e.lora_names()])
        return JSONResponse({"object": "list", "data": [base, *(
            {**base, "id": name, "parent": config.model_name, "root": path} for name, path in adapters)]})

    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body: LoadLoraRequest = parse(LoadLoraRequest, await _json(request, config))
        state.loaded_engine()
        if body.lora_name == config.model_name:
            raise ApiError(400, f"{body.lora_name!r} is the base model's name", "lora_name")
        try:
            await state.engine.call(lambda e: e.load_lora(body.lora_name, body.lora_path))
        except UserError as e:
            raise ApiError(400, str(e).splitlines()[0], getattr(e, "field", None) or "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body: UnloadLoraRequest = parse(UnloadLoraRequest, await _json(request, config))
        state.loaded_engine()
        try:  # requests in flight under it finish first; new ones get 404 from now on
            await state.engine.call(lambda e: e.unload_lora(body.lora_name))
        except UnknownAdapterError as e:
            raise ApiError(404, str(e), "lora_name", "model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = parse(CompletionRequest, await _json(request, config))
        lora = state.check_model(body.model)
        if body.echo and body.stream and body.logprobs is not None:
            raise ApiError(400, "'echo' with 'logprobs' is not supported when streaming", "echo")
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        params = body.sampling_params(max_tokens, logprobs=body.logprobs,
                         prompt_logprobs=(body.logprobs or 0) if body.echo and body.logprobs is not None
                         or max_tokens == 0 else None)
        accepted, outputs = await state.start(body.single_prompt, params, body.stream, _PARAMS_OF, lora)
        ids = r.ResponseIds("cmpl", state.num_requests, lora or config.model_name)
        echo = await _prompt_text(state, body.single_prompt, accepted) if body.echo else ""
        if body.stream:
            chunk = lambda out, first: r.completion_chunk(ids, out, echo if first else "", body.return_token_ids)
            return stream(request, outputs, body, chunk, ids.completion)
        results = await collect(request, outputs, body.n)
        if results is None:
            return Response(status_code=499)
        choices = []
        for index, (text, last, entries, token_ids) in enumerate(results):
            logprobs = None
            if body.logprobs is not None:
                logprobs = r.completion_logprobs((last.prompt_logprobs or []) + entries if body.echo else entries)
            choice = {"index": index, "text": echo + text, "logprobs": logprobs, "finish_reason": last.finish_reason}
            if body.return_token_ids:
                choice |= {"prompt_token_ids": accepted.prompt_token_ids, "token_ids": token_ids}
            choices.append(choice)
        return JSONResponse(ids.completion(choices, r.total_usage(results)))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest = parse(ChatCompletionRequest, await _json(request, config))
        lora = state.check_model(body.model)
        tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls)
        parser = await _tool_parser(state, config) if tools.choice is not ToolChoice.NONE else None
        max_tokens = body.max_completion_tokens or body.max_tokens  # None: up to the context
        params = body.sampling_params(max_tokens, logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        if parser is not None:
            params = await _with_tool_grammar(state, params, tools, parser)
        params_of = {**_PARAMS_OF, "prompt": "messages",
                     "max_tokens": "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"}
        accepted, outputs = await state.start(ChatPrompt(body.chat_messages(), tools), params, body.stream,
                                              params_of, lora)
        ids = r.ResponseIds("chatcmpl", state.num_requests, lora or config.model_name)
        if body.stream:
            chunk = (lambda out, first: r.chat_chunk(ids, out, first, body.logprobs)) if parser is None else \
                r.ToolChunks(ids, parser, body.logprobs).chunk
            return stream(request, outputs, body, chunk, ids.chat)
        results = await collect(request, outputs, body.n)
        if results is None:
            return Response(status_code=499)
        choices = []
        for index, (text, last, entries, _) in enumerate(results):
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish_reason = last.finish_reason
            if parser is not None:
                content, calls = parse_tool_calls(text, parser)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            choices.append({"index": index, "message": message, "finish_reason": finish_reason,
                            "logprobs": r.chat_logprobs(entries) if body.logprobs else None})
        return JSONResponse(ids.chat(choices, r.total_usage(results)))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body: TokenizeRequest = parse(TokenizeRequest, await _json(request, config))
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages or []]
        special = body.add_special_tokens
        tokens = await state.tokenizer_call(lambda t: chat_token_ids(t, messages) if body.messages is not None
                                       else list(t(body.prompt, add_special_tokens=special)["input_ids"]))
        max_model_len = state.loaded_engine().max_model_len
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body: DetokenizeRequest = parse(DetokenizeRequest, await _json(request, config))
        state.check_model(body.model)
        vocab_size = state.loaded_engine().model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(400, f"token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})", "tokens")
        return JSONResponse({"prompt": await state.tokenizer_call(lambda t: t.decode(body.tokens))})

    app.include_router(v1)
    return app


# -- helpers ----------------------------------------------------------------------------------------


async def _when_loaded(state: ServerState) -> None:
    await state.engine.ready.wait()
    state.on_loaded(state.engine)


async def _json(request: Request, config: ServerConfig) -> Any:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError:  # not JSON, not UTF-8, or an integer of more than 4300 digits
        raise ApiError(400, "the request body is not valid JSON") from None
    except RecursionError:
        raise ApiError(400, "the request body nests arrays or objects too deeply") from None
    if config.log_requests:
        log.info("%s %s %s", request.method, request.url.path, raw.decode(errors="replace"))
    return body


_PARAMS_OF: dict[str, str] = {"grammar": "response_format"}  # the engine's field names the body's


async def _tool_parser(state: ServerState, config: ServerConfig) -> Parser:
    """The format of this model's tool calls: --tool-call-parser, else its family's (hermes where its template
    shows no tools and optc's prompt does)."""
    architecture = state.loaded_engine().model.graph.config.architecture
    takes_tools = await state.tokenizer_call(template_takes_tools)
    return choose_parser(architecture, takes_tools, config.tool_call_parser)


async def _with_tool_grammar(state: ServerState, params: list[SamplingParams], tools: ToolRequest,
                             parser: Parser) -> list[SamplingParams]:
    """`params` with the grammar that forces a call (tool_choice required or named; a 400 beside another
    grammar), and with special tokens kept in the text where the format is marked by one (mistral)."""
    markers = await state.tokenizer_call(marker_token_ids)
    lark = forced_call_grammar(tools, parser, markers)
    if lark is not None and params[0].grammar is not None:
        raise ApiError(400, "a 'required' or named 'tool_choice' decides the reply's format: drop "
                       "'response_format' / 'structured_outputs'", "tool_choice")
    grammar = GrammarSpec(GrammarKind.LARK, lark, "tools") if lark is not None else params[0].grammar
    keep_special = parser is Parser.MISTRAL
    return [dataclasses.replace(p, grammar=grammar, skip_special_tokens=not keep_special) for p in params]


async def _prompt_text(state: ServerState, prompt: str | list[int], accepted: Accepted) -> str:
    if isinstance(prompt, str):
        return prompt
    return await state.tokenizer_call(lambda t: t.decode(accepted.prompt_token_ids))


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> Response:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> Response:
        return JSONResponse(ApiError(400, "invalid request body").body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        error = ApiError(e.status_code, str(e.detail))
        return JSONResponse(error.body(), status_code=e.status_code)

    @app.exception_handler(EngineFailed)
    async def engine_failed(request: Request, e: EngineFailed) -> Response:
        return JSONResponse(ApiError(500, str(e)).body(), status_code=500)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> Response:
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(ApiError(500, "internal server error").body(), status_code=500)
