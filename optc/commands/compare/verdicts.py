"""Verdicts of `optc compare`: intervals, noise bands, effects against the baseline, the Pareto front,
and the CI gate. Pure functions of the measured numbers (tests feed them synthetic ones).

- Quality (ppl, KL, top-1 agreement) gets a bootstrap 95% interval over evaluation windows
  (`NUM_BOOTSTRAP` resamples of the windows with replacement, seeded, percentile interval). A
  difference between two variants is bootstrapped paired: the same resampled windows for both, so
  the text's own variance cancels. A difference whose interval holds 0 is "no measurable effect".
- Speed, latency and memory are repeated: the noise band is [min, max] over the repeats; two bands
  that overlap are "no measurable effect". Sizes are exact; a change under 0.5% of the base
  (SIZE_TOLERANCE: safetensors header bytes) counts as none.
- Pareto front over (quality, speed, size): quality is KL against the reference (perplexity without
  a reference), speed the median output tokens/s at the largest batch size, size the weight bytes.
  A dominates B when A is measurably better in one and measurably worse in none; the front is the
  variants nothing dominates, and each dominated variant names one that dominates it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch

NUM_BOOTSTRAP = 2000
SEED = 0
NO_EFFECT = "no measurable effect"
SIZE_TOLERANCE = 0.005  # relative: a few header bytes of a safetensors file are no effect of a pass


class Verdict(StrEnum):
    BETTER = "better"
    WORSE = "worse"
    NONE = NO_EFFECT


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    is_lower_better: bool


QUALITY_METRICS = (
    Metric("ppl", "perplexity", "", True),
    Metric("kld", "KL divergence vs reference", "nats/token", True),
    Metric("top1_agreement", "top-1 agreement with reference", "share", False),
)


def quality_value(rows: list[dict], key: str) -> float | None:
    """The metric over windows (token-weighted sums, as `optc eval` computes it); None if unmeasured."""
    t = _table(rows)
    return float(_metric(t, key, torch.arange(len(rows))[None])[0])


def bootstrap_interval(rows: list[dict], key: str) -> list[float]:
    """95% percentile interval of the metric over windows resampled with replacement."""
    t = _table(rows)
    return _percentiles(_metric(t, key, _indices(len(rows))))


def paired_delta(base_rows: list[dict], rows: list[dict], key: str) -> dict:
    """Variant minus base on the same windows: {delta, ci95, relative, verdict}."""
    if len(base_rows) != len(rows):
        raise ValueError(f"paired bootstrap needs the same windows: {len(base_rows)} != {len(rows)}")
    idx = _indices(len(rows))
    tb, tv = _table(base_rows), _table(rows)
    every = torch.arange(len(rows))[None]
    point = float(_metric(tv, key, every)[0] - _metric(tb, key, every)[0])
    lo, hi = _percentiles(_metric(tv, key, idx) - _metric(tb, key, idx))
    lower = next(m.is_lower_better for m in QUALITY_METRICS if m.key == key)
    base_value = quality_value(base_rows, key)
    return {"delta": point, "ci95": [lo, hi], "relative": point / base_value if base_value else None,
            "verdict": _interval_verdict(lo, hi, lower)}


def band(values: list[float]) -> dict:
    """{median, min, max, values}: the noise band of repeated measurements."""
    ordered = sorted(values)
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return {"median": median, "min": ordered[0], "max": ordered[-1], "values": list(values)}


def band_delta(base: dict, other: dict, is_lower_better: bool) -> dict:
    """Median difference and verdict: overlapping [min, max] bands are no measurable effect."""
    delta = other["median"] - base["median"]
    if other["min"] > base["max"]:
        verdict = Verdict.WORSE if is_lower_better else Verdict.BETTER
    elif other["max"] < base["min"]:
        verdict = Verdict.BETTER if is_lower_better else Verdict.WORSE
    else:
        verdict = Verdict.NONE
    return {"delta": delta, "relative": delta / base["median"] if base["median"] else None,
            "verdict": verdict.value}


def exact_delta(base: float, other: float, is_lower_better: bool) -> dict:
    """Sizes: exact, so no noise; a change under SIZE_TOLERANCE of the base is no measurable effect."""
    delta = other - base
    verdict = Verdict.NONE if abs(delta) <= SIZE_TOLERANCE * abs(base) else (
        Verdict.BETTER if (delta < 0) == is_lower_better else Verdict.WORSE)
    return {"delta": delta, "relative": delta / base if base else None, "verdict": verdict.value}


@dataclass(frozen=True)
class Point:
    """A variant as the Pareto front sees it."""

    name: str
    quality_rows: list[dict]  # per-window sums (the quality axis is bootstrapped from them)
    speed: dict  # a band of output tokens/s
    size: int  # weight bytes


def compare_points(a: Point, b: Point, quality_key: str) -> list[Verdict]:
    """Verdicts of `a` against `b` on (quality, speed, size)."""
    q = Verdict(paired_delta(b.quality_rows, a.quality_rows, quality_key)["verdict"])
    s = Verdict(band_delta(b.speed, a.speed, is_lower_better=False)["verdict"])
    z = Verdict(exact_delta(b.size, a.size, is_lower_better=True)["verdict"])
    return [q, s, z]


def pareto(points: list[Point], quality_key: str) -> dict[str, str | None]:
    """name -> None on the front, else the name of a variant that dominates it (the first found)."""
    out: dict[str, str | None] = {}
    for b in points:
        out[b.name] = None
        for a in points:
            if a is b:
                continue
            verdicts = compare_points(a, b, quality_key)
            if Verdict.WORSE not in verdicts and Verdict.BETTER in verdicts:
                out[b.name] = a.name
                break
    return out


def gate(current: dict, baseline: dict, max_ppl_increase: float | None, min_speed_ratio: float | None) -> list[str]:
    """Every regression of `current` against `baseline` (both compare.json dicts), one line each.

    A variant regresses when its perplexity rose by more than `max_ppl_increase` percent over the
    same-named variant of the baseline, or its median output tokens/s at a batch size fell below
    `min_speed_ratio` times the baseline's. Variants missing from either side are not compared, but a gate
    that compares nothing (no variant name, or with `min_speed_ratio` no batch size, in common) fails too,
    naming both sides: a gate that passes must have checked something."""
    old = {v["name"]: v for v in baseline.get("variants", [])}
    matched = [v for v in current["variants"] if v["name"] in old]
    if not matched:
        return [f"no variant of this run matches a baseline variant by name (this run: "
                f"{[v['name'] for v in current['variants']]}; baseline: {list(old)}): nothing was compared"]
    if min_speed_ratio is not None and not any(set(v["speed"]) & set(old[v["name"]]["speed"]) for v in matched):
        return [f"no batch size is measured in both runs (this run: {sorted(matched[0]['speed'])}; baseline: "
                f"{sorted(old[matched[0]['name']]['speed'])}): speed was not compared"]
    problems = []
    for v in current["variants"]:
        b = old.get(v["name"])
        if b is None:
            continue
        if max_ppl_increase is not None:
            now, then = v["quality"]["ppl"]["value"], b["quality"]["ppl"]["value"]
            rise = (now / then - 1) * 100
            if rise > max_ppl_increase:
                problems.append(f"{v['name']}: perplexity {then:.4g} -> {now:.4g} (+{rise:.2f}%, "
                                f"allowed +{max_ppl_increase:g}%)")
        if min_speed_ratio is not None:
            for size, s in v["speed"].items():
                if size not in b["speed"]:
                    continue
                now, then = s["output_tokens_per_s"]["median"], b["speed"][size]["output_tokens_per_s"]["median"]
                if now < min_speed_ratio * then:
                    problems.append(f"{v['name']}: output tok/s at batch size {size} {then:.4g} -> {now:.4g} "
                                    f"(x{now / then:.3f}, allowed x{min_speed_ratio:g})")
    return problems


def _interval_verdict(lo: float, hi: float, is_lower_better: bool) -> str:
    if lo <= 0 <= hi:
        return Verdict.NONE.value
    increased = lo > 0
    return (Verdict.WORSE if increased == is_lower_better else Verdict.BETTER).value


def _table(rows: list[dict]) -> dict[str, torch.Tensor]:
    if not rows:
        raise ValueError("no evaluation windows")
    keys = ("nll", "reference_nll", "kld", "num_agree", "num_tokens")
    return {k: torch.tensor([float(r[k]) for r in rows], dtype=torch.float64) for k in keys}


def _metric(t: dict[str, torch.Tensor], key: str, idx: torch.Tensor) -> torch.Tensor:
    """The metric over the windows of each row of `idx` (R, W) -> (R,)."""
    count = t["num_tokens"][idx].sum(-1)
    if key == "ppl":
        return torch.exp(t["nll"][idx].sum(-1) / count)
    if key == "reference_ppl":
        return torch.exp(t["reference_nll"][idx].sum(-1) / count)
    if key == "kld":
        return t["kld"][idx].sum(-1) / count
    if key == "top1_agreement":
        return t["num_agree"][idx].sum(-1) / count
    raise KeyError(key)


def _indices(num_windows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, num_windows, (NUM_BOOTSTRAP, num_windows), generator=g)


def _percentiles(samples: torch.Tensor) -> list[float]:
    lo, hi = torch.quantile(samples, torch.tensor([0.025, 0.975], dtype=samples.dtype)).tolist()
    return [lo if math.isfinite(lo) else float("nan"), hi if math.isfinite(hi) else float("nan")]
