"""`optc serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) for a built artifact.

`serve(options)` starts listening at once (so /health answers 503 while the model loads), loads the
engine on its engine thread, prints the URL when both are ready, and runs until SIGTERM or SIGINT:
then it stops accepting connections, answers 503 to new requests on open connections, lets the
requests in flight finish for up to `shutdown_timeout` seconds, and returns (exit 0). A model that
fails to load stops the server and `serve` raises the loader's error (a damaged or changed artifact: an
ArtifactError naming the file, exit 2); so does an engine that can step no more (a tensor-parallel rank died
or hung: its TensorParallelError names the rank, exit 2; a second failed step within `failure_window`
seconds of the first: EngineFailedRepeatedly, exit 1), after failing the requests in flight and stopping
the other ranks. Request bodies over `max_body_bytes` are answered 413, and clients that take longer than
`client_timeout` to send their headers or their body 408 (runtime/server/limits.py). Needs the `serve` extra
(fastapi, uvicorn, prometheus-client).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from optc.core.errors import InputError, UserError
from optc.runtime.server.app import create_app
from optc.runtime.server.async_engine import FAILURE_WINDOW_S, AsyncEngine
from optc.runtime.server.limits import CLIENT_TIMEOUT_S, MAX_BODY_BYTES, header_timeout_protocol
from optc.runtime.server.loading import load_engine
from optc.runtime.server.state import ServerConfig
from optc.runtime.server.tool_parsers import Parser


@dataclass(frozen=True)
class ServeOptions:
    artifact: Path
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None = no key needed
    served_model_name: str | None = None  # None = the artifact folder's name
    device: str = "cpu"
    max_num_seqs: int | None = None  # None = the artifact's runtime.max_num_seqs
    max_waiting: int = 1024
    allowed_origins: tuple[str, ...] = ()
    log_requests: bool = False
    shutdown_timeout: float = 30.0
    verify: bool = True  # check the artifact's file hashes on load
    tensor_parallel_size: int | None = None  # ranks the model is split over; None = the artifact's default
    distributed_backend: str | None = None  # nccl | gloo; None = nccl on cuda, gloo on cpu
    pipeline_parallel_size: int | None = None  # stages of tensor_parallel_size ranks; None = the artifact's default
    nnodes: int | None = None  # machines optc starts the ranks on (optc/commands/parallel.py); None = 1
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    max_body_bytes: int = MAX_BODY_BYTES  # a larger request body is answered 413 before it is read
    client_timeout: float = CLIENT_TIMEOUT_S  # seconds a client may take to send its headers, and its body
    failure_window: float = FAILURE_WINDOW_S  # a second failed engine step within it stops the server (exit 1)
    chat_template: str | None = None  # Jinja text replacing the tokenizer's chat template (a base model has none)
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral; None = the model family's
    loras: tuple[tuple[str, Path], ...] = ()  # (name, peft adapter folder) loaded at start
    max_loras: int | None = None  # adapter slots; None = one per --lora (none without), 0 = no adapters
    max_lora_rank: int | None = None  # None = the largest rank of --lora (64 without)
    data_parallel_size: int | None = None  # engine replicas on Ray Serve (replicas.py); None = one, in-process
    ray_address: str | None = None  # a running Ray cluster; None = a local Ray instance of the server's own
    min_replicas: int | None = None  # Ray Serve autoscaling's bounds; None = data_parallel_size
    max_replicas: int | None = None

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise InputError(f"--device must be cpu or cuda, got {self.device!r}")
        if not 0 <= self.port <= 65535:
            raise InputError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_waiting < 0:
            raise InputError(f"--max-waiting must be >= 0, got {self.max_waiting}")
        if self.shutdown_timeout < 0:
            raise InputError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        for name, value in (("--max-body-bytes", self.max_body_bytes), ("--client-timeout", self.client_timeout),
                            ("--failure-window", self.failure_window)):
            if not value > 0 or value == float("inf"):
                raise InputError(f"{name} must be a positive finite number, got {value}")
        if self.api_key == "":
            raise InputError("--api-key (or OPTC_API_KEY) must not be empty")
        names = [name for name, _ in self.loras]
        if len(set(names)) != len(names) or self.model_name in names:
            raise InputError(f"--lora names must be distinct and not the served model's name, got {names}")
        if self.max_loras is not None and self.max_loras < len(self.loras):
            raise InputError(f"--max-loras {self.max_loras} is fewer than the {len(self.loras)} --lora adapters")
        self._check_replicas()
        if self.tool_call_parser is not None and self.tool_call_parser not in [p.value for p in Parser]:
            raise InputError(f"--tool-call-parser must be one of {', '.join(p.value for p in Parser)}, got "
                             f"{self.tool_call_parser!r}")

    def _check_replicas(self) -> None:
        if self.data_parallel_size is None:
            given = [name for name, value in (("--ray-address", self.ray_address), ("--min-replicas",
                     self.min_replicas), ("--max-replicas", self.max_replicas)) if value is not None]
            if given:
                raise InputError(f"{given[0]} needs --data-parallel-size (the engine replicas run on Ray Serve)")
            return
        lowest, initial, highest = self.replica_bounds
        if not 1 <= lowest <= initial <= highest:
            raise InputError(f"replicas must satisfy 1 <= --min-replicas ({lowest}) <= --data-parallel-size "
                             f"({initial}) <= --max-replicas ({highest})")
        if self.ray_address == "":
            raise InputError("--ray-address must not be empty (omit it for a local Ray instance)")

    @property
    def replica_bounds(self) -> tuple[int, int, int]:
        """(min, initial, max) engine replicas."""
        n = self.data_parallel_size or 1
        return (n if self.min_replicas is None else self.min_replicas, n,
                n if self.max_replicas is None else self.max_replicas)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.artifact).resolve().name


def serve(options: ServeOptions, on_ready: Callable[[str], None] = print) -> None:
    """Serve `options.artifact` until SIGTERM/SIGINT; `on_ready(url)` once it answers requests."""
    engine_class, load = AsyncEngine, lambda: load_engine(options)
    if options.data_parallel_size is not None:
        try:
            from optc.runtime.server.replicas import RemoteEngine, start_replicas
        except ImportError as e:
            raise UserError(f"--data-parallel-size needs the ray extra (pip install 'optc[ray]'): {e}") from None
        engine_class, load = RemoteEngine, lambda: start_replicas(options)
    config = ServerConfig(options.model_name, options.api_key, options.max_waiting, options.allowed_origins,
                          options.log_requests, options.max_body_bytes, options.client_timeout, options.failure_window,
                          Parser(options.tool_call_parser) if options.tool_call_parser else None)
    _configure_logging()
    server: _Server | None = None
    fatal_errors: list[BaseException] = []  # a load that failed, or an engine that can step no more

    def on_loaded(engine) -> None:
        if engine.load_error is not None:
            fatal_errors.append(engine.load_error)
            server.should_exit = True
            return
        asyncio.get_running_loop().create_task(_announce(server, options, on_ready))

    def on_fatal(error: BaseException) -> None:
        fatal_errors.append(error)
        server.should_exit = True

    app = create_app(config, load, on_loaded, on_fatal, engine_class)
    uvicorn_config = uvicorn.Config(
        app, host=options.host, port=options.port, log_level="warning", access_log=options.log_requests,
        timeout_graceful_shutdown=options.shutdown_timeout, lifespan="on",
        http=header_timeout_protocol(options.client_timeout),
    )
    server = _Server(uvicorn_config, app.state.server)
    server.run()
    if fatal_errors:
        raise fatal_errors[0]
    if not server.started:
        raise UserError(f"could not listen on {options.host}:{options.port} (is the port in use?)")


class _Server(uvicorn.Server):
    """uvicorn's Server, draining on a signal (503s while in-flight requests finish) and returning
    normally afterwards instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, state) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        self.state.is_draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


async def _announce(server, options: ServeOptions, on_ready: Callable[[str], None]) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    port = options.port
    if port == 0 and server.servers:  # an OS-chosen port
        port = server.servers[0].sockets[0].getsockname()[1]
    host = f"[{options.host}]" if ":" in options.host else options.host
    on_ready(f"http://{host}:{port} serving {options.model_name!r}")


def _configure_logging() -> None:
    logger = logging.getLogger("optc.serve")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
