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
from optc.runtime.batch import ForwardBatch
from optc.testing import assert_close, build_artifact, hf_cached_greedy, random_hf_model

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
    return preset, hf, plain, fused, prompts, [_hf_cached_greedy(hf, ids) for ids in prompts]


def _hf_cached_greedy(hf, ids: list[int]) -> list[int]:
    """NEW_TOKENS greedy tokens of a transformers model, one forward per token over its KV cache."""
    return hf_cached_greedy(hf, ids, NEW_TOKENS)


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
        num_groups = len(model.kv_groups)  # KV-cache groups: a block list each, one after the other
        for ids in prompts:
            num_blocks = (1 + len(ids) // 16) * num_groups
            caches = model.allocate_kv_caches(num_blocks + 1, 16)
            batch = ForwardBatch.build([ids], [0], [list(range(1, num_blocks + 1))], 16, [len(ids)], num_groups)
            with torch.no_grad():
                expected = hf(torch.tensor([ids])).logits[0]
            assert_close(model.forward(batch, caches), expected, rtol=1e-4,
                         what=f"{preset} {artifact.name}: logits of a {len(ids)}-token prompt")
