"""PNG plots of an `optc compare` report (matplotlib, Agg backend: no display needed).

quality_vs_speed.png: quality (KL against the reference, or perplexity without one; lower is
better) against output tokens/s at the largest batch size, error bars from the intervals, the
Pareto front marked and joined. One bar chart per metric, error bars from the same intervals and
bands: perplexity, KL, top-1 agreement, output tokens/s (grouped by batch size), TTFT and TPOT p50,
weight bytes, peak memory, build time. Everything is read from the report dict (compare.json).
"""

from __future__ import annotations

from pathlib import Path

MIB = 2**20


def write_plots(report: dict, out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        from optc.errors import UserError

        raise UserError("optc compare draws its plots with matplotlib: pip install 'optc[compare]'") from None
    matplotlib.use("Agg")
    out = Path(out)
    variants = report["variants"]
    names = [v["name"] for v in variants]
    sizes = [str(b) for b in report["settings"]["batch_sizes"]]
    has_ref = variants[0]["quality"]["kld"] is not None
    paths = [_quality_vs_speed(report, out / "quality_vs_speed.png")]
    paths.append(_bars(out / "ppl.png", names, [v["quality"]["ppl"] for v in variants], _ci,
                       "Perplexity on held-out text (lower is better)", "perplexity"))
    if has_ref:
        paths.append(_bars(out / "kld.png", names, [v["quality"]["kld"] for v in variants], _ci,
                           "KL divergence vs reference (lower is better)", "KL (nats/token)"))
        paths.append(_bars(out / "top1_agreement.png", names, [v["quality"]["top1_agreement"] for v in variants],
                           _ci, "Top-1 agreement with reference (higher is better)", "share of tokens"))
    paths.append(_grouped(out / "output_tokens_per_s.png", names, sizes,
                          {b: [v["speed"][b]["output_tokens_per_s"] for v in variants] for b in sizes},
                          "Output throughput (higher is better)", "output tokens/s"))
    paths.append(_grouped(out / "ttft_p50_ms.png", names, sizes,
                          {b: [v["speed"][b]["ttft_p50_ms"] for v in variants] for b in sizes},
                          "Time to first token, p50 (lower is better)", "TTFT p50 (ms)"))
    paths.append(_grouped(out / "tpot_p50_ms.png", names, sizes,
                          {b: [v["speed"][b]["tpot_p50_ms"] for v in variants] for b in sizes},
                          "Time per output token, p50 (lower is better)", "TPOT p50 (ms)"))
    paths.append(_bars(out / "weight_bytes.png", names,
                       [{"value": v["size"]["weight_bytes"] / MIB} for v in variants], lambda m: None,
                       "Weight bytes (exact)", "weights (MiB)"))
    paths.append(_bars(out / "peak_memory.png", names,
                       [{k: x / MIB for k, x in v["peak_memory_bytes"].items() if k != "values"} for v in variants],
                       _band, "Peak memory of the speed runs (lower is better)", "peak memory (MiB)"))
    paths.append(_bars(out / "build_seconds.png", names, [{"value": v["build_seconds"]} for v in variants],
                       lambda m: None, "Build time (one build; cached variants show the recorded time)",
                       "build time (s)"))
    return paths


def _quality_vs_speed(report: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    variants = report["variants"]
    key = report["pareto"]["quality"]
    largest = report["pareto"]["speed"].split("@")[1]
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    front = []
    for i, v in enumerate(variants):
        q, s = v["quality"][key], v["speed"][largest]["output_tokens_per_s"]
        lo, hi = q["ci95"]
        is_front = v["pareto"]["is_front"]
        ax.errorbar(s["median"], q["value"], xerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]],
                    yerr=[[q["value"] - lo], [hi - q["value"]]], fmt="*" if is_front else "o",
                    markersize=13 if is_front else 8, color="tab:red" if is_front else "tab:gray", capsize=3)
        ax.annotate(f"{v['name']} ({size_text(v['size']['weight_bytes'])})", (s["median"], q["value"]),
                    textcoords="offset points", xytext=(8, 6 - 14 * (i % 3)), fontsize=9)
        if is_front:
            front.append((s["median"], q["value"]))
    if len(front) > 1:
        xs, ys = zip(*sorted(front), strict=True)
        ax.plot(xs, ys, "--", color="tab:red", linewidth=1)
    ax.plot([], [], "*", color="tab:red", markersize=13, label="Pareto front (quality, speed, size)")
    ax.plot([], [], "o", color="tab:gray", markersize=8, label="dominated")
    label = "KL divergence vs reference (nats/token)" if key == "kld" else "perplexity"
    ax.set_xlabel(f"output tokens/s at batch size {largest} (median, bar: min-max over repeats)")
    ax.set_ylabel(f"{label}, 95% CI (lower is better)")
    ax.set_title(f"Quality vs speed: {Path(report['recipe']).name} ({report['mode']})")
    ax.legend(loc="best", fontsize=9)
    ax.grid(alpha=0.3)
    ax.margins(x=0.25, y=0.15)
    return _save(fig, path)


def _bars(path: Path, names: list[str], metrics: list[dict], interval, title: str, ylabel: str) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names) + 2), 4.5), dpi=110)
    values = [m["value"] if "value" in m else m["median"] for m in metrics]
    bounds = [interval(m) for m in metrics]
    err = None
    if all(b is not None for b in bounds):
        err = [[v - b[0] for v, b in zip(values, bounds, strict=True)],
               [b[1] - v for v, b in zip(values, bounds, strict=True)]]
    ax.bar(range(len(names)), values, yerr=err, capsize=4, color="tab:blue", alpha=0.8)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title + ("" if err is None else "\nerror bars: 95% CI (quality) or min-max over repeats"),
                 fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    for i, v in enumerate(values):
        ax.annotate(f"{v:.4g}", (i, v), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    return _save(fig, path)


def _grouped(path: Path, names: list[str], sizes: list[str], bands: dict[str, list[dict]], title: str,
             ylabel: str) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(names) + 2), 4.5), dpi=110)
    width = 0.8 / max(1, len(sizes))
    for j, b in enumerate(sizes):
        xs = [i + (j - (len(sizes) - 1) / 2) * width for i in range(len(names))]
        med = [x["median"] for x in bands[b]]
        err = [[m - x["min"] for m, x in zip(med, bands[b], strict=True)],
               [x["max"] - m for m, x in zip(med, bands[b], strict=True)]]
        ax.bar(xs, med, width, yerr=err, capsize=3, label=f"batch size {b}")
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title + "\nmedian over repeats, error bars: min-max", fontsize=10)
    ax.legend(fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def size_text(num_bytes: float) -> str:
    return f"{num_bytes / MIB:.1f} MiB" if abs(num_bytes) >= MIB / 10 else f"{num_bytes / 1024:.1f} KiB"


def _ci(metric: dict) -> list[float]:
    return metric["ci95"]


def _band(metric: dict) -> list[float]:
    return [metric["min"], metric["max"]]


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
