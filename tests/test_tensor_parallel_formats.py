"""Quantized artifacts split (gloo) on random:tiny, float32 activations: int8 (per output channel) at 2
and 4 ranks and int4 (RTN, groups of 32, zero points) at 2 give one rank's greedy tokens, batched and
one at a time, and its logits within 1e-4. tiny's o_proj and down_proj read 64 and 128 inputs, so 2
ranks take whole groups of 32; 4 ranks would cut them (the smallest group is 32), and groups of 64
are cut at 2 ranks, which is a load-time error. SmolLM2's int4 at 3 ranks:
test_tensor_parallel_smollm2.py."""

from __future__ import annotations

import pytest

from optc.core.ops.sharding import ShardError
from optc.runtime import Engine, SamplingParams
from optc.testing import assert_close, assert_no_leaks, build_artifact

QUANTIZE = {"int8": "{quantize_rtn: {bits: 8}}",
            "int4-g32": "{quantize_rtn: {bits: 4, group_size: 32, zero_point: true}}"}
SPLITS = [("int8", 2), ("int4-g32", 2), ("int8", 4)]
PROMPTS = [[(11 * i + 5 * j) % 256 for j in range(2 + 6 * i)] for i in range(6)]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def _build(tmp_path_factory, recipes, quantize: str):
    return build_artifact(tmp_path_factory.mktemp("tiny-q") / "a", recipes / "tiny.yaml",
                          f"passes=[fuse_qkv, fuse_gate_up, {quantize}]")


@pytest.fixture(scope="module", params=SPLITS, ids=[f"{name}-tp{size}" for name, size in SPLITS])
def engines(request, tmp_path_factory, recipes):
    name, size = request.param
    artifact = _build(tmp_path_factory, recipes, QUANTIZE[name])
    one = Engine.load(artifact)
    split = Engine.load(artifact, tensor_parallel_size=size)
    yield one, split
    split.close()


def test_quantized_logits_match_one_rank(engines):
    one, split = engines
    prompt = PROMPTS[3]
    for args in (([prompt], [0], [[1, 2]], [len(prompt)]), ([[9]], [len(prompt)], [[1, 2]], [1])):
        assert_close(split.runner.forward(*args), one.runner.forward(*args), atol=1e-4, what="tensor-parallel logits")


def test_quantized_greedy_tokens_match_one_rank(engines):
    one, split = engines
    want = [c.token_ids for c in one.generate(PROMPTS, PARAMS)]
    assert [c.token_ids for c in split.generate(PROMPTS, PARAMS)] == want
    for i in (0, 5):
        assert split.generate([PROMPTS[i]], PARAMS)[0].token_ids == want[i]
    assert_no_leaks(split)


def test_int4_groups_that_ranks_would_cut_are_a_load_error(tmp_path_factory, recipes):
    artifact = _build(tmp_path_factory, recipes, "{quantize_rtn: {bits: 4, group_size: 64}}")
    with pytest.raises(ShardError, match=r"self_attn.o_proj.weight \(int4_g \[64, 64\]\).* cuts a stored unit of 64"):
        Engine.load(artifact, tensor_parallel_size=2)
