"""optc.commands.eval: fixed windows, perplexity, KL and top-1 against a reference."""

import math

import pytest
import torch

from optc.commands.eval import evaluate, load_model
from optc.frontend.passmanager import PassContext, make_pass


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny")


def test_self_reference_and_stated_windows(tiny, tmp_path):
    data = tmp_path / "t.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 30)  # bytes = tokens: 1350
    q = evaluate(tiny, tiny, data=str(data), max_tokens=1000, window=128)
    assert q["windows"] == 7 and q["tokens"] == 7 * 127 and q["window"] == 128
    assert q["kld"] == pytest.approx(0.0, abs=1e-6) and q["top1_agreement"] == 1.0
    assert q["ppl"] == pytest.approx(q["reference_ppl"])
    assert 1 < q["ppl"] < 256 * 4  # a random model is near uniform over 256 byte tokens
    alone = evaluate(tiny, data=str(data), max_tokens=1000, window=128)
    assert alone["reference_ppl"] is None and alone["ppl"] == pytest.approx(q["ppl"])


def test_quantized_model_differs_from_reference(tiny, tmp_path):
    data = tmp_path / "t.txt"
    data.write_text("".join(chr(32 + (i * 7) % 90) for i in range(600)))
    r = make_pass("quantize_rtn", {"group_size": 32}).run(tiny.graph, tiny.store, PassContext())
    q = evaluate((r.graph, r.store, tiny.tokenizer), tiny, data=str(data), max_tokens=512, window=256)
    assert q["kld"] > 0 and q["top1_agreement"] < 1.0
    assert math.isfinite(q["ppl"]) and q["ppl"] != q["reference_ppl"]


def test_too_little_text(tiny, tmp_path):
    data = tmp_path / "t.txt"
    data.write_text("short")
    with pytest.raises(ValueError, match=r"has 5 tokens .* fewer than one window of 128"):
        evaluate(tiny, data=str(data), window=128)


def test_pydoc_heldout_is_the_default(tiny):
    q = evaluate(tiny, max_tokens=256, window=256)
    assert q["data"] == "builtin:pydoc-heldout" and q["tokens"] == 255
    assert torch.isfinite(torch.tensor(q["ppl"]))
