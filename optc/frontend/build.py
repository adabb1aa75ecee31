"""`optc build`: recipe -> source -> passes -> artifact. The library function the CLI calls.

A recipe with `eval: true` records the built model's quality; measuring it is `optc eval`'s job (a command,
a layer above this one), so the caller passes the evaluator in (`build(options, evaluate=...)`; the CLI,
`optc compare` and `optc.testing.build_artifact` pass `optc.commands.eval.evaluate_build`).
"""

from __future__ import annotations

import platform
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import optc
from optc.core.artifact import MIN_CUDA_CAPABILITY, ArtifactError, Manifest, Target, write
from optc.core.errors import UserError
from optc.core.ir import Graph
from optc.core.kv_cache import KVCacheSpec
from optc.core.ops import verify
from optc.core.ops.sharding import ShardError, plan_shards
from optc.core.ops.stages import StageError, plan_stages, stage_graph
from optc.core.store import TensorStore
from optc.frontend.passmanager import PassContext, PassManager
from optc.frontend.recipe import Recipe, RecipeError, SourceQuantization, load_recipe
from optc.frontend.sources import load_source
from optc.kernels.registry import KERNELS, KernelSpec

# (built graph, built store, the source) -> the manifest's `quality` section
Evaluator = Callable[[Graph, TensorStore, Any], dict]


@dataclass(frozen=True)
class BuildOptions:
    recipe: Path | None = None
    out: Path | None = None
    model: str | None = None
    overrides: tuple[str, ...] = ()
    force: bool = False
    verify_each: bool = False
    dump_ir: Path | None = None
    quiet: bool = False
    device: str | None = None  # where the calibration passes run: cuda | cpu; None = cuda when a GPU is visible


