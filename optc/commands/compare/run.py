"""`optc compare`: variants of one recipe built (cached), measured and judged side by side.

Order of work: resolve the recipe, expand and validate every variant, read the baseline of the
gate (all user errors surface here, before anything is built), build each variant through the
cache, score quality on shared windows, benchmark speed, then judge (effects against the
comparison's baseline variant, Pareto front) and write compare.json, compare.md, the plots and
report.html into `out`. With a gate baseline, the result lists every regression.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from optc.commands.compare import verdicts as V
from optc.commands.compare.cache import build_cached, default_cache_dir
from optc.commands.compare.measure import SpeedSettings, artifact_sizes, environment, measure_quality, measure_speed
from optc.commands.compare.variants import Mode, expand
from optc.core.artifact import read
from optc.core.errors import UserError
from optc.frontend.passmanager import PassError
from optc.frontend.recipe import load_recipe

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class CompareOptions:
    recipe: Path
    mode: Mode = Mode.LEAVE_ONE_OUT
    variants_file: Path | None = None
    model: str | None = None
    overrides: tuple[str, ...] = ()
    reference: str | None = None  # default: the base recipe's model source, unoptimized
    data: str = "builtin:pydoc-heldout"
    eval_tokens: int = 4096
    window: int = 256
    speed: SpeedSettings = field(default_factory=SpeedSettings)
    out: Path = Path("compare")
    cache_dir: Path | None = None  # default: $OPTC_CACHE/compare
    baseline: Path | None = None  # a compare.json to gate against
    max_ppl_increase: float | None = None  # percent
    min_speed_ratio: float | None = None
    show_progress: bool = True


@dataclass(frozen=True)
class CompareResult:
    report: dict  # what compare.json holds
    files: tuple[Path, ...]
    regressions: tuple[str, ...]  # empty without a gate, or when nothing regressed


def run_compare(options: CompareOptions) -> CompareResult:
    from optc.commands.compare.plots import write_plots
    from optc.commands.compare.report import write_html, write_markdown

    o = options
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    base = load_recipe(o.recipe, list(o.overrides), o.model)
    if base.model is None:
        raise UserError(f"{o.recipe}: no model to build: set `model:` in the recipe or pass --model")
    expansion = expand(base, o.mode, o.variants_file)
    gate_baseline = _read_gate_baseline(o)
    if o.eval_tokens < o.window * 2:
        raise UserError(f"--eval-tokens {o.eval_tokens}: needs at least 2 windows of {o.window} tokens "
                        "(the intervals bootstrap over windows)")
    from optc.frontend.sources import load_source

    records = {}
    for m in sorted({v.recipe.model for v in expansion.variants}):
        records[m] = load_source(m).record
    cache_dir = Path(o.cache_dir) if o.cache_dir else default_cache_dir()
    built, failed = {}, []
    bar = tqdm(expansion.variants, desc="builds", unit="variant", disable=not o.show_progress)
    for v in bar:
        bar.set_postfix_str(v.name)
        try:
            built[v.name] = build_cached(cache_dir, v.recipe, records[v.recipe.model], quiet=not o.show_progress)
        except PassError as e:  # a variant whose passes cannot run is reported, not fatal
            if v.name == expansion.baseline:
                raise
            failed.append({"name": v.name, "reason": f"build failed: {str(e).splitlines()[0]}"})
    variants = [v for v in expansion.variants if v.name in built]
    reference = o.reference or base.model
    quality = measure_quality({v.name: built[v.name].artifact for v in variants}, reference, o.data,
                              o.eval_tokens, o.window, o.show_progress)
    speed = {v.name: measure_speed(built[v.name].artifact, o.speed, v.name, o.show_progress) for v in variants}
    rows = []
    for v in variants:
        b = built[v.name]
        manifest = read(b.artifact, verify=False).manifest
        rows.append({
            "name": v.name, "edits": list(v.edits), "pass": v.pass_name, "recipe": v.recipe.to_json(),
            "recipe_sha256": manifest.recipe_sha256, "artifact": str(b.artifact), "cache_key": b.key,
            "is_cached": b.is_hit, "build_seconds": round(b.build_seconds, 3),
            "tensor_parallel_size": manifest.runtime.tensor_parallel_size,  # what eval and bench split it over
            "pipeline_parallel_size": manifest.runtime.pipeline_parallel_size,  # stages bench runs it in
            "quality": _quality(quality[v.name]),
            "speed": _speed(speed[v.name], o.speed.batch_sizes),
            "peak_memory_bytes": V.band([r["peak_memory_bytes"] for r in speed[v.name]]),
            "size": artifact_sizes(b.artifact),
        })
    report = {
        "schema_version": SCHEMA_VERSION,
        "recipe": str(o.recipe), "overrides": list(o.overrides), "model": base.model, "mode": o.mode.value,
        "baseline_variant": expansion.baseline, "reference": reference,
        "settings": {"data": o.data, "eval_tokens": o.eval_tokens, "window": o.window,
                     "num_bootstrap": V.NUM_BOOTSTRAP, **asdict(o.speed)},
        "environment": {**environment(o.speed.device),
                        "load_average_1min": {"start": load_start, "end": os.getloadavg()[0]}},
        "skipped": [asdict(s) for s in expansion.skipped] + failed,
        "variants": rows,
    }
    judge(report)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(report, indent=1) + "\n")
    files = [out / "compare.json", write_markdown(report, out / "compare.md")]
    plots = write_plots(report, out)
    files += plots + [write_html(report, plots, out / "report.html")]
    regressions = V.gate(report, gate_baseline, o.max_ppl_increase, o.min_speed_ratio) if gate_baseline else []
    return CompareResult(report, tuple(files), tuple(regressions))


def judge(report: dict) -> None:
    """Add to each variant its effect against the baseline variant and its place on the Pareto front."""
    rows = {v["name"]: v for v in report["variants"]}
    base = rows[report["baseline_variant"]]
    has_ref = base["quality"]["kld"] is not None
    for v in report["variants"]:
        effect = {}
        for m in V.QUALITY_METRICS:
            if v["quality"][m.key] is not None:
                effect[m.key] = V.paired_delta(base["quality"]["windows"], v["quality"]["windows"], m.key)
        for size, s in v["speed"].items():
            bs = base["speed"][size]
            effect[f"output_tokens_per_s@{size}"] = V.band_delta(bs["output_tokens_per_s"],
                                                                 s["output_tokens_per_s"], False)
            effect[f"ttft_p50_ms@{size}"] = V.band_delta(bs["ttft_p50_ms"], s["ttft_p50_ms"], True)
            effect[f"tpot_p50_ms@{size}"] = V.band_delta(bs["tpot_p50_ms"], s["tpot_p50_ms"], True)
        effect["weight_bytes"] = V.exact_delta(base["size"]["weight_bytes"], v["size"]["weight_bytes"], True)
        effect["peak_memory_bytes"] = V.band_delta(base["peak_memory_bytes"], v["peak_memory_bytes"], True)
        v["effect"] = effect
    largest = str(max(int(s) for s in base["speed"]))
    key = "kld" if has_ref else "ppl"
    points = [V.Point(v["name"], v["quality"]["windows"], v["speed"][largest]["output_tokens_per_s"],
                      v["size"]["weight_bytes"]) for v in report["variants"]]
    front = V.pareto(points, key)
    report["pareto"] = {"quality": key, "speed": f"output_tokens_per_s@{largest}", "size": "weight_bytes"}
    for v in report["variants"]:
        v["pareto"] = {"is_front": front[v["name"]] is None, "dominated_by": front[v["name"]]}


def _quality(windows: list[dict]) -> dict:
    has_ref = any(w["num_agree"] or w["reference_nll"] for w in windows)
    out: dict = {"windows": windows, "num_windows": len(windows), "tokens": sum(w["num_tokens"] for w in windows)}
    for key in ("ppl", "reference_ppl", "kld", "top1_agreement"):
        if key != "ppl" and not has_ref:
            out[key] = None
            continue
        out[key] = {"value": V.quality_value(windows, key), "ci95": V.bootstrap_interval(windows, key)}
    return out


def _speed(repeats: list[dict], batch_sizes: tuple[int, ...]) -> dict:
    out = {}
    for b in batch_sizes:
        runs = [r["batch_sizes"][str(b)] for r in repeats]
        out[str(b)] = {
            "output_tokens_per_s": V.band([r["output_tokens_per_s"] for r in runs]),
            "ttft_p50_ms": V.band([r["ttft_ms"]["p50"] for r in runs]),
            "tpot_p50_ms": V.band([r["tpot_ms"]["p50"] for r in runs]),
        }
    return out


def _read_gate_baseline(o: CompareOptions) -> dict | None:
    thresholds = (o.max_ppl_increase, o.min_speed_ratio)
    if o.baseline is None:
        if any(t is not None for t in thresholds):
            raise UserError("--max-ppl-increase / --min-speed-ratio need --baseline compare.json to compare with")
        return None
    if all(t is None for t in thresholds):
        raise UserError(f"--baseline {o.baseline}: give --max-ppl-increase PCT and/or --min-speed-ratio X")
    path = Path(o.baseline)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"--baseline {path}: not a readable compare.json ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION or "variants" not in data:
        raise UserError(f"--baseline {path}: not a compare.json of schema version {SCHEMA_VERSION}")
    return data
