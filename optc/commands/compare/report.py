"""Report writers of `optc compare` for people: compare.md (the tables) and a self-contained
report.html (the same tables and the PNG plots embedded as base64). compare.json, written by
`run_compare`, is the source of truth; both are rendered from it and from nothing else.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from optc.commands.compare.plots import size_text
from optc.commands.compare.verdicts import NO_EFFECT

MIB = 2**20


def markdown(report: dict) -> str:
    """The report's tables as GitHub Markdown."""
    s = report["settings"]
    sizes = [str(b) for b in s["batch_sizes"]]
    largest = sizes[-1] if sizes else None
    has_ref = report["variants"][0]["quality"]["kld"] is not None
    lines = [
        f"# optc compare: `{report['recipe']}` ({report['mode']})",
        "",
        f"Model `{report['model']}`; quality against `{report['reference']}` on {s['data']} "
        f"({report['variants'][0]['quality']['tokens']} scored tokens in "
        f"{report['variants'][0]['quality']['num_windows']} windows of {s['window']}); speed: "
        f"{s['num_requests']} requests of {s['input_len']} prompt + {s['output_len']} output tokens at batch sizes "
        f"{', '.join(sizes)}, {s['repeats']} repeats. Intervals: bootstrap 95% over windows (quality), "
        "[min, max] over repeats (speed, memory). Deltas are against "
        f"`{report['baseline_variant']}`; \"{NO_EFFECT}\" means the interval or band holds zero.",
        "",
    ]
    head = ["variant", "edits", "ppl [95% CI]"]
    if has_ref:
        head += ["KL nats/token [95% CI]", "top-1 agreement [95% CI]"]
    head += [f"output tok/s @{b} [min-max]" for b in sizes]
    if largest:
        head += [f"TTFT p50 ms @{largest}", f"TPOT p50 ms @{largest}"]
    head += ["weights MiB", "artifact MiB", "peak memory MiB", "build s", "Pareto"]
    body = []
    for v in report["variants"]:
        q = v["quality"]
        row = [f"`{v['name']}`", "; ".join(v["edits"]), _ci(q["ppl"], "{:.3f}")]
        if has_ref:
            row += [_ci(q["kld"], "{:.4f}"), _ci(q["top1_agreement"], "{:.3f}")]
        row += [_band(v["speed"][b]["output_tokens_per_s"], "{:.1f}") for b in sizes]
        if largest:
            row += [_band(v["speed"][largest]["ttft_p50_ms"], "{:.0f}"),
                    _band(v["speed"][largest]["tpot_p50_ms"], "{:.1f}")]
        row += [f"{v['size']['weight_bytes'] / MIB:.1f}", f"{v['size']['artifact_bytes'] / MIB:.1f}",
                _band({k: x / MIB if isinstance(x, int | float) else x for k, x in v["peak_memory_bytes"].items()},
                      "{:.0f}"),
                f"{v['build_seconds']:.1f}{' (cached)' if v['is_cached'] else ''}",
                "front" if v["pareto"]["is_front"] else f"dominated by `{v['pareto']['dominated_by']}`"]
        body.append(row)
    lines += _table(head, body)
    lines += ["", f"## Effect against `{report['baseline_variant']}`", ""]
    effect_keys = ["ppl"] + (["kld", "top1_agreement"] if has_ref else [])
    effect_keys += [f"output_tokens_per_s@{b}" for b in sizes] + ["weight_bytes", "peak_memory_bytes"]
    names = {"ppl": "ppl", "kld": "KL", "top1_agreement": "top-1", "weight_bytes": "weights",
             "peak_memory_bytes": "peak memory"}
    head = ["variant", "pass"] + [names.get(k, k.replace("output_tokens_per_s@", "tok/s @")) for k in effect_keys]
    body = []
    for v in report["variants"]:
        if v["name"] == report["baseline_variant"]:
            continue
        body.append([f"`{v['name']}`", f"`{v['pass']}`" if v["pass"] else ""] +
                    [_effect(v["effect"][k], k) for k in effect_keys])
    lines += _table(head, body) if body else ["(no variant besides the baseline)"]
    p = report["pareto"]
    lines += ["", f"Pareto front over ({p['quality']}, {p['speed']}, {p['size']}): "
              + ", ".join(f"`{v['name']}`" for v in report["variants"] if v["pareto"]["is_front"]) + "."]
    if report["skipped"]:
        lines += ["", "Skipped:"] + [f"- `{s['name']}`: {s['reason']}" for s in report["skipped"]]
    e = report["environment"]
    gpu = f", {e['gpu']}" if e.get("gpu") else ""
    load = e.get("load_average_1min")
    load_text = f"; 1-minute load average {load['start']:.1f} at the start, {load['end']:.1f} at the end" \
        if load else ""
    lines += ["", f"Measured on {e['device']} ({e['cpu_count']} CPUs, {e.get('torch_threads', '?')} torch threads, "
              f"{e['platform']}{gpu}{load_text}), "
              f"python {e['python']}, torch {e['torch']}, transformers {e['transformers']}, "
              f"triton {e['triton']}, optc {e['optc']}; the whole comparison took {report.get('seconds', 0):.0f} s."]
    return "\n".join(lines) + "\n"


