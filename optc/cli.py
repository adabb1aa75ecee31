"""The `optc` command line: thin typer wrappers; each command parses options and calls one library
function. A user error (`optc.core.errors.UserError`: bad recipe, source, artifact, option or prompt)
prints one line and exits 2; any other exception is a bug and shows its traceback (exit 1).
`--traceback` (or OPTC_TRACEBACK=1) shows the traceback of user errors too.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from optc.commands import parallel
from optc.commands.export import ExportFormat, Flavor
from optc.core.errors import UserError
from optc.core.lora import adapter_rank, parse_named_adapter

app = typer.Typer(
    help="optc: compile LLM checkpoints into optimized, self-describing inference artifacts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


DP_HELP = ("Serve N engine replicas (data parallelism) on Ray Serve behind this one endpoint (needs the ray "
           "extra): a prompt goes to the replica that cached its first KV blocks, or the least loaded one.")

SPECULATIVE_HELP = (
    "Speculative decoding: ngram[:K] (prompt lookup), draft:PATH[:K] (a draft artifact with the same "
    "tokenizer, e.g. an int4 build of the model), eagle[:K] (the artifact's own draft head, trained at build "
    "time by the train_draft_head pass or imported from an EAGLE-1 checkpoint by import_draft_head) or "
    "eagle-tree:D:TOPK:NODES (that head drafting a tree: each depth's TOPK most probable nodes get their TOPK "
    "most probable children, down to depth D, and the NODES (1..63) most probable nodes are verified in one "
    "target forward); K, D = draft tokens per step, 1..16, default 4. A step where a tree cannot run (a "
    "tensor-parallel or CUDA-graph target, sliding-window or MLA attention, a kernel without the tree mask) "
    "drafts a chain of D. Default: the artifact's runtime.speculative, else off."
)


@app.callback()
def _main(
    show_traceback: bool = typer.Option(
        False, "--traceback", help="Show the full traceback of user errors too (also: OPTC_TRACEBACK=1)."
    ),
) -> None:
    """optc: compile LLM checkpoints into optimized, self-describing inference artifacts."""
    if show_traceback:  # the flag lives in this process's environment: every command of the run sees it
        os.environ["OPTC_TRACEBACK"] = "1"


def _read_text(path: Path, option: str) -> str:
    """A text file an option names; a UserError naming the option when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{option} {path}: cannot read it ({type(e).__name__}: {e})") from None


@contextmanager
def _user_errors() -> Iterator[None]:
    """One line and exit 2 for a UserError (with its traceback under --traceback); bugs propagate."""
    try:
        yield
    except UserError as e:
        if os.environ.get("OPTC_TRACEBACK") == "1":
            traceback.print_exc()
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        typer.echo(f"error: {msg}", err=True)
        raise typer.Exit(2) from None


