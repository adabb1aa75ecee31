"""import_draft_head: an EAGLE-1 checkpoint in the layout of github.com/SafeAILab/EAGLE (config.json with
its `bias` key; fc and `layers.0.*` tensors, no input norm) read into the artifact. The imported head's
forward is checked against transformers' LlamaDecoderLayer with its input norm removed (EAGLE-1's
cnets1.py: layer 0 has none) behind the fc; `--speculative eagle` on it decodes greedy tokens identical
to plain decoding, also with its linears rounded by a later RTN pass; bad checkpoints are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from optc.core.artifact import read, sha256_file
from optc.core.eagle import EagleHead
from optc.core.errors import InputError
from optc.core.settings import SpeculativeConfig
from optc.frontend.passmanager import PassContext, make_pass
from optc.frontend.sources import load_source
from optc.runtime import Engine, SamplingParams
from optc.testing import build_artifact

INTERMEDIATE = 96  # the head's own MLP width, not the target's


def _checkpoint(directory: Path, hidden: int, vocab: int, *, bias: bool = True, fmt: str = "safetensors",
                **config) -> Path:
    """A random EAGLE-1 head for a target of `hidden` / `vocab`: 4 heads over 2 KV heads."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d = 4, 2, hidden // 4

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    state = {"fc.weight": rand(hidden, 2 * hidden),
             "layers.0.self_attn.q_proj.weight": rand(heads * d, hidden),
             "layers.0.self_attn.k_proj.weight": rand(kv_heads * d, hidden),
             "layers.0.self_attn.v_proj.weight": rand(kv_heads * d, hidden),
             "layers.0.self_attn.o_proj.weight": rand(hidden, heads * d),
             "layers.0.post_attention_layernorm.weight": 1 + rand(hidden),
             "layers.0.mlp.gate_proj.weight": rand(INTERMEDIATE, hidden),
             "layers.0.mlp.up_proj.weight": rand(INTERMEDIATE, hidden),
             "layers.0.mlp.down_proj.weight": rand(hidden, INTERMEDIATE),
             "embed_tokens.weight": rand(vocab, hidden)}  # some published heads carry it; never read
    if bias:
        state["fc.bias"] = rand(hidden)
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
          "intermediate_size": INTERMEDIATE, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
          "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 5000.0, "vocab_size": vocab, "bias": bias,
          **config}
    (directory / "config.json").write_text(json.dumps(hf))
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.half() for k, v in state.items()}, str(directory / "model.safetensors"))
    else:
        torch.save({k: v.half() for k, v in state.items()}, directory / "pytorch_model.bin")
    return directory


def _import(directory: Path):
    source = load_source("random:tiny")
    return source, make_pass("import_draft_head", {"path": str(directory)}).run(
        source.graph, source.store, PassContext())


