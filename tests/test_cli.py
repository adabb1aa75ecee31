"""The CLI end to end on random:tiny, and every bad input of the core issue: a one-line actionable
error, exit code 2, and nothing left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from optc.cli import app

runner = CliRunner()


def optc(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_user_error(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    text = result.output.lower()
    for n in needles:
        assert n.lower() in text, f"{n!r} not in {result.output!r}"
    assert not any("Traceback" in line for line in lines), result.output


def test_build_inspect_run_schema(tmp_path, recipes):
    out = tmp_path / "tiny"
    r = optc("build", recipes / "tiny.yaml", "--out", out, "--quiet", "--verify-each", "--dump-ir", tmp_path / "ir")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "ir").iterdir()) == [
        "00-input.txt", "01-cast.txt", "02-fuse_qkv.txt", "03-fuse_gate_up.txt"]
    r = optc("inspect", out, "--json")
    summary = json.loads(r.output)
    assert [p["name"] for p in summary["passes"]] == ["cast", "fuse_qkv", "fuse_gate_up"]
    assert summary["ops"]["linear"] == 8 and set(summary["kernels"].values()) == {"torch"}
    assert "fuse_qkv" in optc("inspect", out).output
    r = optc("run", out, "--prompt", "hello", "--max-tokens", "5", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert set(res) >= {"text", "token_ids", "prompt_tokens", "completion_tokens", "seconds"}
    assert res["completion_tokens"] == len(res["token_ids"]) == 5 and res["prompt_tokens"] == 5
    schema = json.loads(optc("schema").output)
    assert "passes" in schema["properties"]
    assert schema["properties"]["dtype"]["enum"] == ["float32", "float16", "bfloat16"]
    assert "Options(" not in json.dumps(schema)  # no dataclass-generated signatures as descriptions


def test_help_explains_every_option():
    for cmd in ("build", "inspect", "run", "schema"):
        r = optc(cmd, "--help")
        assert r.exit_code == 0
    text = optc("build", "--help").output
    for opt in ("--model", "--out", "--set", "--force", "--verify-each", "--dump-ir"):
        assert opt in text


def _no_leftovers(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if p.name.startswith(".")], "a temporary folder was left behind"


def test_missing_model_path(tmp_path, recipes):
    r = optc("build", recipes / "tiny.yaml", "--model", tmp_path / "nope", "--out", tmp_path / "o")
    assert_user_error(r, "not found", "nope")
    assert not (tmp_path / "o").exists()
    _no_leftovers(tmp_path)


def test_unsupported_architecture(tmp_path, recipes):
    src = tmp_path / "gpt2"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    save_file({"x": torch.zeros(1)}, str(src / "model.safetensors"))
    r = optc("build", recipes / "tiny.yaml", "--model", src, "--out", tmp_path / "o")
    assert_user_error(r, "GPT2LMHeadModel", "LlamaForCausalLM", "supported")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("model: random:tiny\npasses: [fuse_qkv\n", ("malformed yaml", "bad.yaml:")),
        ("model: random:tiny\npasses:\n  - fuse_everything\n", ("bad.yaml:3", "unknown pass", "fuse_qkv")),
        ("model: random:tiny\ndtype: float32\nbogus: 1\n", ("bad.yaml:3", "unknown key 'bogus'", "allowed keys")),
        ("model: random:tiny\nruntime:\n  max_num_seqs: many\n", ("bad.yaml:3", "runtime.max_num_seqs", "integer")),
        ("model: random:tiny\ndtype: float64\n", ("bad.yaml:2", "float64", "bfloat16")),
        ("model: random:tiny\nruntime: {gpu_memory_utilization: 1.5}\n", ("gpu_memory_utilization", "maximum 1.0")),
        ("model: random:tiny\npasses:\n  - cast: {dtype: int3}\n", ("bad.yaml:3", "passes[0].cast.dtype", "int3")),
    ],
    ids=["malformed", "unknown-pass", "unknown-key", "wrong-type", "bad-choice", "out-of-range", "bad-pass-option"],
)
def test_bad_recipe(tmp_path, text, needles):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)
    r = optc("build", recipe, "--out", tmp_path / "o")
    assert_user_error(r, *needles)
    assert not (tmp_path / "o").exists()


def test_bad_set_override_and_unknown_option(tmp_path, recipes):
    r = optc("build", recipes / "tiny.yaml", "--out", tmp_path / "o", "--set", "runtime.max_seq_len=long")
    assert_user_error(r, "--set runtime.max_seq_len=long", "integer")
    r = optc("build", recipes / "tiny.yaml", "--out", tmp_path / "o", "--frobnicate")
    assert r.exit_code == 2 and "frobnicate" in r.output
    assert not (tmp_path / "o").exists()


def test_existing_output_refused_unless_force(tmp_path, tiny_artifact, recipes):
    out = tmp_path / "a"
    shutil.copytree(tiny_artifact, out)
    before = (out / "manifest.json").read_bytes()
    r = optc("build", recipes / "tiny.yaml", "--out", out, "--quiet")
    assert_user_error(r, "already exists", "--force")
    assert (out / "manifest.json").read_bytes() == before
    r = optc("build", recipes / "tiny.yaml", "--out", out, "--quiet", "--force", "--set", "passes=[]")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "manifest.json").read_text())["passes"][0]["name"] == "cast"
    assert len(json.loads((out / "manifest.json").read_text())["passes"]) == 1
    _no_leftovers(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "alter"])
def test_damaged_weights_are_named(tmp_path, tiny_artifact, damage):
    out = tmp_path / "a"
    shutil.copytree(tiny_artifact, out)
    (weights,) = out.glob("weights-*.safetensors")
    data = bytearray(weights.read_bytes())
    if damage == "truncate":
        data = data[:-100]
    else:
        data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    r = optc("run", out, "--prompt", "hi", "--max-tokens", "2")
    assert_user_error(r, weights.name, "rebuild")


@pytest.mark.parametrize("args, needles", [
    (["--prompt", "x" * 600, "--max-tokens", "2"], ["600"]),  # longer than the context (512)
    (["--prompt", "hi", "--max-tokens", str(10**12)], ["1000000000000", "512"]),
    (["--prompt", "hi", "--temperature", "1", "--seed", str(2**80)], ["seed", "9223372036854775807"]),
    (["--prompt", "a\udcff"], ["surrogate", "\\udcff"]),  # `--prompt $'a\xff'`: argv is not UTF-8
])
def test_requests_the_engine_cannot_serve(tiny_artifact, args, needles):
    assert_user_error(optc("run", tiny_artifact, *args), *needles)


def test_cuda_artifact_on_cpu_names_the_fix(tmp_path, recipes, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "cuda"
    r = optc("build", recipes / "tiny.yaml", "--out", out, "--quiet", "--set", "target=cuda")
    assert r.exit_code == 0, r.output  # building for cuda needs no GPU
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = optc("run", out, "--prompt", "hi", "--max-tokens", "2")
    assert_user_error(r, "built for cuda", "no GPU", "target=cpu")


@pytest.mark.parametrize(
    ("calibration", "passes", "needles"),
    [
        ("{samples: 4, seq_len: 16}", "[{quantize_rtn: {bits: 4, group_size: 128}}]",
         ("q_proj.weight", "input dimension 64", "group size 128", "[32, 64]")),
        ("{samples: 4, seq_len: 16}", "[{quantize_rtn: {bits: 3}}]", ("bits", "int 3", "allowed: 4, 8")),
        ("{source: /no/such/text.txt, samples: 4, seq_len: 16}", "[{quantize_gptq: {group_size: 32}}]",
         ("/no/such/text.txt", "does not exist", "builtin:pydoc")),
        ("{samples: 100000, seq_len: 512}", "[{quantize_awq: {group_size: 32}}]", ("tokens", "fewer than", "100000")),
        ("{samples: 4, seq_len: 16}", "[{quantize_rtn: {group_size: 32}}, {quantize_gptq: {bits: 8}}]",
         ("already quantized", "keep one quantization pass")),
    ],
    ids=["group-size", "bits", "missing-calibration", "too-little-text", "requantize"],
)
def test_bad_quantization_input(tmp_path, calibration, passes, needles):
    recipe = tmp_path / "q.yaml"
    recipe.write_text(f"model: random:tiny\ndtype: float32\ncalibration: {calibration}\npasses: {passes}\n")
    r = optc("build", recipe, "--out", tmp_path / "o", "--quiet")
    assert_user_error(r, *needles)
    assert not (tmp_path / "o").exists()
    _no_leftovers(tmp_path)


def test_eval_and_bench_commands(tiny_artifact):
    r = optc("eval", tiny_artifact, "--reference", "random:tiny", "--max-tokens", "600", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["tokens"] == 511 and res["kld"] < 1e-9 and res["top1_agreement"] == 1.0  # fusion is exact
    assert res["ppl"] == pytest.approx(res["reference_ppl"], rel=1e-6)
    r = optc("bench", tiny_artifact, "--num-requests", "4", "--input-len", "8", "--output-len", "3", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["num_output_tokens"] == 12 and res["output_tokens_per_s"] > 0
    assert set(res["ttft_ms"]) == {"mean", "p50", "p90", "p99"} and res["peak_memory_bytes"] > 0
    assert_user_error(optc("bench", tiny_artifact, "--device", "tpu"), "tpu")


def _cli(*args: str, env: dict | None = None):
    """The real `optc` entry point in a subprocess, as a user runs it (tracebacks go to stderr)."""
    import os
    import subprocess
    import sys

    code = "import sys; from optc.cli import main; sys.argv = ['optc', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_user_errors_are_one_line_unless_a_traceback_is_asked_for(tmp_path):
    missing = tmp_path / "nothing"
    plain = _cli("inspect", missing, env={"OPTC_TRACEBACK": "0"})
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert plain.stderr.strip().splitlines() == [f"error: artifact {missing} does not exist; build it with "
                                                 f"`optc build RECIPE --out {missing}`"]
    for traced in (_cli("--traceback", "inspect", missing), _cli("inspect", missing, env={"OPTC_TRACEBACK": "1"})):
        assert traced.returncode == 2
        assert "Traceback (most recent call last)" in traced.stderr and "ArtifactError" in traced.stderr
        assert traced.stderr.strip().splitlines()[-1].startswith("error: artifact")


def test_a_bug_shows_its_traceback_and_exits_1(tmp_path, tiny_artifact, monkeypatch):
    broken = tmp_path / "a"
    shutil.copytree(tiny_artifact, broken)
    m = json.loads((broken / "manifest.json").read_text())
    m["model"]["num_kv_heads"] = 0  # a damaged artifact is the user's to fix (rebuild): one line
    (broken / "manifest.json").write_text(json.dumps(m))
    assert_user_error(optc("inspect", broken), "manifest.json: a damaged section", "rebuild")

    def bug(path, tensor_parallel_size=None, pipeline_parallel_size=None):
        raise KeyError("synthetic bug")

    monkeypatch.setattr("optc.commands.inspect.summarize", bug)
    r = optc("inspect", tiny_artifact)
    assert r.exit_code == 1 and isinstance(r.exception, KeyError), r.output  # not turned into a user error
    assert "error:" not in r.output


def test_int8_kv_inspect_reports_bytes_per_token_and_export_refuses_it(tiny_int8_kv_artifact, tmp_path):
    # random:tiny: 2 layers x (K and V of 2 KV heads x 16 int8 values + an fp32 scale per (K|V, head))
    summary = json.loads(optc("inspect", tiny_int8_kv_artifact, "--json").output)
    assert summary["kv_layout"] == {"block_size": 16, "dtype": "int8", "scales": "per_token_head",
                                    "scale_dtype": "float32", "scales_at": "block"}
    assert summary["kv_bytes_per_token"] == 2 * (2 * 2 * 16 + 2 * 2 * 4)
    assert "160 bytes per token over 2 layers (scales included)" in optc("inspect", tiny_int8_kv_artifact).output
    pytest.importorskip("onnx")
    out = tmp_path / "onnx"
    assert_user_error(optc("export", tiny_int8_kv_artifact, "--out", out), "int8", "kv_layout.dtype",
                      "float32, float16 or bfloat16")
    assert not out.exists()
