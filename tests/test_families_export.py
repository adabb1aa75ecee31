"""The families beyond Llama through the exports: `optc export --format hf` writes the family's own
transformers architecture (fused projections cut back where the family names them apart, Phi-3's kept
whole), transformers loads the folder and gives the runtime's logits, dense and int4 (compressed-tensors),
and `optc build` from the folder gives byte-identical weights; ONNX export refuses, by node and
attribute, what it does not lower."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from optc.cli import app
from optc.commands.export import ExportFormat, ExportOptions, export
from optc.core.artifact import read
from optc.runtime.loader import load_model
from optc.testing import assert_close, build_artifact, prefill_logits

ct = pytest.importorskip("compressed_tensors", reason="pip install 'optc[hf]'")
pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")

ARCHITECTURES = {"qwen3-tiny": "Qwen3ForCausalLM", "gemma2-tiny": "Gemma2ForCausalLM",
                 "gemma3-tiny": "Gemma3ForCausalLM", "phi3-tiny": "Phi3ForCausalLM"}
FUSED = "passes=[fuse_qkv, fuse_gate_up{extra}]"
INT4 = ", {quantize_rtn: {bits: 4, group_size: 32}}"  # symmetric: transformers loads it without dequantize=True
PROMPTS = [[5, 17, 200, 3, 9, 44, 81, 2, 70, 71, 72, 73, 74, 75, 76, 77], [120, 7, 63, 1, 250, 33, 90, 11] * 2]


def _runtime_logits(artifact) -> torch.Tensor:
    model = load_model(read(artifact))
    return torch.stack([prefill_logits(model, ids, every_position=True) for ids in PROMPTS])


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "int4"])
@pytest.mark.parametrize("preset", list(ARCHITECTURES))
def test_hf_export_loads_in_transformers_as_the_family(preset, quantized, tmp_path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    artifact = build_artifact(tmp_path / "a", None, "dtype=float32", FUSED.format(extra=INT4 if quantized else ""),
                              model=f"random:{preset}")
    folder = export(ExportOptions(artifact, tmp_path / "hf", format=ExportFormat.HF, quiet=True)).out
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[preset]]
    kwargs = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if quantized else {}
    model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs).eval()
    assert type(model).__name__ == ARCHITECTURES[preset]
    with torch.no_grad():
        logits = model(torch.tensor(PROMPTS)).logits
    assert_close(logits, _runtime_logits(artifact), rtol=1e-4, what=f"{preset}: transformers vs optc logits")
    if not quantized:  # and back: the same weights, byte for byte
        again = build_artifact(tmp_path / "again", None, "dtype=float32", FUSED.format(extra=""), model=str(folder))
        first, second = read(artifact), read(again)
        for name in first.graph.used_tensors():
            assert torch.equal(first.store.get(name), second.store.get(name)), name


@pytest.mark.parametrize("preset", ["qwen3-tiny", "gemma2-tiny", "gemma3-tiny", "phi3-tiny"])
def test_onnx_export_refuses_what_it_does_not_lower(preset, tmp_path):
    artifact = build_artifact(tmp_path / "a", None, "dtype=float32", "passes=[]", model=f"random:{preset}")
    result = CliRunner().invoke(app, ["export", str(artifact), "--out", str(tmp_path / "onnx")])
    assert result.exit_code == 2, result.output
    assert "has no ONNX lowering" in result.output and "--format hf" in result.output
    attribute = {"qwen3-tiny": "head_dim=32", "gemma2-tiny": "scale=8.0", "gemma3-tiny": "scale=8.0",
                 "phi3-tiny": "rotary_dim=12"}[preset]
    assert attribute in result.output, result.output
    assert not (tmp_path / "onnx").exists()