@app.command()
def build(
    recipe: Path = typer.Argument(..., help="Recipe YAML (see `optc schema`)."),
    model: str | None = typer.Option(
        None,
        "--model",
        help="Model source; overrides the recipe's `model:` "
        "(HF folder, hub id, *.gguf, package:<pkg>/<file>, random:<preset>).",
    ),
    out: Path | None = typer.Option(None, "--out", help="Artifact folder to write (default: build/<recipe name>)."),
    set_: list[str] = typer.Option(
        [],
        "--set",
        help="Override a recipe key: KEY=VALUE, dotted keys allowed "
        "(e.g. --set dtype=float32 --set runtime.max_seq_len=2048). Repeatable.",
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace an existing output folder (only once the new artifact is complete)."
    ),
    verify_each: bool = typer.Option(False, "--verify-each", help="Verify the IR and weights after every pass."),
    dump_ir: Path | None = typer.Option(
        None, "--dump-ir", help="Write the IR as text before and after every pass into this folder."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
    device: str | None = typer.Option(
        None, "--device",
        help="Where the calibration passes (quantize_awq, quantize_gptq) run, one decoder block at a time: "
        "cuda or cpu (default: cuda when torch sees a GPU, else cpu). Other passes run on the CPU.",
    ),
) -> None:
    """Build an artifact from a recipe: load the model, run the passes, write the artifact atomically."""
    from optc.commands.eval import evaluate_build
    from optc.frontend.build import BuildOptions
    from optc.frontend.build import build as run_build

    with _user_errors():
        options = BuildOptions(recipe, out, model, tuple(set_), force, verify_each, dump_ir, quiet, device)
        path = run_build(options, evaluate=evaluate_build)
    typer.echo(str(path))


@app.command()
def inspect(
    artifact: Path = typer.Argument(..., help="Artifact folder."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    tensor_parallel_size: int | None = typer.Option(
        None, "--tensor-parallel-size", "-tp", min=1,
        help="Also show how each tensor shards over N ranks and the weight bytes each rank holds."),
    pipeline_parallel_size: int | None = typer.Option(
        None, "--pipeline-parallel-size", "-pp", min=1, help="Also show the P pipeline stages the layers are cut "
        "into: each one's layers, weight bytes and the values it hands on."),
) -> None:
    """Show an artifact: source, recipe, passes and their stats, formats, sizes, per-node kernels."""
    from optc.commands.inspect import summarize

    with _user_errors():
        summary = summarize(artifact, tensor_parallel_size, pipeline_parallel_size)
    if as_json:
        typer.echo(json.dumps(summary, indent=1, sort_keys=True))
    else:
        from optc.commands.inspect import render

        typer.echo(render(summary))


@app.command()
def run(
    artifact: Path = typer.Argument(..., help="Artifact folder."),
    prompt: str = typer.Option(..., "--prompt", help="Prompt text."),
    chat: bool = typer.Option(False, "--chat", help="Format the prompt with the model's chat template (a base "
                              "model has none: give one with --chat-template)."),
    chat_template: Path | None = typer.Option(None, "--chat-template", help="A Jinja chat template file that "
                                              "replaces the tokenizer's (or gives a base model one)."),
    max_tokens: int = typer.Option(
        64, "--max-tokens", min=1, help="Maximum new tokens; the prompt and these must fit in the context."
    ),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Keep the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]."),
    seed: int | None = typer.Option(None, "--seed", help="Seed for sampling."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip the sha256 check of the artifact's files."),
    as_json: bool = typer.Option(
        False, "--json", help="Print text, token_ids, prompt_tokens, completion_tokens, seconds as JSON."
    ),
    speculative: str | None = typer.Option(None, "--speculative", help=SPECULATIVE_HELP),
    tensor_parallel_size: int | None = parallel.TP,
    pipeline_parallel_size: int | None = parallel.PP,
    distributed_backend: str | None = parallel.BACKEND,
    nnodes: int | None = parallel.NNODES,
    node_rank: int | None = parallel.NODE_RANK,
    master_addr: str | None = parallel.MASTER_ADDR,
    master_port: int | None = parallel.MASTER_PORT,
    lora: Path | None = typer.Option(None, "--lora", help="A peft LoRA adapter folder to generate under."),
) -> None:
    """Generate text from one prompt."""
    import time

    from optc.runtime import Engine, SamplingParams
    from optc.runtime.speculative import SpeculativeConfig

    with _user_errors():
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=max_tokens, stop=tuple(stop)
        )
        spec = SpeculativeConfig.parse(speculative) if speculative else None
        template = _read_text(chat_template, "--chat-template") if chat_template else None
        if template is not None and not chat:
            raise UserError("--chat-template formats chat prompts: add --chat")
        loras = {"max_loras": 1, "max_lora_rank": adapter_rank(lora)} if lora else {}
        parallel_options = parallel.overrides(tensor_parallel_size, pipeline_parallel_size, distributed_backend, nnodes,
                                              node_rank, master_addr, master_port)
        engine = Engine.load(artifact, device=device, verify=not no_verify, speculative=spec, chat_template=template,
                             **parallel_options, **loras)
        try:
            if lora:
                engine.load_lora("lora", lora)
            t0 = time.perf_counter()
            (completion,) = engine.generate([prompt], params, chat=chat, loras=["lora" if lora else None])
            seconds = time.perf_counter() - t0
        finally:
            engine.close()
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "prompt_tokens": len(completion.prompt_token_ids),
                    "completion_tokens": len(completion.token_ids),
                    "finish_reason": completion.finish_reason,
                    "seconds": round(seconds, 4),
                }
            )
        )
    else:
        typer.echo(completion.text)