def write_markdown(report: dict, path: Path) -> Path:
    Path(path).write_text(markdown(report))
    return Path(path)


def write_html(report: dict, plots: list[Path], path: Path) -> Path:
    """One self-contained page: the Markdown tables as HTML tables and every plot inline."""
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>optc compare</title><style>",
             "body{font-family:system-ui,sans-serif;max-width:1400px;margin:2em auto;padding:0 1em}"
             "table{border-collapse:collapse;font-size:13px;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}"
             "td:first-child,th:first-child{text-align:left}img{max-width:100%;margin:1em 0}",
             "</style></head><body>"]
    table: list[str] = []
    for line in markdown(report).splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("-: "):
                continue
            tag = "th" if not table else "td"
            table.append("<tr>" + "".join(f"<{tag}>{_inline(c)}</{tag}>" for c in cells) + "</tr>")
            continue
        if table:
            parts.append("<table>" + "".join(table) + "</table>")
            table = []
        if line.startswith("# "):
            parts.append(f"<h1>{_inline(line[2:])}</h1>")
        elif line.startswith("## "):
            parts.append(f"<h2>{_inline(line[3:])}</h2>")
        elif line.startswith("- "):
            parts.append(f"<li>{_inline(line[2:])}</li>")
        elif line.strip():
            parts.append(f"<p>{_inline(line)}</p>")
    if table:
        parts.append("<table>" + "".join(table) + "</table>")
    parts.append("<h2>Plots</h2>")
    for plot in plots:
        data = base64.b64encode(Path(plot).read_bytes()).decode()
        parts.append(f"<img alt='{html.escape(plot.stem)}' src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    Path(path).write_text("\n".join(parts) + "\n")
    return Path(path)


def _ci(metric: dict | None, fmt: str) -> str:
    if metric is None:
        return ""
    lo, hi = metric["ci95"]
    return f"{fmt.format(metric['value'])} [{fmt.format(lo)}, {fmt.format(hi)}]"


def _band(b: dict, fmt: str) -> str:
    return f"{fmt.format(b['median'])} [{fmt.format(b['min'])}-{fmt.format(b['max'])}]"


def _effect(e: dict, key: str) -> str:
    if e["verdict"] == NO_EFFECT:
        return NO_EFFECT
    delta = e["delta"]
    if key in ("weight_bytes", "peak_memory_bytes"):
        text = ("+" if delta >= 0 else "-") + size_text(abs(delta))
    elif key == "top1_agreement" or key == "kld":
        text = f"{delta:+.4f}"
    else:
        text = f"{delta:+.3g}"
    if e.get("relative") is not None and key != "kld":
        text += f" ({e['relative']:+.1%})"
    return f"{text} {e['verdict']}"


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"] + [
        "| " + " | ".join(r) + " |" for r in body]


def _inline(text: str) -> str:
    out = html.escape(text)
    parts = out.split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
