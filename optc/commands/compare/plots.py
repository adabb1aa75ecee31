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
        from optc.core.errors import UserError

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
    front, anchors, texts, bars = [], [], [], []
    for v in variants:
        q, s = v["quality"][key], v["speed"][largest]["output_tokens_per_s"]
        lo, hi = q["ci95"]
        is_front = v["pareto"]["is_front"]
        ax.errorbar(s["median"], q["value"], xerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]],
                    yerr=[[q["value"] - lo], [hi - q["value"]]], fmt="*" if is_front else "o",
                    markersize=13 if is_front else 8, color="tab:red" if is_front else "tab:gray", capsize=CAP_PT - 1)
        anchors.append((s["median"], q["value"]))
        bars += [((s["min"], q["value"]), (s["max"], q["value"])), ((s["median"], lo), (s["median"], hi))]
        texts.append(f"{v['name']} ({size_text(v['size']['weight_bytes'])})")
        if is_front:
            front.append((s["median"], q["value"]))
    ax.margins(x=0.25, y=0.15)
    fig.canvas.draw()  # fixes the axes limits, so data points map to their final place on the figure
    to_points = 72 / fig.dpi
    def pt(xy):
        return tuple(c * to_points for c in ax.transData.transform(xy))

    anchors_pt = [pt(a) for a in anchors]
    bars_pt = [(min(x0, x1) - CAP_PT, min(y0, y1) - CAP_PT, max(x0, x1) + CAP_PT, max(y0, y1) + CAP_PT)
               for (x0, y0), (x1, y1) in ((pt(a), pt(b)) for a, b in bars)]
    sizes_pt = [(LABEL_FONT * 0.56 * len(t), LABEL_FONT * 1.25) for t in texts]
    offsets = label_offsets(anchors_pt, sizes_pt, bars_pt)
    for anchor, text, (dx, dy, far) in zip(anchors, texts, offsets, strict=True):
        ax.annotate(text, anchor, textcoords="offset points", xytext=(dx, dy), va="bottom", fontsize=LABEL_FONT,
                    arrowprops={"arrowstyle": "-", "linewidth": 0.5, "color": "tab:gray"} if far else None)
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
    return _save(fig, path)


LABEL_FONT = 9
MARKER_PT = 7  # half the side of the box kept clear around every marker, in points
CAP_PT = 4  # error bars' caps (and the room kept clear around a bar), in points


def label_offsets(anchors: list[tuple[float, float]], sizes: list[tuple[float, float]],
                  obstacles: list[tuple[float, float, float, float]] = ()) -> list[tuple[float, float, bool]]:
    """Where each point's label goes, in points from its point: (dx, dy, far). Greedy: each label takes
    the first candidate box (right or left of its point, above or below, rows further out after the
    nearest) that overlaps no label placed before it, no marker and no obstacle (error bars);
    `far` labels get a leader line. Everything is in points on the figure: `anchors` (x, y), `sizes`
    (width, height), `obstacles` (x0, y0, x1, y1); a label box's lower-left corner is at (dx, dy)."""
    def clear(box, boxes):
        x0, y0, x1, y1 = box
        return all(x1 <= a0 or x0 >= a1 or y1 <= b0 or y0 >= b1 for a0, b0, a1, b1 in boxes)

    markers = [(x - MARKER_PT, y - MARKER_PT, x + MARKER_PT, y + MARKER_PT) for x, y in anchors]
    placed, out = [], []
    for (x, y), (w, h) in zip(anchors, sizes, strict=True):
        candidates = [((x + dx, y + dy, x + dx + w, y + dy + h), (dx, dy, row > 0)) for row in range(12)
                      for dx in (MARKER_PT + 2, -MARKER_PT - 2 - w)
                      for dy in (2 + row * h, -2 - h - row * h)]
        box, offset = next((c for c in candidates if all(clear(c[0], b) for b in (placed, markers, obstacles))),
                           candidates[0])
        placed.append(box)
        out.append(offset)
    return out

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
    for i, (v, b) in enumerate(zip(values, bounds, strict=True)):  # above the error bar, not on it
        top = v if b is None else max(v, b[1])
        ax.annotate(f"{v:.4g}", (i, top), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    ax.margins(y=0.08)
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