@app.command("eval")
def eval_(
    artifact: Path = typer.Argument(..., help="Artifact folder to evaluate."),
    reference: str | None = typer.Option(
        None,
        "--reference",
        help="Reference model: an artifact folder or a model source (HF folder, *.gguf, "
        "package:<pkg>/<file>, random:<preset>). Adds reference_ppl, kld and top1_agreement.",
    ),
    data: str = typer.Option(
        "builtin:pydoc-heldout",
        "--data",
        help="Held-out text: builtin:pydoc-heldout, a .txt file or a .jsonl file with a `text` field.",
    ),
    max_tokens: int = typer.Option(
        8192,
        "--max-tokens",
        min=2,
        help="Tokens of the text to score (cut into windows of 512 from token 0; a final partial window is dropped).",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print ppl, reference_ppl, kld, top1_agreement, tokens as JSON."
    ),
    tensor_parallel_size: int | None = parallel.TP,
    pipeline_parallel_size: int | None = parallel.PP,
    distributed_backend: str | None = parallel.BACKEND,
) -> None:
    """Measure quality: perplexity on held-out text, and KL divergence / top-1 agreement against a reference."""
    from optc.commands.eval import evaluate

    with _user_errors():
        result = evaluate(
            artifact, reference, data, max_tokens, progress=lambda m: typer.echo(m, err=True) if not as_json else None,
            **parallel.overrides(tensor_parallel_size, pipeline_parallel_size, distributed_backend),
        )
    if as_json:
        typer.echo(json.dumps(result, sort_keys=True))
        return
    for key in ("ppl", "reference_ppl", "kld", "top1_agreement", "tokens", "windows", "window", "data"):
        value = result.get(key)
        typer.echo(f"{key:<15} {value:.6g}" if isinstance(value, float) else f"{key:<15} {value}")


