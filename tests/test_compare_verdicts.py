"""optc compare verdicts on synthetic numbers: intervals, "no measurable effect", Pareto front, gate."""

import math

import pytest

from optc.commands.compare import verdicts as V


def _windows(nlls, klds=None, agrees=None, n=100):
    klds = klds or [0.0] * len(nlls)
    agrees = agrees or [n] * len(nlls)
    return [{"nll": a * n, "reference_nll": 2.0 * n, "kld": k * n, "num_agree": g, "num_tokens": n}
            for a, k, g in zip(nlls, klds, agrees, strict=True)]


BASE_NLL = [2.0, 2.4, 1.8, 2.2, 2.6, 1.9, 2.1, 2.3, 2.0, 2.5, 1.7, 2.2]


def test_quality_value_is_token_weighted_like_optc_eval():
    rows = _windows([1.0, 3.0]) + [{"nll": 0.0, "reference_nll": 0.0, "kld": 0.0, "num_agree": 0, "num_tokens": 200}]
    assert V.quality_value(rows, "ppl") == pytest.approx(math.exp(400 / 400))
    assert V.quality_value(rows, "top1_agreement") == pytest.approx(200 / 400)


def test_bootstrap_interval_holds_the_value_and_narrows_without_spread():
    lo, hi = V.bootstrap_interval(_windows(BASE_NLL), "ppl")
    value = V.quality_value(_windows(BASE_NLL), "ppl")
    assert lo < value < hi
    assert V.bootstrap_interval(_windows([2.0] * 12), "ppl") == pytest.approx([math.exp(2.0)] * 2)


def test_a_shift_smaller_than_the_window_noise_is_no_measurable_effect():
    # per-window differences of +-0.05 around 0: the paired interval holds 0
    noisy = [a + (0.05 if i % 2 else -0.05) for i, a in enumerate(BASE_NLL)]
    d = V.paired_delta(_windows(BASE_NLL), _windows(noisy), "ppl")
    assert d["ci95"][0] < 0 < d["ci95"][1]
    assert d["verdict"] == V.NO_EFFECT


def test_a_consistent_shift_is_measured_even_under_large_window_variance():
    # every window +0.01 nats: tiny next to the spread between windows, but paired it is certain
    worse = [a + 0.01 for a in BASE_NLL]
    d = V.paired_delta(_windows(BASE_NLL), _windows(worse), "ppl")
    assert d["ci95"][0] > 0 and d["verdict"] == "worse"
    assert d["delta"] == pytest.approx(V.quality_value(_windows(worse), "ppl") - V.quality_value(_windows(BASE_NLL),
                                                                                                  "ppl"))
    better = V.paired_delta(_windows(worse), _windows(BASE_NLL), "ppl")
    assert better["verdict"] == "better"
    agree = V.paired_delta(_windows(BASE_NLL, agrees=[90] * 12), _windows(BASE_NLL, agrees=[95] * 12),
                           "top1_agreement")
    assert agree["verdict"] == "better" and agree["delta"] == pytest.approx(0.05)


def test_noise_bands():
    base = V.band([10.0, 12.0, 11.0])
    assert base == {"median": 11.0, "min": 10.0, "max": 12.0, "values": [10.0, 12.0, 11.0]}
    assert V.band([1.0, 4.0])["median"] == 2.5
    overlapping = V.band([11.5, 13.0, 12.5])
    assert V.band_delta(base, overlapping, is_lower_better=False)["verdict"] == V.NO_EFFECT
    faster = V.band([12.5, 13.0, 14.0])
    assert V.band_delta(base, faster, is_lower_better=False)["verdict"] == "better"
    assert V.band_delta(base, faster, is_lower_better=True)["verdict"] == "worse"
    assert V.band_delta(faster, base, is_lower_better=False)["delta"] == pytest.approx(-2.0)


def test_sizes_are_exact_with_a_header_tolerance():
    assert V.exact_delta(1000, 1004, True)["verdict"] == V.NO_EFFECT
    assert V.exact_delta(1000, 500, True) == {"delta": -500, "relative": -0.5, "verdict": "better"}
    assert V.exact_delta(1000, 2000, True)["verdict"] == "worse"


