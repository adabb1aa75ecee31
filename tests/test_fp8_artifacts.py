"""fp8 and W8A8 artifacts of random:tiny end to end: build -> artifact -> `optc run` and `optc inspect` (which
shows how the weights were rounded: rtn or gptq); the
paged runtime's logits equal the dense executor's (per-token activation scales make W8A8 batch-invariant);
a cuda-target fp8 artifact needs compute capability 8.9 at load time; `optc export` runs fp8 weight-only in
ONNX Runtime and refuses W8A8 with a one-line error naming the format."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from optc.cli import app
from optc.commands.export import ExportOptions, Flavor, export
from optc.commands.export.onnxrt import feeds, session
from optc.core.artifact import ArtifactError, check_target, read, read_manifest
from optc.core.errors import UserError
from optc.core.execute import Executor, bind_params, run_dense
from optc.runtime.batch import ForwardBatch
from optc.runtime.loader import load_model
from optc.testing import assert_close, build_artifact

RECIPE = """model: random:tiny
dtype: float32
target: cpu
calibration: {{samples: 4, seq_len: 32}}
passes:
  - fuse_qkv
  - fuse_gate_up
{passes}
runtime: {{max_num_seqs: 16, max_seq_len: 512}}
"""
# name -> (passes after the fusions, the linears' format label)
VARIANTS = {
    "fp8": ("  - quantize_fp8", "fp8_e4m3"),
    "fp8-gptq": ("  - quantize_fp8: {method: gptq}", "fp8_e4m3"),
    "fp8-tensor": ("  - quantize_fp8: {per_tensor: true}", "fp8_e4m3/per-tensor"),
    "fp8-w8a8-sq": ("  - smoothquant: {alpha: 0.5}\n  - quantize_fp8: {activations: dynamic}", "fp8_e4m3/act-dynamic"),
    "int8-w8a8-sq": ("  - smoothquant\n  - quantize_rtn: {bits: 8, activations: dynamic}", "int8_wo/act-dynamic"),
}
BLOCK = 16
runner = CliRunner()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name, (passes, _) in VARIANTS.items():
        (root / f"{name}.yaml").write_text(RECIPE.format(passes=passes))
        out[name] = build_artifact(root / name, root / f"{name}.yaml")
    return out


@pytest.mark.parametrize("name", VARIANTS)
def test_build_inspect_run(artifacts, name):
    summary = json.loads(runner.invoke(app, ["inspect", str(artifacts[name]), "--json"]).output)
    assert summary["formats"][VARIANTS[name][1]] == 8  # qkv, o, gate_up, down in each of 2 layers
    assert summary["target"] == {"device": "cpu", "min_compute_capability": None}
    assert VARIANTS[name][1] in runner.invoke(app, ["inspect", str(artifacts[name])]).output
    opened = read(artifacts[name])
    w = "model.layers.0.mlp.down_proj.weight"
    assert opened.store.get(f"{w}.qweight").dtype == (torch.int8 if name.startswith("int8") else torch.float8_e4m3fn)
    r = runner.invoke(app, ["run", str(artifacts[name]), "--prompt", "hello", "--max-tokens", "5", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["completion_tokens"] == 5


@pytest.mark.parametrize("name,method", [("fp8", "rtn"), ("fp8-gptq", "gptq")])
def test_inspect_shows_the_rounding_method(artifacts, name, method):
    out = runner.invoke(app, ["inspect", str(artifacts[name])]).output
    line = next(x for x in out.splitlines() if x.strip().startswith("quantize_fp8"))
    assert "quantized=8" in line and f"method={method}" in line, line
    assert read_manifest(artifacts[name]).quantization["method"] == method


@pytest.mark.parametrize("name", ["fp8-tensor", "fp8-gptq", "fp8-w8a8-sq", "int8-w8a8-sq"])
def test_paged_runtime_matches_the_dense_executor(artifacts, name):
    opened = read(artifacts[name])
    prompts = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    dense = run_dense(Executor(opened.graph, bind_params(opened.graph, opened.store)), prompts)  # (B, S, V)
    model = load_model(opened)
    blocks = [[1], [2]]
    caches = model.allocate_kv_caches(3, BLOCK)
    paged = model.forward(ForwardBatch.build(prompts.tolist(), [0, 0], blocks, BLOCK, [9, 9]), caches)
    assert_close(paged.view(2, 9, -1), dense, atol=1e-4, what=f"{name} logits")


def test_cuda_fp8_artifact_needs_sm89_at_load(tmp_path, monkeypatch):
    (tmp_path / "r.yaml").write_text(RECIPE.format(passes=VARIANTS["fp8"][0] + "\n  - select_kernels"))
    out = build_artifact(tmp_path / "cuda", tmp_path / "r.yaml", "target=cuda")
    manifest = read_manifest(out)
    assert manifest.target.min_compute_capability == (8, 9)
    kernels = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).output)["kernels"]
    assert kernels["model.layers.0.mlp.down_proj"] == "triton.fp8_w8a16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    with pytest.raises(ArtifactError, match=r"needs compute capability >= 8.9, this GPU has 8.0"):
        check_target(manifest, "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100
    check_target(manifest, "cuda")
    int8 = replace(manifest, target=replace(manifest.target, min_compute_capability=(8, 0)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    check_target(int8, "cuda")


def test_cuda_int8_w8a8_binds_int_mm_at_the_runtime_floor(tmp_path):
    passes = "  - quantize_rtn: {bits: 8, activations: dynamic}\n  - select_kernels"
    (tmp_path / "r.yaml").write_text(RECIPE.format(passes=passes))
    out = build_artifact(tmp_path / "cuda", tmp_path / "r.yaml", "target=cuda")
    assert read_manifest(out).target.min_compute_capability == (8, 0)
    kernels = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).output)["kernels"]
    assert kernels["model.layers.0.mlp.down_proj"] == "torch.int_mm"


@pytest.mark.parametrize("name", ["fp8", "fp8-tensor"])
@pytest.mark.parametrize("flavor", list(Flavor))
def test_export_fp8_weight_only_runs_in_onnxruntime(artifacts, tmp_path, name, flavor):
    folder = export(ExportOptions(artifacts[name], tmp_path / "onnx", flavor=flavor, quiet=True)).out
    opened = read(artifacts[name])
    prompts = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    dense = run_dense(Executor(opened.graph, bind_params(opened.graph, opened.store)), prompts)
    logits, *_ = session(folder).run(None, feeds(opened.graph.config, prompts.numpy(), None))
    assert_close(torch.from_numpy(logits), dense, atol=1e-3, what=f"{name} {flavor} logits")


@pytest.mark.parametrize("name,kind", [("fp8-w8a8-sq", "fp8_e4m3"), ("int8-w8a8-sq", "int8_wo")])
@pytest.mark.parametrize("flavor", list(Flavor))
def test_export_refuses_w8a8_naming_the_format(artifacts, tmp_path, name, kind, flavor):
    with pytest.raises(UserError, match=f"is {kind} with dynamic per-token activations .W8A8.; ONNX export takes"):
        export(ExportOptions(artifacts[name], tmp_path / "onnx", flavor=flavor, quiet=True))
    assert not (tmp_path / "onnx").exists() and not list(tmp_path.glob(".onnx.tmp-*"))
    r = runner.invoke(app, ["export", str(artifacts[name]), "--out", str(tmp_path / "cli"), "--flavor", flavor.value])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
