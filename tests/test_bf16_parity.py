"""bfloat16 on the CPU: optc answers chat prompts like transformers in bfloat16 on the same weights,
on every CPU kernel path (AVX2 as on a machine without AVX-512, ATen's scalar `default`, and this
machine's own), fused and unfused graphs, one request at a time and batched. The prompts' chat
templates are 34-40 tokens: every decode follows a prefill that ends inside a KV block.

The rule for "like transformers" (bfloat16 logits are rounded to 8 significant bits: one step is
0.125 at |logit| in [16, 32)): the greedy tokens are equal up to the first position where they differ,
and there transformers' own logits of its token and of optc's are at most one bfloat16 step apart — a
tie within bfloat16 rounding, which transformers breaks by token id and optc by its float32 logits
(optc.core.ops.linear.logits_ref). After that the two continue from different contexts and are not
compared. "What is the capital of France?" (the README's prompt) must answer the exact sentence.

Also here: the defect that made the README's prompt answer "L'Étoile, la Marseillaise, ..." on AVX2
CPUs, as the smallest torch snippet (docs/PERF.md, "bf16 on AVX2 CPUs").
"""

from __future__ import annotations

import pytest
import torch

from optc.core.formats import Format
from optc.core.ops.linear import logits_ref
from optc.testing import CPU_KERNEL_PATHS, build_artifact, greedy_token_ids_in

PROMPTS = [
    "What is the capital of France?",
    "What is 2+2?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "Give me a synonym for happy.",
]
NEW_TOKENS = 24
PARIS = "The capital of France is Paris."


def _bf16_step(value: float) -> float:
    """The spacing of bfloat16 numbers at |value| (8 significant bits)."""
    return 2.0 ** (torch.tensor(abs(value)).clamp_min(1e-30).log2().floor().item() - 7)


def test_bf16_logits_round_near_ties_into_ties():
    # the defect, in two lines of torch: two logits 0.015 apart in float32 (the AVX2 path's first
    # token, "The" vs "L") are one bfloat16 value, and argmax takes the lower token id
    x = torch.tensor([[1.0, 0.015625]], dtype=torch.bfloat16)
    w = torch.tensor([[20.25, 0.0], [20.25, 1.0]], dtype=torch.bfloat16)  # token 0 "L": 20.25, 1 "The": 20.265625
    assert torch.nn.functional.linear(x, w).argmax().item() == 0  # rounded: both 20.25, the tie goes to 0
    assert (x.float() @ w.float().T).argmax().item() == 1
    assert logits_ref(x, {"weight": w}, Format(dtype="bfloat16")).argmax().item() == 1


@pytest.mark.parametrize("fmt", [Format(dtype="bfloat16"), Format(dtype="float16")], ids=["bf16", "fp16"])
def test_logits_ref_top_is_float32_exact(fmt):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(fmt.torch_dtype)
    w = (torch.randn(1000, 96, generator=g) * 0.3).to(fmt.torch_dtype)
    exact = x.float() @ w.float().T
    got = logits_ref(x, {"weight": w}, fmt)
    assert got.dtype == torch.float32
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    top = exact.topk(4, dim=-1).indices
    torch.testing.assert_close(got.gather(1, top), exact.gather(1, top), rtol=1e-6, atol=1e-5)
    # the rest is the 16-bit matmul's rounding of the same numbers
    torch.testing.assert_close(got, exact, rtol=2 ** -7, atol=2 ** -7 * exact.abs().max().item())


@pytest.fixture(scope="module")
def bf16_artifacts(tmp_path_factory, smollm2_bf16_artifact, recipes):
    root = tmp_path_factory.mktemp("bf16")
    return {
        "fused": smollm2_bf16_artifact,
        "unfused": build_artifact(root / "unfused", recipes / "smollm2-bf16.yaml",
                                  "passes=[{kv_layout: {block_size: 16}}, select_kernels]"),
    }


@pytest.fixture(scope="module")
def transformers_bf16(bf16_artifacts):
    """transformers' greedy tokens and per-step logits, bfloat16, on the artifact's own weights."""
    from transformers import AutoTokenizer

    from optc.frontend.models import hf_model_from_artifact

    path = bf16_artifacts["fused"]
    tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer")
    hf = hf_model_from_artifact(path, torch.device("cpu"), torch.bfloat16)
    out = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        assert len(ids) % 16, f"{prompt!r}: a prefill of {len(ids)} tokens fills its last KV block"
        res = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
        out.append((res.sequences[0, len(ids):].tolist(), [step[0].float() for step in res.logits]))
    return tokenizer, out


@pytest.mark.slow
@pytest.mark.parametrize("graph", ["fused", "unfused"])
@pytest.mark.parametrize("path", list(CPU_KERNEL_PATHS))
def test_smollm2_bf16_greedy_like_transformers(bf16_artifacts, transformers_bf16, graph, path):
    tokenizer, reference = transformers_bf16
    runs = greedy_token_ids_in(path, bf16_artifacts[graph], PROMPTS, NEW_TOKENS)
    for mode, completions in runs.items():
        assert tokenizer.decode(completions[0], skip_special_tokens=True) == PARIS, mode
        for prompt, got, (expected, logits) in zip(PROMPTS, completions, reference, strict=True):
            where = f"{prompt!r} ({mode})"
            t = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
            if t is None:
                assert len(got) == len(expected), f"{where}: {len(got)} tokens, transformers {len(expected)}"
                continue
            ours, theirs = logits[t][got[t]].item(), logits[t][expected[t]].item()
            step = _bf16_step(max(abs(ours), abs(theirs)))
            assert theirs - ours <= step, (
                f"{where}: token {t} is {got[t]} where transformers says {expected[t]}; its logits "
                f"{theirs:.4f} vs {ours:.4f} differ by more than one bfloat16 step ({step})")