def _reference(directory: Path, tokens, features, embedding):
    """EAGLE-1's draft forward written with transformers' Llama layer: fc(cat(embed, feature)), then
    the decoder layer with its input norm replaced by the identity (cnets1.py's index-0 layer)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    hf = json.loads((directory / "config.json").read_text())
    config = LlamaConfig(**{k: v for k, v in hf.items() if k not in ("bias", "architectures", "model_type")})
    config._attn_implementation = "eager"
    from safetensors.torch import load_file

    state = {k: v.float() for k, v in load_file(str(directory / "model.safetensors")).items()}
    layer = LlamaDecoderLayer(config, layer_idx=0).eval()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in state.items() if k.startswith("layers.0.")},
                          strict=False)
    layer.input_layernorm = torch.nn.Identity()
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size)
    fc.load_state_dict({"weight": state["fc.weight"], "bias": state["fc.bias"]})
    x = fc(torch.cat([embedding[tokens], features], dim=-1))[None]
    t = x.shape[1]
    positions = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    out = layer(x, attention_mask=mask, position_ids=positions,
                position_embeddings=LlamaRotaryEmbedding(config)(x, positions))
    return (out[0] if isinstance(out, tuple) else out)[0]


def test_the_imported_head_computes_eagle_1s_forward(tmp_path):
    directory = _checkpoint(tmp_path / "head", 64, 256)
    source, result = _import(directory)
    section = result.manifest["draft_head"]
    assert section["method"] == "eagle-1 import"
    assert section["source"]["sha256"]["model.safetensors"] == sha256_file(directory / "model.safetensors")
    config = section["config"]
    assert not config["input_norm"] and len(config["vocab_ids"]) == 256
    from optc.core.eagle import EagleHeadConfig

    head_config = EagleHeadConfig.from_json(config)
    weights = {n: result.store.get(n).float() for n in head_config.tensor_shapes()}
    assert "eagle.input_layernorm.weight" not in weights
    embedding = source.store.get("model.embed_tokens.weight").float()
    head = EagleHead(head_config, weights, embedding, embedding)
    tokens = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1))
    features = torch.randn(12, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, _ = head.forward(tokens, features, torch.arange(12))
        expected = _reference(directory, tokens, features, embedding)
    torch.testing.assert_close(ours, expected, atol=2e-5, rtol=1e-5)


def test_pytorch_bin_without_fc_bias_imports(tmp_path):
    _, result = _import(_checkpoint(tmp_path / "head", 64, 256, bias=False, fmt="bin"))
    assert torch.equal(result.store.get("eagle.fc.bias"), torch.zeros(64))
    assert "pytorch_model.bin" in result.manifest["draft_head"]["source"]["sha256"]


def test_speculative_eagle_on_an_imported_head_is_greedy_identical(tmp_path, recipes):
    directory = _checkpoint(tmp_path / "head", 64, 256)
    path = build_artifact(tmp_path / "a", recipes / "tiny.yaml",
                          f"passes=[fuse_qkv, fuse_gate_up, {{import_draft_head: {{path: {directory}}}}}]")
    assert read(path).manifest.draft_head["method"] == "eagle-1 import"
    prompts = ["The quick brown fox", "jumps over the lazy dog, again and again"]
    greedy = SamplingParams(max_tokens=16)
    plain = [c.token_ids for c in Engine.load(path).generate(prompts, greedy)]
    engine = Engine.load(path, speculative=SpeculativeConfig("eagle", 3))
    assert [c.token_ids for c in engine.generate(prompts, greedy)] == plain
    assert engine.stats().num_draft_tokens > 0


def test_a_later_rtn_pass_rounds_the_heads_linears(tmp_path, recipes):
    """Like the model's: int8 per channel, norms and the fc bias left float; the runtime dequantizes the
    head at load and greedy decoding stays identical to plain."""
    directory = _checkpoint(tmp_path / "head", 64, 256)
    path = build_artifact(tmp_path / "a", recipes / "tiny.yaml",
                          f"passes=[fuse_qkv, fuse_gate_up, {{import_draft_head: {{path: {directory}}}}}, "
                          "{quantize_rtn: {bits: 8}}]")
    artifact = read(path)
    formats = {n: t.format for n, t in artifact.graph.tensors.items() if n.startswith("eagle.")}
    assert formats["eagle.fc.weight"].is_quantized and formats["eagle.down_proj.weight"].is_quantized
    assert not formats["eagle.fc.bias"].is_quantized
    assert not formats["eagle.post_attention_layernorm.weight"].is_quantized
    stats = next(p for p in artifact.manifest.passes if p["name"] == "quantize_rtn")["stats"]
    assert stats["draft_head_tensors"] == 5
    prompts = ["The quick brown fox", "jumps over the lazy dog, again and again"]
    greedy = SamplingParams(max_tokens=16)
    plain = [c.token_ids for c in Engine.load(path).generate(prompts, greedy)]
    engine = Engine.load(path, speculative=SpeculativeConfig("eagle", 3))
    assert [c.token_ids for c in engine.generate(prompts, greedy)] == plain
    from optc.runtime.eagle import load_eagle_head

    head = load_eagle_head(artifact, engine.model)
    from safetensors.torch import load_file

    fc = load_file(str(directory / "model.safetensors"))["fc.weight"].float()
    error = (head.w["fc.weight"] - fc).abs().max() / fc.abs().max()
    assert 0 < error < 1 / 127  # int8 per channel: within half a step of the row's largest


@pytest.mark.parametrize(("method", "options"), [("gptq", "{bits: 8}"),
                                                ("awq", "{bits: 4, group_size: 32, zero_point: true}")])
def test_rounding_only_the_head_keeps_the_models_quantization_record(tmp_path, recipes, method, options):
    """GPTQ int8 (or AWQ int4), then a head, then RTN in the same format: RTN rounds the head alone and the
    manifest still names the calibrated method."""
    directory = _checkpoint(tmp_path / "head", 64, 256)
    path = build_artifact(tmp_path / "a", recipes / "tiny.yaml",
                          f"passes=[fuse_qkv, fuse_gate_up, {{quantize_{method}: {options}}}, "
                          f"{{import_draft_head: {{path: {directory}}}}}, {{quantize_rtn: {options}}}]",
                          "calibration.samples=4", "calibration.seq_len=32")
    artifact = read(path)
    assert artifact.manifest.quantization["method"] == method
    assert artifact.graph.tensors["eagle.qkv_proj.weight"].format.is_quantized
    stats = next(p for p in artifact.manifest.passes if p["name"] == "quantize_rtn")["stats"]
    assert stats["quantized"] == stats["draft_head_tensors"] == 5


@pytest.mark.parametrize(("config", "match"), [
    ({"hidden_size": 32}, "hidden_size 32; the target's is 64"),
    ({"vocab_size": 300}, "vocab_size 300; the target's is 256"),
    ({"draft_vocab_size": 32}, "EAGLE-3"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"num_hidden_layers": 2}, "num_hidden_layers 2"),
])
def test_foreign_checkpoints_are_refused_by_name(tmp_path, config, match):
    directory = _checkpoint(tmp_path / "head", 64, 256)
    hf = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**hf, **config}))
    with pytest.raises(InputError, match=match):
        _import(directory)


def test_missing_files_and_tensors_are_named(tmp_path):
    with pytest.raises(InputError, match="no config.json"):
        _import(tmp_path)
    directory = _checkpoint(tmp_path / "head", 64, 256)
    from safetensors.torch import load_file, save_file

    state = load_file(str(directory / "model.safetensors"))
    del state["layers.0.mlp.up_proj.weight"]
    save_file(state, str(directory / "model.safetensors"))
    with pytest.raises(InputError, match="no tensor layers.0.mlp.up_proj.weight"):
        _import(directory)
    state["layers.0.mlp.up_proj.weight"] = torch.zeros(INTERMEDIATE + 1, 64)
    save_file(state, str(directory / "model.safetensors"))
    with pytest.raises(InputError, match=r"up_proj.weight has shape \(97, 64\)"):
        _import(directory)
    source = load_source("random:tiny")
    with pytest.raises(InputError, match="needs path"):
        make_pass("import_draft_head", {}).run(source.graph, source.store, PassContext())
