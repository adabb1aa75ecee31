"""`optc export` on the real model: SmolLM2 in both ONNX flavors passes the full checker, a greedy loop
in ONNX Runtime gives `optc run`'s tokens, and int4 exports agree with optc's int4 reference on top-1."""

from __future__ import annotations

import json
import pydoc_data.topics

import numpy as np
import onnx
import pytest
import torch
from transformers import AutoTokenizer

from optc.commands.export import ExportOptions, Flavor, export
from optc.commands.export.onnxrt import feeds, greedy_generate, session
from optc.core.artifact import read
from optc.core.ir import Graph
from optc.runtime import Engine, SamplingParams
from optc.runtime.batch import ForwardBatch
from optc.runtime.loader import load_model
from optc.testing import build_artifact

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Photosynthesis is the process by which"]
WINDOW, NUM_WINDOWS = 512, 4  # 2,048 scored positions
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fp32_exports(smollm2_f32_artifact, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2-onnx")
    return {f: export(ExportOptions(smollm2_f32_artifact, root / f, flavor=f, quiet=True)).out for f in Flavor}


@pytest.fixture(scope="module")
def optc_run_tokens(smollm2_f32_artifact) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids and the optc runtime's 32 greedy tokens for each (what `optc run --max-tokens 32` prints)."""
    engine = Engine.load(smollm2_f32_artifact)
    prompts = [list(engine.tokenizer(p)["input_ids"]) for p in PROMPTS]
    completions = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    return prompts, [c.token_ids for c in completions]


@pytest.mark.parametrize("flavor", list(Flavor))
def test_smollm2_checker_and_greedy_tokens_equal_optc_run(smollm2_f32_artifact, fp32_exports, optc_run_tokens,
                                                          flavor):
    folder = fp32_exports[flavor]
    onnx.checker.check_model(str(folder / "model.onnx"), full_check=True)
    cfg = Graph.from_json(json.loads((smollm2_f32_artifact / "graph.json").read_text())).config
    sess = session(folder)
    for prompt, expected in zip(*optc_run_tokens, strict=True):
        assert greedy_generate(sess, cfg, prompt, 32) == expected, prompt


@pytest.mark.parametrize(("recipe", "flavor"), [("smollm2-rtn.yaml", Flavor.ORT),
                                                ("smollm2-rtn-sym.yaml", Flavor.PORTABLE)])
def test_smollm2_int4_top1_agrees_with_optc(recipes, tmp_path_factory, smollm2_hf_dir, recipe, flavor):
    root = tmp_path_factory.mktemp("smollm2-int4")
    # float32 activations, the arithmetic the ONNX graphs are compared in (the CPU recipes are bfloat16)
    artifact = build_artifact(root / "a", recipes / recipe, "dtype=float32", model=str(smollm2_hf_dir))
    folder = export(ExportOptions(artifact, root / "onnx", flavor=flavor, quiet=True)).out
    onnx.checker.check_model(str(folder / "model.onnx"), full_check=True)
    tokenizer = AutoTokenizer.from_pretrained(str(artifact / "tokenizer"))
    text = " ".join(pydoc_data.topics.topics[k] for k in ("assert", "class", "for", "if", "try", "with", "function"))
    ids = tokenizer(text)["input_ids"][: WINDOW * NUM_WINDOWS]
    windows = [ids[i * WINDOW : (i + 1) * WINDOW] for i in range(NUM_WINDOWS)]
    model = load_model(read(artifact))
    caches = model.allocate_kv_caches(1 + WINDOW // 16, 16)
    blocks = [list(range(1, 1 + WINDOW // 16))]
    ref = torch.stack([model.forward(ForwardBatch.build([w], [0], blocks, 16, [WINDOW]), caches).argmax(-1)
                       for w in windows])
    logits, *_ = session(folder).run(None, feeds(model.graph.config, np.array(windows), None))
    agreement = (torch.from_numpy(logits.argmax(-1)) == ref).float().mean().item()
    assert ref.numel() >= 2000 and agreement >= 0.999, f"top-1 agreement {agreement:.5f} over {ref.numel()} positions"
