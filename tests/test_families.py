"""The model families beyond Llama (Qwen3, Gemma 2, Gemma 3, Phi-3) against transformers, float32, on each
family's random preset (optc/frontend/sources.py PRESETS: the same weights load in transformers).

Greedy tokens equal transformers' (the model stepped one token at a time over its own KV cache) for
prompts longer than the sliding windows, batched and one at a time, with chunked prefill and preemption,
decoding across block boundaries; every prompt position's logits within 1e-4 relative; the fused build
(qkv, gate-up, add + norm, rope + KV store) equals the plain one. Phi-3's prompts stay below its LongRoPE
original length (32) and decode past it, where transformers' rotary module switches to the long factors
for the new tokens only, as optc's per-position table does (`generate` would instead recompute the whole
cache at the switch: optc/core/rope.py).
"""

from __future__ import annotations

import pytest
import torch

from optc.runtime import Engine, SamplingParams
from optc.testing import (
    assert_close,
    assert_greedy_like_bf16,
    build_artifact,
    hf_cached_greedy,
    prefill_logits,
    random_hf_model,
)

PRESETS = ["qwen3-tiny", "gemma2-tiny", "gemma3-tiny", "phi3-tiny"]
FUSED = "passes=[fuse_qkv, fuse_gate_up, fuse_add_rmsnorm, fuse_rope_kv, kv_layout]"
NEW_TOKENS = 24
ENGINES = {"plain": {}, "chunked8": {"max_num_batched_tokens": 8},
           "preempt-chunked8": {"num_blocks": 12, "max_num_batched_tokens": 8, "max_num_seqs": 4}}


def _prompts(preset: str) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = (1, 9, 23, 30) if preset == "phi3-tiny" else (1, 9, 23, 45)  # windows: 12 and 20 tokens
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=PRESETS)
def family(request, tmp_path_factory):
    preset = request.param
    out = tmp_path_factory.mktemp(preset)
    plain = build_artifact(out / "plain", None, "dtype=float32", "passes=[]", model=f"random:{preset}")
    fused = build_artifact(out / "fused", None, "dtype=float32", FUSED, model=f"random:{preset}")
    hf = random_hf_model(preset)
    prompts = _prompts(preset)
    return preset, hf, plain, fused, prompts, [hf_cached_greedy(hf, ids, NEW_TOKENS) for ids in prompts]




@pytest.mark.parametrize("engine_config", list(ENGINES.values()), ids=list(ENGINES))
def test_greedy_tokens_match_transformers(family, engine_config):
    preset, _, plain, fused, prompts, expected = family
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    for artifact in (plain, fused):
        engine = Engine.load(artifact, **engine_config)
        batched = [c.token_ids for c in engine.generate(prompts, params)]
        single = [engine.generate([p], params)[0].token_ids for p in prompts]
        assert batched == expected, f"{preset} {artifact.name}: batched"
        assert single == expected, f"{preset} {artifact.name}: one at a time"


def test_every_prompt_position_logits_match_transformers(family):
    preset, hf, plain, fused, prompts, _ = family
    for artifact in (plain, fused):
        model = Engine.load(artifact).model
        for ids in prompts:
            with torch.no_grad():
                expected = hf(torch.tensor([ids])).logits[0]
            assert_close(prefill_logits(model, ids, every_position=True), expected, rtol=1e-4,
                         what=f"{preset} {artifact.name}: logits of a {len(ids)}-token prompt")


@pytest.mark.parametrize("preset", PRESETS)
def test_bf16_greedy_like_transformers(preset, tmp_path):
    """tests/test_bf16_parity.py's rule: tokens equal up to the first difference, and there transformers' own
    bfloat16 logits of both tokens are at most one bfloat16 step apart (a tie within its rounding)."""
    hf = random_hf_model(preset, torch.bfloat16)
    artifact = build_artifact(tmp_path / "a", None, "dtype=bfloat16", FUSED, model=f"random:{preset}")
    prompts = _prompts(preset)
    completions = Engine.load(artifact).generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert_greedy_like_bf16(hf, prompts, completions, NEW_TOKENS, f"{preset}, ")


@pytest.mark.parametrize("config, message", [
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}, "a multimodal model"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    ({"model_type": "qwen3", "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported; supported: silu"),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "transformers refuses this phi3 config"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
], ids=["multimodal", "bidirectional", "qwen3-gelu", "phi3-bad-longrope", "yarn"])
def test_unsupported_configs_are_user_errors_naming_what(config, message):
    from optc.core.errors import UnsupportedModelError
    from optc.frontend.models import config_from_hf

    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 256}
    with pytest.raises(UnsupportedModelError, match="x/config.json: .*" + message.replace("(", r"\(")):
        config_from_hf({**base, **config}, "x/config.json")


def test_inspect_shows_the_kv_cache_groups_of_sliding_window_families(family):
    from optc.commands.inspect import render, summarize

    preset, hf, plain, *_ = family
    s = summarize(plain)
    windows = {getattr(hf.config, "sliding_window", None) if t == "sliding_attention" else None
               for t in getattr(hf.config, "layer_types", None) or ["full_attention"]}
    assert {g["window"] for g in s["kv_cache_groups"]} == windows
    assert sorted(i for g in s["kv_cache_groups"] for i in g["layers"]) == list(range(hf.config.num_hidden_layers))
    line = [x for x in render(s).splitlines() if x.startswith("kv groups")]
    assert (len(line) == 1) == (len(s["kv_cache_groups"]) > 1)
    if line:
        for w in windows - {None}:
            assert f"window {w}: layers" in line[0]
