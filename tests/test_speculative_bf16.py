"""Greedy speculative decoding is plain decoding, bit for bit, on a bfloat16 CPU target bound to optc's C++ ops:
a verification's k + 1 rows give every node the output the same rows give one at a time in decode steps.

The model is SmolLM2's layer shape (hidden 576, intermediate 1536, 9 query heads over 3 KV heads of 64), two
layers, transformers' random initialization: its logits are nearly flat, so a last-bit difference anywhere
changes greedy tokens. Without row_attention (verification on the reference's prefill path) and without the
one-row linear as two rows (torch's gemv for K = 1536), the per-node test fails at the attention and the
down_proj, and the token test fails."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from optc.core.artifact import read
from optc.core.execute import Step
from optc.core.settings import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from optc.runtime import Engine, SamplingParams
from optc.runtime.batch import ForwardBatch
from optc.runtime.loader import load_model
from optc.testing import assert_no_leaks, build_artifact, cpu_extension


@pytest.fixture(scope="module", autouse=True)
def _ops_built():
    """ops.cpp built: a failed build fails these tests (no compiler or no AVX2: skipped, saying so)."""
    cpu_extension()


PASSES = ("passes=[fuse_qkv, fuse_gate_up, fuse_add_rmsnorm, fuse_rope_kv, {kv_layout: {block_size: 16}}, "
          "select_kernels, plan_cpu_step]")  # the plan: decode and verification steps through the fused step
BLOCK = 16
GREEDY = SamplingParams(max_tokens=40)
PROMPTS = [[(7 * i + 13 * j) % 250 + 3 for j in range(4 + 9 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_artifact) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("bf16-verify")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=256, max_position_embeddings=512,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(tmp / "hf")
    shutil.copytree(tiny_artifact / "tokenizer", tmp / "hf", dirs_exist_ok=True)  # a byte tokenizer
    return build_artifact(tmp / "a", None, "dtype=bfloat16", "target=cpu", PASSES, model=str(tmp / "hf"))


def test_the_target_binds_the_cpp_ops(artifact):
    kernels = {n.op: n.kernel for n in read(artifact).graph.nodes}
    assert kernels["attention"] == "cpu.cpp_attention" and kernels["rope_kv_store"] == "cpu.cpp_rope_kv_store"


def _node_outputs(model, caches, tokens: list[int], start: int, num_logits: int) -> list[tuple[str, list]]:
    """Every node's outputs for one request's `tokens` at positions start.. (blocks 1, 2, ...)."""
    blocks = list(range(1, 1 + -(-(start + len(tokens)) // BLOCK)))
    batch = ForwardBatch.build([tokens], [start], [blocks], BLOCK, [num_logits])
    seen = []
    step = Step(batch.positions, batch, model.cos_sin, batch.logits_indices, caches)
    model.executor.run(batch.input_ids, step, lambda i, node, inputs, outputs: seen.append(
        (node.name, [o.clone() for o in outputs])))
    return seen


@pytest.mark.parametrize("k", [4, MAX_SPECULATIVE_TOKENS])
def test_a_verification_row_is_its_decode_row_at_every_node(artifact, k):
    model = load_model(read(artifact))
    g = torch.Generator().manual_seed(k)
    prompt, drafts = torch.randint(3, 256, (37,), generator=g).tolist(), torch.randint(3, 256, (k + 1,),
                                                                                         generator=g).tolist()
    decode_caches, verify_caches = (model.allocate_kv_caches(8, BLOCK) for _ in range(2))
    for caches in (decode_caches, verify_caches):
        _node_outputs(model, caches, prompt, 0, 1)
    decoded = [_node_outputs(model, decode_caches, [t], len(prompt) + i, 1) for i, t in enumerate(drafts)]
    verified = _node_outputs(model, verify_caches, drafts, len(prompt), k + 1)
    for row, steps in enumerate(decoded):
        for (name, one), (_, rows) in zip(steps, verified, strict=True):
            for a, b in zip(one, rows, strict=True):  # (1, ...) against (k + 1, ...): that row
                assert torch.equal(a[0], b[row]), f"row {row} of {k + 1}: node {name} differs"
    assert torch.equal(decode_caches[1].data, verify_caches[1].data)  # and the KV entries they stored


class _Oracle:
    """Drafts the plain run's next tokens, every third draft changed: long accepted runs and rejections."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        self.answers = {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}

    def propose(self, requests, num_tokens):
        drafts = []
        for request, k in zip(requests, num_tokens, strict=True):
            answer = self.answers[tuple(request.prompt_token_ids)]
            done = request.num_output_tokens
            draft = list(answer[done : done + k])
            drafts.append([t if (done + i) % 3 else (t + 1) % 256 for i, t in enumerate(draft)])
        return drafts, [None] * len(drafts)

    def release(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize("k", [3, 8])
def test_greedy_speculative_tokens_are_plain_decodings(artifact, k):
    plain = [c.token_ids for c in Engine.load(artifact).generate(PROMPTS, GREEDY)]
    one_by_one = [Engine.load(artifact).generate([p], GREEDY)[0].token_ids for p in PROMPTS[:2]]
    assert one_by_one == plain[:2]  # batched decode steps are batch-1 ones
    spec = SpeculativeConfig("ngram", k, disable_above_num_requests=64, adaptive=False)
    for proposer in ("ngram", "oracle"):
        engine = Engine.load(artifact, speculative=spec)
        if proposer == "oracle":
            engine.speculator.proposer = _Oracle(PROMPTS, plain)
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == plain, proposer
        assert engine.stats().num_accepted_tokens > (len(PROMPTS) * 10 if proposer == "oracle" else 0)
        assert_no_leaks(engine)
