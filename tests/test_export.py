"""`optc export` on random:tiny artifacts: both ONNX flavors pass the full checker, and their logits
in ONNX Runtime match the optc runtime's (prefill and decode after a past, batch 2) for dense, int8
and int4 weights; the portable flavor has no com.microsoft node and refuses what TensorRT cannot take."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

from optc.cli import app
from optc.commands.export import ExportFormat, ExportOptions, Flavor, export
from optc.commands.export.onnxrt import feeds, greedy_generate, session
from optc.core.artifact import read
from optc.core.errors import UserError
from optc.core.ir import Graph
from optc.runtime import Engine, SamplingParams
from optc.runtime.batch import ForwardBatch
from optc.runtime.loader import load_model
from optc.testing import assert_close, build_artifact

BLOCK = 16
SYMMETRIC_INT4 = """model: random:tiny
dtype: float32
target: cpu
passes:
  - fuse_qkv
  - fuse_gate_up
  - quantize_rtn: {{bits: 4, group_size: {group}, zero_point: false}}
  - fuse_add_rmsnorm
  - fuse_rope_kv
runtime: {{max_num_seqs: 16, max_seq_len: 512}}
"""
# name -> (recipe, overrides); every artifact is random:tiny in float32
ARTIFACTS = {
    "dense": ("tiny.yaml", ()),  # rms_norm, rope, attention on k/v (no fusions past qkv/gate-up)
    "dense-fused": ("smollm2-bf16.yaml", ("dtype=float32",)),  # add_rms_norm, rope_kv_store, kv_stored attention
    "int8": ("smollm2-int8.yaml", ("dtype=float32",)),
    "int4-zp": ("smollm2-rtn.yaml", ("dtype=float32",)),  # zero points, group 64: ort flavor only
    "int4-sym": (None, ()),  # symmetric, group 64: both flavors
}
CASES = [(a, f) for a in ARTIFACTS for f in Flavor if (a, f) != ("int4-zp", Flavor.PORTABLE)]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_recipe_artifact) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export-src")
    out = {}
    for name, (recipe, overrides) in ARTIFACTS.items():
        if recipe is None:
            recipe_path = root / f"{name}.yaml"
            recipe_path.write_text(SYMMETRIC_INT4.format(group=64))
            out[name] = build_artifact(root / name, recipe_path, *overrides, model="random:tiny")
        else:  # the same build as the other export tests': made once per session
            out[name] = tiny_recipe_artifact(recipe, *overrides)
    return out


@pytest.fixture(scope="module")
def exported(artifacts, tmp_path_factory) -> dict[tuple[str, Flavor], Path]:
    root = tmp_path_factory.mktemp("export-out")
    return {(a, f): export(ExportOptions(artifacts[a], root / f"{a}-{f}", flavor=f, quiet=True)).out for a, f in CASES}


def runtime_logits(artifact: Path, prompts: list[list[int]], next_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The optc runtime's logits: every prompt position (B, S, V), then one decode step (B, V) on the paged cache."""
    model = load_model(read(artifact))
    s = len(prompts[0])
    per_request = -(-(s + 1) // BLOCK)
    blocks = [list(range(1 + b * per_request, 1 + (b + 1) * per_request)) for b in range(len(prompts))]
    caches = model.allocate_kv_caches(1 + len(prompts) * per_request, BLOCK)
    prefill = model.forward(ForwardBatch.build(prompts, [0] * len(prompts), blocks, BLOCK, [s] * len(prompts)), caches)
    decode = model.forward(ForwardBatch.build([[t] for t in next_ids], [s] * len(prompts), blocks, BLOCK), caches)
    return prefill.view(len(prompts), s, -1), decode


@pytest.mark.parametrize(("name", "flavor"), CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_checker_and_logits_match_the_runtime(exported, artifacts, name, flavor):
    folder = exported[(name, flavor)]
    onnx.checker.check_model(str(folder / "model.onnx"), full_check=True)
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    domains = {n.domain for n in model.graph.node}
    assert domains == ({""} if flavor is Flavor.PORTABLE else {"", "com.microsoft"})
    assert [i.name for i in model.graph.input][:3] == ["input_ids", "attention_mask", "position_ids"]
    assert [o.name for o in model.graph.output][:3] == ["logits", "present.0.key", "present.0.value"]

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (2, 9), generator=gen)
    next_ids = torch.randint(0, 256, (2,), generator=gen)
    ref_prefill, ref_decode = runtime_logits(artifacts[name], prompts.tolist(), next_ids.tolist())
    cfg = Graph.from_json(json.loads((artifacts[name] / "graph.json").read_text())).config
    sess = session(folder)
    logits, *present = sess.run(None, feeds(cfg, prompts.numpy(), None))
    assert present[0].shape == (2, cfg.num_kv_heads, 9, cfg.head_dim)
    assert_close(torch.from_numpy(logits), ref_prefill, atol=1e-3, what=f"{name} {flavor} prefill logits")
    logits, *present = sess.run(None, feeds(cfg, next_ids.numpy()[:, None], present))
    assert present[0].shape == (2, cfg.num_kv_heads, 10, cfg.head_dim)
    assert_close(torch.from_numpy(logits[:, 0]), ref_decode, atol=1e-3, what=f"{name} {flavor} decode logits")


def test_every_ir_op_has_a_lowering():
    # or is refused by name (moe: tests/test_families_moe.py::test_exports_of_a_moe_model)
    from optc.commands.export.lower import LOWERED_OPS, REFUSED_OPS
    from optc.core.ops import COLLECTIVE_OPS, OPS

    assert not set(LOWERED_OPS) & set(REFUSED_OPS)
    assert sorted(LOWERED_OPS + REFUSED_OPS) == sorted(set(OPS) - set(COLLECTIVE_OPS))  # collectives: never stored


def test_every_format_kind_has_an_onnx_matmul_and_a_missing_one_is_refused_by_name(monkeypatch):
    """Export keeps the ONNX lowering of each format kind (the schemes in optc.core know nothing of ONNX); the
    GGUF kinds' schemes refuse every export flavor by name (tests/test_gguf_keep.py)."""
    from optc.commands.export import matmuls
    from optc.core.formats import Format, FormatKind

    assert set(matmuls.ONNX_MATMULS) == set(FormatKind) - {FormatKind.INT4_GF, FormatKind.INT8_GF}
    monkeypatch.delitem(matmuls.ONNX_MATMULS, FormatKind.INT8_WO)
    lowering = type("L", (), {"flavor": "ort", "b": None})()
    with pytest.raises(matmuls.ExportFormatError, match=r"tensor w is int8_wo, which has no ONNX lowering"):
        matmuls.onnx_matmul(lowering, "x", "w", {}, Format(FormatKind.INT8_WO, "float32", 8))


def test_ort_flavor_uses_the_fused_contrib_ops(exported):
    def nodes(name, flavor):
        return onnx.load(str(exported[(name, flavor)] / "model.onnx"), load_external_data=False).graph.node

    ops = {n.op_type for n in nodes("int4-sym", Flavor.ORT)}
    assert {"GroupQueryAttention", "RotaryEmbedding", "SkipSimplifiedLayerNormalization", "MatMulNBits"} <= ops
    nbits = [n for n in nodes("int4-zp", Flavor.ORT) if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 * 4 and all(len(n.input) == 4 for n in nbits)  # A, B, scales, zero points
    dq = [n for n in nodes("int4-sym", Flavor.PORTABLE) if n.op_type == "DequantizeLinear"]
    assert len(dq) == 2 * 4  # qkv, o, gate_up, down per layer
    assert all({a.name: a.i for a in n.attribute}["block_size"] == 64 for n in dq)


def test_portable_left_padding_matches_each_prompt_alone(exported, artifacts):
    """Rows of different lengths, left-padded: the last position of each equals the runtime on that prompt alone."""
    folder, artifact = exported[("dense-fused", Flavor.PORTABLE)], artifacts["dense-fused"]
    cfg = read(artifact).graph.config
    prompts = [[5, 17, 200, 3, 9, 44, 81], [120, 7, 63]]
    mask = np.array([[1] * 7, [0] * 4 + [1] * 3], np.int64)
    ids = np.array([prompts[0], [0] * 4 + prompts[1]])
    logits, *_ = session(folder).run(None, feeds(cfg, ids, None, mask))
    for b, p in enumerate(prompts):
        ref, _ = runtime_logits(artifact, [p], [0])
        assert_close(torch.from_numpy(logits[b, -1]), ref[0, -1], atol=1e-3, what=f"row {b}")


def test_greedy_loop_and_genai_give_the_runtimes_tokens(exported, artifacts):
    folder, artifact = exported[("int8", Flavor.ORT)], artifacts["int8"]
    engine = Engine.load(artifact)
    prompt = [11, 42, 7, 99, 3]
    expected = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    assert greedy_generate(session(folder), engine.model.graph.config, prompt, 12) == expected
    og = pytest.importorskip("onnxruntime_genai")  # optc[genai], which .ci/run installs
    model = og.Model(str(exported[("dense-fused", Flavor.ORT)]))  # reads genai_config.json
    dense = Engine.load(artifacts["dense-fused"])
    expected = dense.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 12, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    assert tokens == expected


@pytest.mark.parametrize("group", [32, 64])
def test_portable_refuses_int4_tensorrt_cannot_take(artifacts, tmp_path, group):
    if group == 64:
        artifact, want = artifacts["int4-zp"], "int4_g group_size=64 zero_point=true"
    else:
        (tmp_path / "g32.yaml").write_text(SYMMETRIC_INT4.format(group=32))
        artifact = build_artifact(tmp_path / "g32", tmp_path / "g32.yaml")
        want = "int4_g group_size=32 zero_point=false"
    with pytest.raises(UserError, match=f"is {want}; the portable flavor .TensorRT. takes int4 only symmetric "
                                        "in blocks of 64 or 128: rebuild with `zero_point: false`"):
        export(ExportOptions(artifact, tmp_path / "out", flavor=Flavor.PORTABLE, quiet=True))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_tensorrt_says_what_is_missing(artifacts, tmp_path):
    try:
        import tensorrt  # noqa: F401

        if torch.cuda.is_available():
            pytest.skip("tensorrt and a GPU exist here: nothing is missing (test_tensorrt_engine_builds runs)")
        missing = "an NVIDIA GPU"
    except ImportError:
        missing = "the tensorrt Python package (pip install tensorrt)" + (
            "" if torch.cuda.is_available() else " and an NVIDIA GPU")
    with pytest.raises(UserError, match=f"^--format tensorrt needs {missing.replace('(', '.').replace(')', '.')};"):
        export(ExportOptions(artifacts["dense"], tmp_path / "trt", format=ExportFormat.TENSORRT, quiet=True))
    assert not (tmp_path / "trt").exists()


@pytest.mark.gpu
def test_tensorrt_engine_builds(artifacts, tmp_path):
    """The engine build itself. benchmarks/gpu_session.sh's `tensorrt` stage runs this on the GPU machine; it has
    not run anywhere yet (no machine so far had the tensorrt package), which is what the skip says."""
    trt = pytest.importorskip("tensorrt", reason="the tensorrt package does not import here: the TensorRT engine "
                              "build is unrun (gpu_session.sh stage `tensorrt` runs it where tensorrt imports)")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: the TensorRT engine build is unrun here")
    result = export(ExportOptions(artifacts["dense"], tmp_path / "trt", format=ExportFormat.TENSORRT, quiet=True))
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine((result.out / "model.engine")
                                                                                  .read_bytes())
    names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
    cfg = read(artifacts["dense"]).graph.config
    assert {"input_ids", "attention_mask", "position_ids", "logits"} <= names
    assert len(names) == 4 + 4 * cfg.num_layers  # past and present key and value per layer


def test_missing_onnx_names_the_install_command(artifacts, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx raises ImportError
    with pytest.raises(UserError, match=r"needs the onnx package; install it with pip install 'optc\[onnx\]'"):
        export(ExportOptions(artifacts["dense"], tmp_path / "x", quiet=True))


def test_cli_export(artifacts, tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli"
    ok = runner.invoke(app, ["export", str(artifacts["dense"]), "--out", str(out), "--flavor", "portable", "--json"])
    assert ok.exit_code == 0, ok.output
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja", "export.json", "model.onnx", "model.onnx.data", "tokenizer.json", "tokenizer_config.json"
    ]
    again = runner.invoke(app, ["export", str(artifacts["dense"]), "--out", str(out)])
    assert again.exit_code == 2 and f"error: output folder {out} already exists" in again.output
    bad = runner.invoke(app, ["export", str(artifacts["dense"]), "--out", str(tmp_path / "b"), "--flavor", "trt"])
    assert bad.exit_code == 2 and "'trt' is not one of" in bad.output and "'portable'" in bad.output
