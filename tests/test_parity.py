"""optc vs transformers: greedy token ids equal and last-position logits within 1e-4 relative
(random:tiny with and without fusion; SmolLM2 in float32, plain and chat prompts)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from optc.runtime import Engine, SamplingParams
from optc.runtime.batch import ForwardBatch
from optc.testing import assert_close, build_artifact, tiny_hf_model

NEW_TOKENS = 48
SMOLLM2_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "The three primary colors are",
    "Explain what a hash table is in one sentence.",
]


def _prompt_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    model = engine.model
    caches = model.allocate_kv_caches(2 + len(ids) // 16, 16)
    batch = ForwardBatch.build([ids], [0], [list(range(1, 2 + len(ids) // 16))], 16)
    return model.forward(batch, caches)[-1]


def _hf_greedy(hf, ids: list[int], eos) -> list[int]:
    out = hf.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def tiny_hf():
    return tiny_hf_model()


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_tiny_greedy_and_logits_match_transformers(tmp_path, recipes, tiny_hf, fused):
    overrides = () if fused else ("passes=[]",)
    engine = Engine.load(build_artifact(tmp_path / "a", recipes / "tiny.yaml", *overrides))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 5, 17, 33, 64)]
    completions = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    for ids, c in zip(prompts, completions, strict=True):
        assert c.token_ids == _hf_greedy(tiny_hf, ids, None), f"prompt of {len(ids)} tokens"
        with torch.no_grad():
            expected = tiny_hf(torch.tensor([ids])).logits[0, -1]
        assert_close(_prompt_logits(engine, ids), expected, rtol=1e-4, what="last-position logits")


@pytest.fixture(scope="module")
def smollm2(smollm2_hf_dir, smollm2_f32_artifact):
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_hf_dir), dtype=torch.float32).eval()
    return hf, AutoTokenizer.from_pretrained(str(smollm2_hf_dir)), Engine.load(smollm2_f32_artifact)


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_smollm2_greedy_and_logits_match_transformers(smollm2, chat):
    hf, tok, engine = smollm2
    completions = engine.generate(SMOLLM2_PROMPTS, SamplingParams(max_tokens=NEW_TOKENS), chat=chat)
    eos = hf.generation_config.eos_token_id
    for text, c in zip(SMOLLM2_PROMPTS, completions, strict=True):
        if chat:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        else:
            ids = tok(text)["input_ids"]
        assert c.prompt_token_ids == ids
        assert c.token_ids == _hf_greedy(hf, ids, eos), text
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0, -1]
        assert_close(_prompt_logits(engine, ids), expected, rtol=1e-4, what=f"logits for {text!r}")
