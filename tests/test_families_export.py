"""The families beyond Llama through the exports: `optc export --format hf` writes the family's own
transformers architecture (fused projections cut back where the family names them apart, Phi-3's kept
whole), transformers loads the folder and gives the runtime's logits, dense and int4 (compressed-tensors),
and `optc build` from the folder gives byte-identical weights. The ONNX export (both flavors) lowers every
family attribute (offset norms, per-head q/k norms, the embedding scale, gelu-tanh, soft-capped scores and
logits, sliding windows, Gemma 3's local rotary table, partial rotary, LongRoPE's per-position table) and
gives the runtime's logits over a prompt and decode steps past the windows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from optc.commands.export import ExportFormat, ExportOptions, Flavor, export
from optc.commands.export.onnxrt import feeds, session
from optc.core.artifact import read
from optc.runtime.loader import load_model
from optc.testing import assert_close, build_artifact, prefill_logits

ct = pytest.importorskip("compressed_tensors", reason="pip install 'optc[hf]'")
pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")

ARCHITECTURES = {"qwen3-tiny": "Qwen3ForCausalLM", "gemma2-tiny": "Gemma2ForCausalLM",
                 "gemma3-tiny": "Gemma3ForCausalLM", "phi3-tiny": "Phi3ForCausalLM"}
FUSED = "passes=[fuse_qkv, fuse_gate_up{extra}]"
INT4 = ", {quantize_rtn: {bits: 4, group_size: 32}}"  # symmetric: transformers loads it without dequantize=True
ONNX_PASSES = "passes=[fuse_qkv, fuse_gate_up, fuse_add_rmsnorm, fuse_rope_kv, kv_layout]"
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


@pytest.mark.parametrize("flavor", list(Flavor), ids=[f.value for f in Flavor])
@pytest.mark.parametrize("preset", list(ARCHITECTURES))
def test_onnx_export_gives_the_runtimes_logits_across_windows(preset, flavor, tmp_path):
    # a 24-token prompt, then 10 tokens one step at a time over the ONNX model's own past: past Gemma's
    # sliding windows (12, 20) and Phi-3's LongRoPE original length (32); every fusion the runtime has
    artifact = build_artifact(tmp_path / "a", None, "dtype=float32", ONNX_PASSES, model=f"random:{preset}")
    folder = export(ExportOptions(artifact, tmp_path / "onnx", flavor=flavor, quiet=True)).out
    cfg = read(artifact).graph.config
    sess = session(folder)
    prompt = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    logits, *past = sess.run(None, feeds(cfg, np.array([prompt]), None))
    steps, ids = [torch.from_numpy(logits[0])], list(prompt)
    for _ in range(10):
        ids.append(int(steps[-1][-1].argmax()))
        logits, *past = sess.run(None, feeds(cfg, np.array([ids[-1:]]), past))
        steps.append(torch.from_numpy(logits[0]))
    expected = prefill_logits(load_model(read(artifact)), ids, every_position=True)
    assert_close(torch.cat(steps), expected, atol=2e-4, rtol=1e-3, what=f"{preset} {flavor.value} logits")
