"""optc compare end to end on random:tiny: reports written, PNGs readable, the build cache, the CLI gate."""

import dataclasses
import json
import multiprocessing

import pytest
from typer.testing import CliRunner

import optc.commands.compare
import optc.frontend.build
from optc.cli import app
from optc.commands.compare import CompareOptions, Mode, SpeedSettings, run_compare

pytest.importorskip("matplotlib")

TINY_SPEED = SpeedSettings(batch_sizes=(1, 2), num_requests=2, input_len=8, output_len=4, repeats=2,
                           is_isolated=False)


def _options(recipes, tmp, **kw) -> CompareOptions:
    return CompareOptions(recipes / "tiny.yaml", Mode.LEAVE_ONE_OUT, eval_tokens=256, window=64,
                          speed=TINY_SPEED, out=tmp / "out", cache_dir=tmp / "cache", show_progress=False, **kw)


@pytest.fixture(scope="module")
def first(recipes, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    return tmp, run_compare(_options(recipes, tmp))


def test_report_holds_every_measurement(first):
    tmp, result = first
    report = json.loads((tmp / "out" / "compare.json").read_text())
    assert report == json.loads(json.dumps(result.report))
    assert [v["name"] for v in report["variants"]] == ["base", "-fuse_qkv", "-fuse_gate_up"]
    assert report["baseline_variant"] == "base" and report["mode"] == "leave-one-out"
    assert {"torch", "transformers", "python", "device", "cpu_count"} <= set(report["environment"])
    for v in report["variants"]:
        q = v["quality"]
        assert q["num_windows"] == 4 and q["tokens"] == 4 * 63
        for key in ("ppl", "kld", "top1_agreement"):
            lo, hi = q[key]["ci95"]
            assert lo <= q[key]["value"] <= hi
        for size in ("1", "2"):
            assert len(v["speed"][size]["output_tokens_per_s"]["values"]) == 2
        assert v["size"]["weight_bytes"] > 0 and v["size"]["artifact_bytes"] > v["size"]["weight_bytes"]
        assert not v["is_cached"] and v["build_seconds"] > 0
    # fusions re-lay weights without changing the function: the reference (random:tiny) agrees
    for v in report["variants"]:
        assert v["quality"]["kld"]["value"] < 1e-6 and v["quality"]["top1_agreement"]["value"] == 1.0
        assert v["effect"]["ppl"]["verdict"] == "no measurable effect" or v["name"] == "base"
    assert any(v["pareto"]["is_front"] for v in report["variants"])
    for v in report["variants"]:
        assert v["pareto"]["is_front"] == (v["pareto"]["dominated_by"] is None)


def test_markdown_html_and_plots(first):
    tmp, result = first
    out = tmp / "out"
    names = {p.name for p in result.files}
    assert {"compare.json", "compare.md", "report.html", "quality_vs_speed.png", "ppl.png", "kld.png",
            "output_tokens_per_s.png", "weight_bytes.png", "peak_memory.png", "build_seconds.png"} <= names
    md = (out / "compare.md").read_text()
    assert "| `-fuse_qkv` | drop fuse_qkv |" in md and "## Effect against `base`" in md
    assert "Pareto front over (kld, output_tokens_per_s@2, weight_bytes)" in md
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == sum(p.suffix == ".png" for p in result.files)
    import matplotlib.image

    for png in (p for p in result.files if p.suffix == ".png"):
        image = matplotlib.image.imread(png)
        assert image.shape[0] > 300 and image.shape[1] > 500, png.name
        assert image[..., :3].std() > 0.05, f"{png.name} is blank"


def test_second_run_builds_nothing(first, recipes, monkeypatch):
    tmp, result = first
    monkeypatch.setattr(optc.frontend.build, "build", lambda *a, **k: pytest.fail("a cached variant was rebuilt"))
    again = run_compare(dataclasses.replace(_options(recipes, tmp), out=tmp / "again"))
    rows = again.report["variants"]
    assert all(v["is_cached"] for v in rows)
    assert [v["build_seconds"] for v in rows] == [v["build_seconds"] for v in result.report["variants"]]
    assert [v["artifact"] for v in rows] == [v["artifact"] for v in result.report["variants"]]


def test_cli_gate_exit_codes(first, recipes, monkeypatch, tmp_path):
    tmp, _ = first
    real = optc.commands.compare.run_compare
    # speed in this process (the CLI spawns a process per repeat), builds from the fixture's cache
    speed = dataclasses.replace(TINY_SPEED, repeats=1)
    monkeypatch.setattr(optc.commands.compare, "run_compare",
                        lambda o: real(dataclasses.replace(o, speed=speed, cache_dir=tmp / "cache")))
    variants = tmp_path / "v.yaml"
    variants.write_text("no-gate-up: [{drop: fuse_gate_up}]\n"  # gated: only `base`, the one name in common
                        "twice: [{add: {quantize_rtn: {bits: 8}}}, {add: {quantize_gptq: {bits: 4}}}]\n")
    args = ["compare", str(recipes / "tiny.yaml"), "--variants", str(variants), "--eval-tokens", "256",
            "--window", "64", "-q", "--baseline", str(tmp / "out" / "compare.json")]
    ok = CliRunner().invoke(app, args + ["--out", str(tmp_path / "a"), "--max-ppl-increase", "1"])
    assert ok.exit_code == 0, ok.output
    report = json.loads((tmp_path / "a" / "compare.json").read_text())
    assert [v["name"] for v in report["variants"]] == ["base", "no-gate-up"]
    (skipped,) = report["skipped"]  # its second quantization pass refuses to run: reported, not fatal
    assert skipped["name"] == "twice" and "build failed: pass 'quantize_gptq'" in skipped["reason"]
    assert "keep one quantization pass" in (tmp_path / "a" / "compare.md").read_text()
    bad = CliRunner().invoke(app, args + ["--out", str(tmp_path / "b"), "--min-speed-ratio", "1000"])
    assert bad.exit_code == 1
    assert bad.output.count("regression: ") == 2  # base x 2 batch sizes
    assert "regression: base: output tok/s at batch size 2" in bad.output


@pytest.mark.parametrize("args, message", [
    (["--max-ppl-increase", "5"], "need --baseline"),
    (["--baseline", "nope.json", "--max-ppl-increase", "5"], "--baseline nope.json: not a readable compare.json"),
    (["--leave-one-out", "--add-one"], "give one of --leave-one-out, --add-one, --variants FILE"),
    (["--batch-sizes", "1,x"], "--batch-sizes '1,x'"),
    (["--eval-tokens", "100", "--window", "64"], "needs at least 2 windows"),
])
def test_cli_user_errors_exit_2_before_building(recipes, tmp_path, args, message):
    result = CliRunner().invoke(app, ["compare", str(recipes / "tiny.yaml"), "--out", str(tmp_path / "o"),
                                      "--cache-dir", str(tmp_path / "c")] + args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "o").exists() and not (tmp_path / "c").exists()


def test_a_variant_sets_the_tensor_parallel_size(recipes, tmp_path):
    """{set: {runtime.tensor_parallel_size: 2}}: quality and speed measured over 2 ranks (gloo); the
    split model scores the windows of one rank."""
    variants = tmp_path / "v.yaml"
    variants.write_text("tp2: [{set: {runtime.tensor_parallel_size: 2}}]\n")
    speed = dataclasses.replace(TINY_SPEED, batch_sizes=(2,), repeats=1)
    options = dataclasses.replace(_options(recipes, tmp_path), mode=Mode.FILE, variants_file=variants, speed=speed)
    rows = {v["name"]: v for v in run_compare(options).report["variants"]}
    assert [rows[n]["tensor_parallel_size"] for n in ("base", "tp2")] == [1, 2]
    one, two = (rows[n]["quality"]["windows"] for n in ("base", "tp2"))
    assert len(one) == len(two) == 4
    for a, b in zip(one, two, strict=True):
        assert abs(a["nll"] - b["nll"]) < 1e-4 * a["nll"] and a["num_agree"] == b["num_agree"]
    assert rows["tp2"]["speed"]["2"]["output_tokens_per_s"]["values"][0] > 0
    assert not multiprocessing.active_children()
