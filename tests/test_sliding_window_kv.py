"""Sliding-window layers in the paged KV cache, end to end on random:gemma3-tiny (layers: sliding,
sliding, full; window 12): a local layer's blocks stay bounded by its window over a sequence several
windows long while the full layer's grow, and the tokens stay transformers'; prefix caching,
preemption, chunked prefill and n-gram speculation give the tokens of a plain engine."""

from __future__ import annotations

import pytest
import torch

from optc.core.settings import SpeculativeConfig
from optc.runtime import Engine, SamplingParams
from optc.runtime.block_pool import NULL_BLOCK_ID
from optc.runtime.kv_cache_manager import max_request_blocks
from optc.testing import (
    assert_no_leaks,
    build_artifact,
    hf_cached_greedy,
    hf_cached_greedy_logprobs,
    random_hf_model,
)

WINDOW, BLOCK = 12, 4
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)
SCORED = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_artifact(tmp_path_factory.mktemp("gemma3") / "a", None, "dtype=float32", "passes=[]",
                          model="random:gemma3-tiny")


def _prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def hf():
    return random_hf_model("gemma3-tiny")


def _scored(engine: Engine, prompts: list[list[int]]) -> list[list[tuple[int, float]]]:
    """Each prompt's greedy tokens with their log-probabilities, all requests at once."""
    requests = [engine.add_request(p, SCORED) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [_pairs(r) for r in requests]


def _pairs(request) -> list[tuple[int, float]]:
    return list(zip(request.output_token_ids, (lp.logprob for lp in request.logprobs), strict=True))


def _assert_transformers(got: list[list[tuple[int, float]]], hf, prompts: list[list[int]]) -> None:
    """Tokens equal transformers', log-probabilities within 1e-4: the random model's greedy tokens
    barely move (a wrong key in a local layer can leave them as they are), its log-probabilities do."""
    for ours, prompt in zip(got, prompts, strict=True):
        want = hf_cached_greedy_logprobs(hf, prompt, PARAMS.max_tokens)
        assert [t for t, _ in ours] == [t for t, _ in want]
        assert [lp for _, lp in ours] == pytest.approx([lp for _, lp in want], abs=1e-4)


def test_local_layers_blocks_stay_within_their_window_and_tokens_equal_transformers(gemma3, hf):
    engine = Engine.load(gemma3, block_size=BLOCK, max_num_batched_tokens=8)
    kv = engine.kv_manager
    assert kv.windows == (None, WINDOW, WINDOW)  # groups: layer 2 (full), layer 0, layer 1
    prompt = _prompt(45)  # 45 + 40 tokens: 7 windows
    request = engine.add_request(prompt, SCORED)
    step_bound = max_request_blocks((WINDOW,), 1 << 20, BLOCK, 8)  # a prefill chunk of 8: 6 blocks
    decode_bound = -(-WINDOW // BLOCK) + 1  # 4
    num_sliding_blocks = []
    while not request.is_finished:
        engine.step()
        if request.is_finished:
            break
        full, *sliding = kv.group_block_ids(request.request_id)
        assert len(full) == -(-request.num_computed_tokens // BLOCK) and NULL_BLOCK_ID not in full  # grows
        held = [sum(b != NULL_BLOCK_ID for b in blocks) for blocks in sliding]
        bound = decode_bound if request.num_computed_tokens > len(prompt) else step_bound
        assert max(held) <= bound, (request.num_computed_tokens, held)
        num_sliding_blocks.append(held[0])
    assert len(full) == 21 and max(num_sliding_blocks[-30:]) == decode_bound  # 84 tokens: 21 blocks vs 4
    _assert_transformers([_pairs(request)], hf, [prompt])
    assert_no_leaks(engine)


def test_prefix_hits_and_preemption_give_transformers_tokens(gemma3, hf):
    shared = _prompt(30, seed=2)  # a prefix of 2.5 windows
    prompts = [shared + _prompt(3 + 4 * i, seed=10 + i) for i in range(4)] + [_prompt(17, seed=20)]
    # 40 usable blocks: 3 groups of a 70-token request need 18 + 2 x 6 blocks, so five of them preempt
    engine = Engine.load(gemma3, block_size=BLOCK, num_blocks=41, max_num_batched_tokens=16)
    _assert_transformers(_scored(engine, prompts[:1]), hf, prompts[:1])
    _assert_transformers(_scored(engine, prompts), hf, prompts)  # hits on the first one's blocks, each other's
    stats = engine.stats()
    assert stats.num_prefix_cache_hit_tokens > 0 and stats.num_preemptions > 0
    assert_no_leaks(engine)


def test_the_pool_counts_a_block_as_one_layer_and_a_sliding_group_up_to_its_bound(gemma3):
    # the CPU default pool: what max_num_seqs requests of the whole context hold, with steps of 8 tokens
    engine = Engine.load(gemma3, block_size=BLOCK, max_seq_len=96, max_num_batched_tokens=8)
    config, kv = engine.config, engine.kv_manager
    layer_block = 2 * BLOCK * 1 * 32 * 4  # K and V of 4 tokens, 1 KV head x 32, fp32: the groups share the pool
    assert engine.model.kv_bytes_per_block(BLOCK) == layer_block
    per_request = 24 + 2 * (-(-(WINDOW - 1 + 8) // BLOCK) + 1)  # full: 96 tokens; sliding: 12 - 1 + 8 keys
    assert per_request == max_request_blocks(kv.windows, 24, BLOCK, 8) == 36  # every layer: 72
    assert kv.num_blocks == config.max_num_seqs * per_request + 1
    assert kv.num_token_capacity >= 96  # a request of the whole context fits


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_gives_transformers_tokens(gemma3, hf, method):
    # drafts roll back to the step's start at most, past what the sliding groups released; a draft
    # model (gemma3-tiny itself: every draft accepted) keeps sliding groups in its own pool too
    prompts = [[5, 6, 7, 8, 9] * 7, _prompt(20, seed=3) * 2, _prompt(9, seed=4)]
    spec = SpeculativeConfig.parse("ngram" if method == "ngram" else f"draft:{gemma3}:3")
    engine = Engine.load(gemma3, block_size=BLOCK, speculative=spec, max_num_batched_tokens=16)
    _assert_transformers(_scored(engine, prompts), hf, prompts)
    assert engine.stats().num_draft_tokens > 0
    if method == "draft":
        draft = engine.speculator.proposer.kv_manager
        assert draft.windows == (None, WINDOW, WINDOW) and draft.num_free_blocks == draft.num_blocks - 1
    assert_no_leaks(engine)


def test_tensor_parallel_ranks_follow_the_groups_block_ids(gemma3, hf):
    # two ranks (gloo): rank 0 releases blocks and preempts, both write where the step's group tables say
    prompts = [_prompt(30, seed=30 + i) for i in range(3)]
    engine = Engine.load(gemma3, tensor_parallel_size=2, block_size=BLOCK, num_blocks=41, max_num_batched_tokens=16)
    try:
        _assert_transformers(_scored(engine, prompts), hf, prompts)
        assert engine.stats().num_preemptions > 0
        assert_no_leaks(engine)
    finally:
        engine.close()


@pytest.mark.gpu
def test_local_layers_on_cuda_stay_bounded_and_give_transformers_tokens(tmp_path):
    # the Triton rope + KV store writes through each group's slot mapping; attention runs the Triton
    # kernels where they take a window (else its reference, eager), over each group's block table
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: random:gemma3-tiny\ndtype: float32\ntarget: cuda\npasses: [fuse_qkv, fuse_gate_up, "
                      "fuse_add_rmsnorm, fuse_rope_kv, {kv_layout: {block_size: 16}}, select_kernels, cuda_graphs]\n")
    engine = Engine.load(build_artifact(tmp_path / "a", recipe), device="cuda", num_blocks=256)
    requests = [engine.add_request(p, PARAMS) for p in (_prompt(45), _prompt(70, seed=5))]  # 7 and 9 windows
    bound = max_request_blocks((WINDOW,), 1 << 20, 16, engine.config.max_num_batched_tokens)
    while engine.has_unfinished():
        engine.step()
        for request in requests:
            for blocks in engine.kv_manager.group_block_ids(request.request_id)[1:]:  # the sliding groups
                assert sum(b != NULL_BLOCK_ID for b in blocks) <= bound
    hf = random_hf_model("gemma3-tiny", device="cuda")
    assert [r.output_token_ids for r in requests] == [hf_cached_greedy(hf, r.prompt_token_ids, 40) for r in requests]
    assert_no_leaks(engine)