@app.command()
def bench(
    artifact: Path | None = typer.Argument(None, help="Artifact folder (not with --url)."),
    num_requests: int = typer.Option(64, "--num-requests", min=1, help="Requests, all submitted at once."),
    input_len: int = typer.Option(128, "--input-len", min=1, help="Prompt tokens per request (random token ids, "
                                  "seeded; ignored with --dataset)."),
    output_len: int = typer.Option(128, "--output-len", min=1, help="Generated tokens per request (EOS ignored)."),
    dataset: Path | None = typer.Option(None, "--dataset", help="Prompts, cycled: a text file with one prompt per "
                                        "non-empty line, or a .jsonl file of {\"prompt\": ..., \"output_len\": ...} "
                                        "(output_len optional, default --output-len)."),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs", min=1, help="Requests in flight at once "
                                            "(default: the artifact's runtime.max_num_seqs)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    eager: bool = typer.Option(False, "--eager", help="No CUDA graphs (decode runs eagerly)."),
    compare_hf: bool = typer.Option(False, "--compare-hf", help="Also run the same workload through transformers "
                                    "generate on the artifact's source (static cache; torch.compile on CUDA) and "
                                    "print the ratio."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic prompts."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (output_tokens_per_s, "
                                 "total_tokens_per_s, ttft_ms, tpot_ms, peak_memory_bytes, spec_acceptance_rate, "
                                 "...)."),
    url: str | None = typer.Option(None, "--url", help="Load-test a running OpenAI-compatible server at this base "
                                   "URL (e.g. http://127.0.0.1:8000) instead of an artifact in-process: streaming "
                                   "requests, greedy, EOS ignored; key from env OPTC_API_KEY."),
    request_rate: float = typer.Option(float("inf"), "--request-rate", help="With --url: requests per second, "
                                       "Poisson arrivals (inf = all at once)."),
    max_concurrency: int | None = typer.Option(None, "--max-concurrency", min=1, help="With --url: requests in "
                                               "flight at most (default: no limit)."),
    speculative: str | None = typer.Option(None, "--speculative", help=SPECULATIVE_HELP),
    tensor_parallel_size: int | None = parallel.TP,
    pipeline_parallel_size: int | None = parallel.PP,
    distributed_backend: str | None = parallel.BACKEND,
    nnodes: int | None = parallel.NNODES,
    node_rank: int | None = parallel.NODE_RANK,
    master_addr: str | None = parallel.MASTER_ADDR,
    master_port: int | None = parallel.MASTER_PORT,
    lora: list[str] = typer.Option([], "--lora", help="NAME=DIR: a peft LoRA adapter; requests take the adapters "
                                   "in turn (repeatable)."),
) -> None:
    """Serving benchmark: in-process on an artifact (throughput, TTFT/TPOT percentiles, peak memory, KV usage),
    or with --url a load test of a running server (throughput, TTFT, TPOT, ITL, end-to-end latency, errors)."""
    from optc.commands.bench import BenchOptions, format_bench, run_bench

    if url is not None or artifact is None:
        from optc.commands.loadgen import LoadOptions, format_load, run_load

        with _user_errors():
            if (url is None) == (artifact is None):
                raise UserError("give an ARTIFACT (in-process) or --url (a running server), not both or neither")
            in_process = {"--max-num-seqs": max_num_seqs is not None, "--device": device != "cpu", "--eager": eager,
                          "--compare-hf": compare_hf, "--tensor-parallel-size": tensor_parallel_size is not None,
                          "--pipeline-parallel-size": pipeline_parallel_size is not None,
                          "--distributed-backend": distributed_backend is not None, "--nnodes": nnodes is not None,
                          "--speculative": speculative is not None, "--lora": bool(lora)}
            if any(in_process.values()):
                raise UserError(f"{[k for k, v in in_process.items() if v][0]} is for in-process runs; with --url "
                                "it is the server's setting")
            result = run_load(LoadOptions(url, num_requests, input_len, output_len, request_rate, max_concurrency,
                                          dataset, seed, show_progress=not as_json))
        typer.echo(json.dumps(result.to_json(), indent=1, sort_keys=True) if as_json else format_load(result))
        return
    with _user_errors():
        with_url = {"--request-rate": not math.isinf(request_rate), "--max-concurrency": max_concurrency is not None}
        if any(with_url.values()):
            raise UserError(f"{[k for k, v in with_url.items() if v][0]} is for load tests of a server (--url); "
                            "in-process, every request is submitted at once and --max-num-seqs sets how many run")
        options = BenchOptions(artifact, num_requests, input_len, output_len, dataset, max_num_seqs, device, eager,
                               compare_hf, None, seed, show_progress=not as_json, speculative=speculative,
                               **parallel.overrides(tensor_parallel_size, pipeline_parallel_size, distributed_backend,
                                                    nnodes, node_rank, master_addr, master_port),
                               loras=tuple(parse_named_adapter(v) for v in lora))
        result = run_bench(options)
    typer.echo(json.dumps(result.to_json(), indent=1, sort_keys=True) if as_json else format_bench(result))