def calibration_device(name: str | None) -> torch.device:
    """The device the calibration passes (AWQ, GPTQ) run on: `name`, or the GPU when one is visible."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise UserError(f"--device {name!r}: allowed values are cpu and cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA GPU on this machine (torch.cuda.is_available() is "
                        f"False; torch {torch.__version__}); build with --device cpu")
    return torch.device(name)


def build(options: BuildOptions, evaluate: Evaluator | None = None) -> Path:
    """Build the artifact; `evaluate` measures quality when the recipe says `eval: true` (required then)."""
    recipe = load_recipe(options.recipe, list(options.overrides), options.model)
    device = calibration_device(options.device)  # refuse before any heavy work
    if recipe.model is None:
        raise RecipeError("no model to build: set `model:` in the recipe or pass --model")
    if recipe.eval and evaluate is None:
        raise RecipeError("recipe key `eval: true` needs an evaluator and this caller passed none: call "
                          "build(options, evaluate=optc.commands.eval.evaluate_build), as `optc build` does")
    stem = Path(options.recipe).stem if options.recipe else "artifact"
    out = Path(options.out) if options.out else Path("build") / stem
    if out.exists() and not options.force:  # refuse before any heavy work
        raise ArtifactError(f"output folder {out} already exists; pass --force to replace it")
    say = (lambda m: None) if options.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    say(f"loading {recipe.model}")
    source = load_source(recipe.model, keep_quantization=recipe.source_quantization is SourceQuantization.KEEP)
    passes = [(p.name, p.options) for p in recipe.passes]
    if "cast" not in {n for n, _ in passes}:
        passes.insert(0, ("cast", {"dtype": None}))  # the recipe's dtype always applies
    with tempfile.TemporaryDirectory(prefix="optc-tok-") as tok_dir:
        ctx = PassContext(
            target=recipe.target.value,
            dtype=recipe.dtype,
            generator=torch.Generator().manual_seed(recipe.calibration.seed),
            progress=say,
            show_progress_bars=not options.quiet,
            device=device,
        )
        ctx.tokenizer = _tokenizer(source, Path(tok_dir))
        ctx.calibration_tokens = _calibration(recipe, ctx)
        manager = PassManager(passes, verify_each=options.verify_each, dump_ir=options.dump_ir)
        graph, store, records, sections = manager.run(source.graph, source.store, ctx)
    verify(graph, store)
    _check_parallel_sizes(graph, recipe.runtime.tensor_parallel_size, recipe.runtime.pipeline_parallel_size)
    if recipe.eval:
        say("measuring quality (optc eval)")
        quality = evaluate(graph, store, source)
    else:
        quality = None
    cuda = recipe.target.value == "cuda"
    manifest = Manifest(
        optc_version=optc.__version__,
        source=source.record,
        recipe=recipe.to_json(),
        recipe_sha256=recipe.sha256(),
        passes=[{"name": r.name, "options": r.options, "changed": r.changed, "stats": r.stats} for r in records],
        model=graph.config,
        target=Target(recipe.target.value, min_cuda_capability(graph) if cuda else None),
        kv_layout=sections.get("kv_layout") or KVCacheSpec(dtype=recipe.dtype),
        toolchain=_toolchain(),
        runtime=recipe.runtime,
        quantization=sections.get("quantization") or source.quantization,
        cuda_graphs=sections.get("cuda_graphs"),
        quality=quality,
        draft_head=sections.get("draft_head"),
    )
    report = {
        "host": platform.node(),
        "python": platform.python_version(),
        "seconds_before_write": round(time.perf_counter() - t0, 3),  # load + passes (+ eval)
        "passes": [
            {"name": r.name, "seconds": round(r.seconds, 4), "peak_rss_bytes": r.peak_rss_bytes} for r in records
        ],
    }
    if device.type == "cuda":  # the GPU memory the calibration passes needed, for sizing the build machine
        report["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        say(f"peak GPU memory: {report['peak_gpu_memory_bytes'] / 2**30:.2f} GiB")
    say(f"writing {out}")
    return write(out, graph, store, manifest, report, source.save_tokenizer, force=options.force, progress=say,
                 started=t0)


def min_cuda_capability(graph: Graph, kernels: Mapping[str, KernelSpec] = KERNELS) -> tuple[int, int]:
    """The least CUDA compute capability that runs `graph`: the runtime's floor (MIN_CUDA_CAPABILITY),
    raised by the scheme of any weight format it uses and by any kernel its nodes are bound to."""
    needs = [graph.tensors[t].format.scheme.min_capability for t in graph.used_tensors()]
    needs += [kernels[n.kernel].min_capability for n in graph.nodes if n.kernel in kernels]
    return max([MIN_CUDA_CAPABILITY, *(c for c in needs if c is not None)])


def _tokenizer(source, tok_dir: Path):
    """A memoized function loading the source's tokenizer (saved into `tok_dir` first)."""
    cache: list[Any] = []

    def tokenizer() -> Any:
        if not cache:
            from transformers import AutoTokenizer

            source.save_tokenizer(tok_dir)
            cache.append(AutoTokenizer.from_pretrained(str(tok_dir)))
        return cache[0]

    return tokenizer


def _calibration(recipe: Recipe, ctx: PassContext):
    """A memoized function producing the calibration token windows (only the passes that calibrate call it)."""
    cache: list[torch.Tensor] = []

    def tokens() -> torch.Tensor:
        if not cache:
            from optc.frontend.calibration import calibration_batch

            tokenizer = ctx.tokenizer()
            c = recipe.calibration
            ids, sha = calibration_batch(c.source, tokenizer, c.samples, c.seq_len, c.seed)
            ctx.calibration_record.update(
                source=c.source, sha256=sha, samples=c.samples, seq_len=c.seq_len, seed=c.seed
            )
            cache.append(ids)
        return cache[0]

    return tokens


def _check_parallel_sizes(graph: Graph, size: int, stages: int) -> None:
    """Refuse a recipe whose default pipeline stages the built model cannot be cut into, or whose default
    tensor-parallel size a stage cannot be split into: no engine could load the artifact with its own default."""
    try:
        plan = plan_stages(graph, stages)
    except StageError as e:
        raise StageError(f"runtime.pipeline_parallel_size {stages}: {e}") from None
    try:
        for stage in range(stages):
            for rank in range(size):
                plan_shards(stage_graph(graph, plan, stage), rank, size)
    except ShardError as e:
        raise ShardError(f"runtime.tensor_parallel_size {size}: {e}") from None


def _toolchain() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:  # the installed version, without importing triton (a CPU build never does)
        versions["triton"] = version("triton")
    except PackageNotFoundError:
        versions["triton"] = None
    return versions