def _point(name, shift, speed, size):
    return V.Point(name, _windows([a + shift for a in BASE_NLL]), V.band(speed), size)


def test_pareto_front_and_who_dominates():
    points = [
        _point("fast-big", 0.0, [100, 101, 102], 1000),
        _point("slow-small", 0.5, [50, 51, 52], 250),
        _point("dominated", 0.5, [60, 61, 62], 1000),  # worse quality than fast-big, slower, same size
        _point("noisy-twin", 0.0, [95, 101, 110], 1000),  # fast-big within noise on every axis
    ]
    front = V.pareto(points, "ppl")
    assert front["dominated"] == "fast-big"
    assert front["fast-big"] is None and front["slow-small"] is None
    assert front["noisy-twin"] is None  # equal within noise is not dominated


def test_pareto_on_kl():
    a = V.Point("a", _windows(BASE_NLL, klds=[0.1] * 12), V.band([10, 11]), 100)
    b = V.Point("b", _windows(BASE_NLL, klds=[0.3] * 12), V.band([10, 11]), 100)
    assert V.pareto([a, b], "kld") == {"a": None, "b": "a"}


def _report(ppl, tok_s):
    return {"variants": [{"name": "base", "quality": {"ppl": {"value": ppl}},
                          "speed": {"1": {"output_tokens_per_s": {"median": tok_s}}}}]}


def test_gate_names_every_regression():
    baseline = _report(10.0, 100.0)
    assert V.gate(_report(10.4, 95.0), baseline, max_ppl_increase=5, min_speed_ratio=0.9) == []
    problems = V.gate(_report(11.0, 80.0), baseline, max_ppl_increase=5, min_speed_ratio=0.9)
    assert len(problems) == 2
    assert problems[0].startswith("base: perplexity 10 -> 11 (+10.00%, allowed +5%)")
    assert problems[1].startswith("base: output tok/s at batch size 1 100 -> 80 (x0.800, allowed x0.9)")
    assert V.gate(_report(11.0, 80.0), baseline, max_ppl_increase=None, min_speed_ratio=0.9) == [problems[1]]


def test_a_gate_that_compares_nothing_fails_naming_both_sides():
    baseline = _report(10.0, 100.0)
    renamed = {"variants": [{**_report(99.0, 1.0)["variants"][0], "name": "other"}]}
    assert V.gate(renamed, baseline, 5, 0.9) == [
        "no variant of this run matches a baseline variant by name (this run: ['other']; baseline: ['base']): "
        "nothing was compared"]
    other_size = {"variants": [{**baseline["variants"][0], "speed": {"4": {"output_tokens_per_s": {"median": 1}}}}]}
    assert V.gate(other_size, baseline, None, 0.9) == [
        "no batch size is measured in both runs (this run: ['4']; baseline: ['1']): speed was not compared"]
    assert V.gate(other_size, baseline, 5, None) == []  # perplexity alone was compared, and held


def test_labels_of_nearly_equal_points_do_not_overlap():
    from optc.commands.compare.plots import MARKER_PT, label_offsets

    anchors = [(173.0, 291.0), (166.0, 280.0), (169.0, 291.0), (170.0, 290.0), (391.0, 79.0)]
    sizes = [(80.0, 11.0), (106.0, 11.0), (126.0, 11.0), (90.0, 11.0), (126.0, 11.0)]
    bars = [(145.0, 287.0, 177.0, 295.0), (165.0, 260.0, 173.0, 318.0)]
    offsets = label_offsets(anchors, sizes, bars)
    boxes = [(x + dx, y + dy, x + dx + w, y + dy + h)
             for (x, y), (w, h), (dx, dy, _) in zip(anchors, sizes, offsets, strict=True)]
    markers = [(x - MARKER_PT, y - MARKER_PT, x + MARKER_PT, y + MARKER_PT) for x, y in anchors]

    def overlap(a, b):
        return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]

    for i, box in enumerate(boxes):
        assert not any(overlap(box, other) for other in boxes[i + 1:]), (i, boxes)
        assert not any(overlap(box, m) for m in markers), (i, box)
        assert not any(overlap(box, b) for b in bars), (i, box)
    assert offsets[-1] == (MARKER_PT + 2, 2, False)  # a point alone keeps the nearest place, no leader line