@app.command()
def compare(
    recipe: Path = typer.Argument(..., help="Base recipe YAML; its variants are built from it."),
    leave_one_out: bool = typer.Option(False, "--leave-one-out", help="Variants: the recipe, then each pass "
                                       "dropped (the default mode)."),
    add_one: bool = typer.Option(False, "--add-one", help="Variants: the recipe without passes, each pass alone "
                                 "added to it, and the full recipe; deltas are against the bare one."),
    variants: Path | None = typer.Option(None, "--variants", help="Variants YAML: name -> list of edits "
                                         "({drop: PASS}, {add: PASS or {PASS: options}, before|after: PASS}, "
                                         "{set: {KEY: VALUE}}); deltas are against the unedited recipe."),
    model: str | None = typer.Option(None, "--model", help="Model source; overrides the recipe's `model:`."),
    set_: list[str] = typer.Option([], "--set", help="Override a recipe key for every variant: KEY=VALUE "
                                   "(dotted keys). Repeatable."),
    reference: str | None = typer.Option(None, "--reference", help="Quality reference: an artifact folder or a "
                                         "model source (default: the recipe's model, unoptimized)."),
    data: str = typer.Option("builtin:pydoc-heldout", "--data", help="Held-out text: builtin:pydoc-heldout, a "
                             ".txt file or a .jsonl file with a `text` field."),
    eval_tokens: int = typer.Option(4096, "--eval-tokens", min=2, help="Tokens of the text to score, cut into "
                                    "windows of --window tokens (the intervals bootstrap over windows)."),
    window: int = typer.Option(256, "--window", min=2, help="Tokens per evaluation window."),
    num_requests: int = typer.Option(4, "--num-requests", min=1, help="Requests per speed run (at least the "
                                     "batch size)."),
    batch_sizes: str = typer.Option("1,4", "--batch-sizes", help="Comma-separated batch sizes (max requests in "
                                    "flight) of the speed runs."),
    input_len: int = typer.Option(64, "--input-len", min=1, help="Prompt tokens per request (random ids, seeded)."),
    output_len: int = typer.Option(16, "--output-len", min=2, help="Generated tokens per request."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Speed runs per variant, each in a fresh process; "
                                "their [min, max] is the noise band."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda: where speed is measured."),
    out: Path = typer.Option(Path("compare"), "--out", help="Folder for compare.json, compare.md, the PNG plots "
                             "and report.html."),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help="Build cache (default: $OPTC_CACHE/compare, "
                                          "~/.cache/optc/compare)."),
    baseline: Path | None = typer.Option(None, "--baseline", help="A compare.json to gate against (CI): exit 1 "
                                         "naming every regression beyond the thresholds."),
    max_ppl_increase: float | None = typer.Option(None, "--max-ppl-increase", min=0.0, help="Gate: largest "
                                                  "allowed perplexity rise over --baseline, in percent."),
    min_speed_ratio: float | None = typer.Option(None, "--min-speed-ratio", min=0.0, help="Gate: smallest "
                                                 "allowed output tok/s relative to --baseline (e.g. 0.9)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
) -> None:
    """Compare pass ablations of a recipe: build each variant (cached), measure quality, speed, size and build
    time with intervals, mark the Pareto front, write compare.json, compare.md, PNG plots and report.html."""
    from optc.commands.compare import CompareOptions, Mode, SpeedSettings, run_compare

    with _user_errors():
        if leave_one_out + add_one + (variants is not None) > 1:
            raise UserError("give one of --leave-one-out, --add-one, --variants FILE")
        mode = Mode.ADD_ONE if add_one else Mode.FILE if variants is not None else Mode.LEAVE_ONE_OUT
        try:
            sizes = tuple(sorted({int(b) for b in batch_sizes.split(",") if b.strip()}))
        except ValueError:
            sizes = ()
        if not sizes or min(sizes) < 1:
            raise UserError(f"--batch-sizes {batch_sizes!r}: expected comma-separated integers >= 1, e.g. 1,4")
        speed = SpeedSettings(sizes, num_requests, input_len, output_len, repeats, device)
        result = run_compare(CompareOptions(recipe, mode, variants, model, tuple(set_), reference, data, eval_tokens,
                                            window, speed, out, cache_dir, baseline, max_ppl_increase,
                                            min_speed_ratio, show_progress=not quiet))
    typer.echo(f"wrote {', '.join(str(f) for f in result.files[:2])} and {len(result.files) - 2} more in {out}")
    for line in result.regressions:
        typer.echo(f"regression: {line}", err=True)
    if result.regressions:
        raise typer.Exit(1)


@app.command()
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
    with _user_errors():
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
                               chat_template=_read_text(chat_template, "--chat-template") if chat_template else None,
                               tool_call_parser=tool_call_parser,
                               loras=tuple(parse_named_adapter(v) for v in lora), max_loras=max_loras,
                               max_lora_rank=max_lora_rank, data_parallel_size=data_parallel_size,
                               ray_address=ray_address, min_replicas=min_replicas, max_replicas=max_replicas)
        run_server(options, on_ready=lambda url: typer.echo(f"optc serve: ready at {url}", err=True))


