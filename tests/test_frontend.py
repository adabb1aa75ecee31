"""Sources: each supported source and architecture gives the logits transformers gives."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from optc.core.execute import Executor, bind_params, run_dense
from optc.core.ops import verify
from optc.frontend.sources import SourceError, load_source
from optc.testing import assert_close

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=256)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


def _our_logits(spec: str, ids: torch.Tensor) -> torch.Tensor:
    src = load_source(spec)
    verify(src.graph, src.store)
    return run_dense(Executor(src.graph, bind_params(src.graph, src.store)), ids)


def _save_random(tmp_path, model_cls, config):
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # norms and biases away from their init, so a missed one shows
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(tmp_path))
    return model


@pytest.mark.parametrize(
    "kind",
    ["llama", "llama-tied", "llama3-rope", "linear-rope", "qwen2-bias", "mistral"],
)
def test_hf_folder_logits_match_transformers(tmp_path, kind):
    if kind.startswith("qwen2"):
        model = _save_random(tmp_path, Qwen2ForCausalLM, Qwen2Config(**SMALL, tie_word_embeddings=False))
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    elif kind == "mistral":
        model = _save_random(tmp_path, MistralForCausalLM, MistralConfig(**SMALL, sliding_window=128))
    else:
        extra = {
            "llama": {},
            "llama-tied": {"tie_word_embeddings": True},
            "llama3-rope": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                            "rope_theta": 500000.0},
            "linear-rope": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        }[kind]
        model = _save_random(tmp_path, LlamaForCausalLM, LlamaConfig(**SMALL, **extra))
    ids = _ids(128)
    with torch.no_grad():
        expected = model(ids).logits
    assert_close(_our_logits(str(tmp_path), ids), expected, rtol=1e-5, what=kind)


def test_fp16_fixture_checkpoint_matches_transformers(shared_fixture):
    path = shared_fixture("tiny-llama-fp16")
    src = load_source(str(path))
    assert src.graph.tensors["lm_head.weight"].format.dtype == "float16"
    assert src.graph.config.dtype == "float16"  # the activation dtype: the embedding's
    assert src.record["kind"] == "hf_dir" and "model.safetensors" in src.record["files"]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = _ids(256)
    with torch.no_grad():
        expected = model(ids).logits
    from optc.frontend.passmanager import PassContext, make_pass

    cast = make_pass("cast", {"dtype": "float32"}).run(src.graph, src.store, PassContext())
    ours = run_dense(Executor(cast.graph, bind_params(cast.graph, cast.store)), ids)
    assert_close(ours, expected, rtol=1e-5, what="fp16 fixture")


def test_unsupported_and_missing_sources(tmp_path):
    with pytest.raises(SourceError, match="unknown random preset 'huge'.*tiny"):
        load_source("random:huge")
    with pytest.raises(SourceError, match="no config.json"):
        load_source(str(tmp_path))
    with pytest.raises(SourceError, match="package 'no_such_pkg' is not installed"):
        load_source("package:no_such_pkg/model.gguf")
    with pytest.raises(SourceError, match="does not exist"):
        load_source(str(tmp_path / "missing.gguf"))


def test_unreachable_hub_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SourceError, match="could not download 'some-org/some-model'.*local folder"):
        load_source("some-org/some-model")


def test_random_weights_are_lazy_and_deterministic():
    a, b = load_source("random:tiny"), load_source("random:tiny")
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(a.store.get(name), b.store.get(name))
    big = load_source("random:llama-3-8b")  # 8B shapes: building the graph loads nothing
    assert big.graph.tensors["model.layers.31.mlp.down_proj.weight"].shape == (4096, 14336)
    assert len(big.graph.nodes) == 1 + 32 * 14 + 2


@pytest.mark.slow
def test_gguf_and_its_hf_checkpoint_give_the_same_weights(smollm2_hf_dir):
    from optc.testing import SMOLLM2_SOURCE

    gguf, hf = load_source(SMOLLM2_SOURCE), load_source(str(smollm2_hf_dir))
    assert gguf.graph.config == hf.graph.config
    assert gguf.graph.config.num_heads == 9 and gguf.graph.config.num_kv_heads == 3
    assert gguf.graph.config.tie_word_embeddings
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight", "model.norm.weight"):
        assert torch.equal(gguf.store.get(name), hf.store.get(name)), name
