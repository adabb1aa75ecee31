"""The `optc` command line: thin typer wrappers; each command parses options and calls one library
function. A user error (`optc.core.errors.UserError`: bad recipe, source, artifact, option or prompt)
prints one line and exits 2; any other exception is a bug and shows its traceback (exit 1).
`--traceback` (or OPTC_TRACEBACK=1) shows the traceback of user errors too. `run` and `serve`, whose
options outgrew this file, are declared in optc/commands/run.py and serve.py and registered here, in the
order `optc --help` lists the commands.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import typer

from optc.commands import parallel
from optc.commands.cli_common import SPECULATIVE_HELP, user_errors
from optc.commands.export import ExportFormat, Flavor
from optc.commands.run import run
from optc.commands.serve import serve
from optc.core.errors import UserError
from optc.core.lora import parse_named_adapter

app = typer.Typer(
    help="optc: compile LLM checkpoints into optimized, self-describing inference artifacts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
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

    with user_errors():
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

    with user_errors():
        summary = summarize(artifact, tensor_parallel_size, pipeline_parallel_size)
    if as_json:
        typer.echo(json.dumps(summary, indent=1, sort_keys=True))
    else:
        from optc.commands.inspect import render

        typer.echo(render(summary))


app.command()(run)


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

    with user_errors():
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

        with user_errors():
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
    with user_errors():
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

    with user_errors():
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


app.command()(serve)


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

    with user_errors():
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