@app.command()
def export(
    artifact: Path = typer.Argument(..., help="Artifact folder to export."),
    out: Path = typer.Option(..., "--out", help="Output folder (written whole, then renamed into place)."),
    format_: ExportFormat = typer.Option(
        ExportFormat.ONNX, "--format", help="onnx: model.onnx + model.onnx.data; tensorrt: also a serialized "
        "TensorRT engine built from the portable ONNX (needs the tensorrt package and an NVIDIA GPU); hf: a Hugging "
        "Face folder (config.json, model.safetensors, tokenizer) with quantized weights in compressed-tensors "
        "pack-quantized, for transformers / vLLM / SGLang (--flavor does not apply)."
    ),
    flavor: Flavor | None = typer.Option(
        None, "--flavor", help="--format onnx only (default ort): ort: ONNX Runtime's com.microsoft fused operators "
        "(GroupQueryAttention, RotaryEmbedding, SkipSimplifiedLayerNormalization, MatMulNBits) and a "
        "genai_config.json; portable: standard ONNX operators only (for TensorRT and others; int4 must be "
        "symmetric, group 64 or 128). --format tensorrt is always portable; --format hf takes none."
    ),
    force: bool = typer.Option(False, "--force", help="Replace an existing output folder once the new one is whole."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip the sha256 check of the artifact's files."),
    as_json: bool = typer.Option(False, "--json", help="Print out, format, flavor, seconds and file sizes as JSON."),
) -> None:
    """Export an artifact to ONNX (ONNX Runtime or portable; pip install 'optc\\[onnx]'), a TensorRT engine, or a
    Hugging Face folder (loading it with transformers needs pip install 'optc\\[hf]')."""
    from optc.commands.export import ExportOptions
    from optc.commands.export import export as run_export

    with _user_errors():
        result = run_export(ExportOptions(artifact, out, format_, flavor, force, not no_verify, quiet=as_json))
    typer.echo(json.dumps(result.to_json(), indent=1, sort_keys=True) if as_json
               else "\n".join([str(result.out), *result.notes]))


@app.command()
def warmup(
    as_json: bool = typer.Option(False, "--json", help="Print {name, status, seconds, detail} as JSON instead of "
                                 "one line."),
) -> None:
    """Compile optc's C++ CPU kernels (one extension) into $OPTC_CACHE/cpu_ext (default ~/.cache/optc), so that a
    first `optc serve` or `optc run` does not compile them while it loads. One line: built, cached, failed (the
    compiler's error) or skipped (no C++ compiler or ninja, or a CPU without AVX2: those models run torch's kernels
    and the op references instead), and the seconds it took. Exit 1 if the build failed on a machine with a
    compiler."""
    from optc.commands.warmup import Status
    from optc.commands.warmup import warmup as run_warmup

    outcome = run_warmup()
    typer.echo(json.dumps(outcome.to_json(), indent=1) if as_json else outcome.line())
    if outcome.status is Status.FAILED:
        raise typer.Exit(1)


@app.command()
def schema() -> None:
    """Print the JSON Schema of recipes."""
    from optc.frontend.recipe import recipe_json_schema

    typer.echo(json.dumps(recipe_json_schema(), indent=1))


def main() -> None:  # pragma: no cover
    sys.exit(app())
