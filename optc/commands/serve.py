"""`optc serve`: serve an artifact over HTTP with the OpenAI API (optc.runtime.server). Its options are
declared here, beside the one call they make (`ServeOptions`, then `serve`); optc.cli registers the
command. The server's modules need the `serve` extra: without it the command is a user error saying so.
"""

from __future__ import annotations

from pathlib import Path

import typer

from optc.commands import parallel
from optc.commands.cli_common import read_text, user_errors
from optc.core.errors import UserError
from optc.core.lora import parse_named_adapter

DP_HELP = ("Serve N engine replicas (data parallelism) on Ray Serve behind this one endpoint (needs the ray "
           "extra): a prompt goes to the replica that cached its first KV blocks, or the least loaded one.")


def serve(
    artifact: Path = typer.Argument(..., help="Artifact folder."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback by default; 0.0.0.0 exposes "
                             "the server to the network)."),
    port: int = typer.Option(8000, "--port", help="Port to bind (0 = any free port; the URL is printed when ready)."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="OPTC_API_KEY", help="Require "
                                       "'Authorization: Bearer KEY' on /v1/* (default: env OPTC_API_KEY; none = "
                                       "no key)."),
    served_model_name: str | None = typer.Option(None, "--served-model-name", help="The model name clients send "
                                                 "and /v1/models lists (default: the artifact folder's name)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs", min=1, help="Requests batched together at "
                                            "most (default: the artifact's runtime.max_num_seqs)."),
    max_waiting: int = typer.Option(1024, "--max-waiting", min=0, help="Requests that may wait beyond the running "
                                    "ones; more get 503."),
    allowed_origin: list[str] = typer.Option([], "--allowed-origin", help="Allow browser requests (CORS) from "
                                             "this origin, e.g. http://localhost:3000 (repeatable; none = no CORS)."),
    log_requests: bool = typer.Option(False, "--log-requests", help="Log every request line and body (off: "
                                      "bodies are never logged)."),
    chat_template: Path | None = typer.Option(None, "--chat-template", help="A Jinja chat template file for "
                                              "/v1/chat/completions, replacing the tokenizer's (a base model has "
                                              "none: without one its chat requests get 400)."),
    shutdown_timeout: float = typer.Option(30.0, "--shutdown-timeout", min=0.0, help="Seconds in-flight requests "
                                           "get to finish after SIGTERM/SIGINT before they are cancelled."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip the sha256 check of the artifact's files."),
    tensor_parallel_size: int | None = parallel.TP,
    pipeline_parallel_size: int | None = parallel.PP,
    distributed_backend: str | None = parallel.BACKEND,
    nnodes: int | None = parallel.NNODES,
    node_rank: int | None = parallel.NODE_RANK,
    master_addr: str | None = parallel.MASTER_ADDR,
    master_port: int | None = parallel.MASTER_PORT,
    max_body_bytes: int = typer.Option(8 * 2**20, "--max-body-bytes", help="Largest request body; a larger one "
                                       "is answered 413 before it is read."),
    client_timeout: float = typer.Option(30.0, "--client-timeout", help="Seconds a client may take to send a "
                                         "request's headers, and then its body; a slower one is answered 408."),
    failure_window: float = typer.Option(60.0, "--failure-window", help="A failed engine step fails the requests "
                                         "in flight (500) and the server serves on; a second failure within this "
                                         "many seconds stops the server (exit 1)."),
    tool_call_parser: str | None = typer.Option(None, "--tool-call-parser", help="How tool calls are read from "
                                                "replies: hermes (<tool_call>{...}</tool_call>: Hermes, Qwen), "
                                                "llama3_json (Llama 3.x) or mistral ([TOOL_CALLS][...]); default: "
                                                "the model family's. A chat template without tools gets optc's "
                                                "tool prompt, which asks for hermes (docs/SERVE.md)."),
    lora: list[str] = typer.Option([], "--lora", help="NAME=DIR: serve the peft LoRA adapter in DIR as model NAME "
                                   "(repeatable); a request's `model` picks it."),
    max_loras: int | None = typer.Option(None, "--max-loras", min=0, help="Adapters loaded at once (slots; "
                                         "default: one per --lora). Room for /v1/load_lora_adapter."),
    max_lora_rank: int | None = typer.Option(None, "--max-lora-rank", min=1, help="Largest adapter rank the slots "
                                             "hold (default: the largest --lora's, 64 without)."),
    data_parallel_size: int | None = typer.Option(None, "--data-parallel-size", "-dp", min=1, help=DP_HELP),
    ray_address: str | None = typer.Option(None, "--ray-address", help="A running Ray cluster (ray://HOST:PORT "
                                           "or HOST:PORT) for the --data-parallel-size replicas; default: a local "
                                           "Ray instance, stopped with the server."),
    min_replicas: int | None = typer.Option(None, "--min-replicas", min=1, help="Autoscaling: fewest replicas "
                                            "(default: --data-parallel-size); Ray Serve adds replicas under load."),
    max_replicas: int | None = typer.Option(None, "--max-replicas", min=1, help="Autoscaling: most replicas "
                                            "(default: --data-parallel-size)."),
) -> None:
    """Serve an artifact over HTTP with the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models),
    plus /health, /metrics (Prometheus), /tokenize and /detokenize. Needs the `serve` extra."""
    with user_errors():
        try:
            from optc.runtime.server import ServeOptions
            from optc.runtime.server import serve as run_server
        except ImportError as e:
            raise UserError(f"optc serve needs the serve extra (pip install 'optc[serve]'): {e}") from None
        options = ServeOptions(artifact, host, port, api_key, served_model_name, device, max_num_seqs, max_waiting,
                               tuple(allowed_origin), log_requests, shutdown_timeout, not no_verify,
                               **parallel.overrides(tensor_parallel_size, pipeline_parallel_size, distributed_backend,
                                                    nnodes, node_rank, master_addr, master_port),
                               max_body_bytes=max_body_bytes, client_timeout=client_timeout,
                               failure_window=failure_window,
                               chat_template=read_text(chat_template, "--chat-template") if chat_template else None,
                               tool_call_parser=tool_call_parser,
                               loras=tuple(parse_named_adapter(v) for v in lora), max_loras=max_loras,
                               max_lora_rank=max_lora_rank, data_parallel_size=data_parallel_size,
                               ray_address=ray_address, min_replicas=min_replicas, max_replicas=max_replicas)
        run_server(options, on_ready=lambda url: typer.echo(f"optc serve: ready at {url}", err=True))
