"""Engine: batched == single == reference, chunked prefill, preemption, prefix caching, seeded
sampling, stops, streaming, aborts, validation, and no leaked blocks after any test.

Most tests run a toy model whose logits are a function of the context tokens only, read back from
the paged KV cache through the block table (and it checks every position it reads holds the token
written for that position), so a wrong block table, a stale block or a bad prefix hit changes the
output or fails loudly. Tests on a real `random:tiny` artifact are at the end.
"""

import bisect
from pathlib import Path

import pytest
import torch

from optc.core.artifact import read
from optc.core.errors import InputError
from optc.core.kv_cache import KVCache
from optc.runtime import Completion, Engine, EngineConfig, SamplingParams
from optc.testing import assert_no_leaks

VOCAB = 64
EOS = 63


def toy_logits(context: list[int]) -> torch.Tensor:
    h = sum((t + 1) * (7 * j + 3) for j, t in enumerate(context)) % 1009
    return ((h + 37 * torch.arange(VOCAB)) % VOCAB).float() / 4.0  # a permutation: unique argmax


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_tokens and (not out or out[-1] != EOS):
        out.append(int(toy_logits(tokens).argmax()))
        tokens.append(out[-1])
    return out


class ToyModel:
    num_layers, num_kv_heads, head_dim, vocab_size = 1, 1, 2, VOCAB
    max_position_embeddings = 256
    eos_token_ids = [EOS]
    dtype, device = torch.float32, torch.device("cpu")

    def __init__(self, logits_of=toy_logits) -> None:
        self.logits_of = logits_of  # context token ids -> (VOCAB,) logits

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[KVCache]:
        return [KVCache(torch.full((num_blocks, 2, block_size, 1, 2), -1.0))]

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 2 * block_size * 2 * 4

    def forward(self, batch, kv_caches: list[KVCache]) -> torch.Tensor:
        cache = kv_caches[0].data  # (N, 2, S, 1, 2): K holds (token, position)
        size = cache.shape[2]
        slots = batch.slot_mapping
        cache[slots // size, 0, slots % size, 0] = torch.stack([batch.input_ids, batch.positions], -1).float()
        starts = batch.query_start_loc.tolist()
        rows = []
        for i in batch.logits_indices.tolist():
            b = bisect.bisect_right(starts, i) - 1
            positions = torch.arange(int(batch.positions[i]) + 1)
            blocks = batch.block_tables[b].long()[positions // size]
            assert (blocks > 0).all(), "the null block is in a block table row"
            entries = cache[blocks, 0, positions % size, 0]
            assert torch.equal(entries[:, 1], positions.float()), "stale or foreign K/V"
            rows.append(self.logits_of(entries[:, 0].long().tolist()))
        return torch.stack(rows)


class ToyTokenizer:
    chat_template = "[0] content [0]"  # what apply_chat_template below does (a base model's tokenizer has none)

    def __call__(self, text: str) -> dict:
        return {"input_ids": [1 + ord(c) % 60 for c in text]}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join("" if t == EOS and skip_special_tokens else chr(97 + t % 26) for t in token_ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> dict:
        assert add_generation_prompt and tokenize
        return {"input_ids": [0, *self(messages[0]["content"])["input_ids"], 0]}  # like a BatchEncoding


PROMPTS = [[(i * 13 + j * 7) % 60 + 1 for j in range(1 + 5 * i)] for i in range(16)]  # 1..76 tokens
GREEDY = SamplingParams(max_tokens=8)




@pytest.fixture
def make_engine():
    engines = []

    def make(**config) -> Engine:
        engine = Engine(ToyModel(), ToyTokenizer(), EngineConfig(**{"block_size": 4, **config}))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert_no_leaks(engine)


@pytest.fixture(scope="module")
def singles() -> list[Completion]:
    engine = Engine(ToyModel(), ToyTokenizer(), EngineConfig(block_size=4, enable_prefix_caching=False))
    out = [engine.generate([p], GREEDY)[0] for p in PROMPTS]
    assert [c.token_ids for c in out] == [reference(p, 8) for p in PROMPTS]
    return out


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"max_num_batched_tokens": 16},
        {"num_blocks": 24},  # 92 tokens: the longest request fits alone, preemption is certain
        {"num_blocks": 24, "max_num_batched_tokens": 16, "max_num_seqs": 5},
    ],
    ids=["plain", "chunked16", "preempt", "preempt-chunked16"],
)
def test_batched_equals_single(make_engine, singles, config):
    engine = make_engine(**config)
    assert engine.generate(PROMPTS, GREEDY) == singles
    stats = engine.stats()
    assert stats.num_generated_tokens == sum(len(c.token_ids) for c in singles)
    if "num_blocks" in config:
        assert stats.num_preemptions > 0
    if "max_num_batched_tokens" in config:
        assert stats.num_steps >= sum(len(p) for p in PROMPTS) // 16


def test_prefix_hit_skips_the_shared_blocks(make_engine):
    engine = make_engine(block_size=16)
    shared = [(j * 5) % 60 + 1 for j in range(64)]  # 4 blocks
    a, b = shared + [3, 4, 5], shared + [9, 8, 7, 6, 5, 4, 3]
    assert engine.generate([a], GREEDY)[0].token_ids == reference(a, 8)
    before = engine.stats()
    out = engine.generate([b], GREEDY)[0]
    after = engine.stats()
    assert after.num_computed_prompt_tokens - before.num_computed_prompt_tokens == 7
    assert after.num_prefix_cache_hit_tokens - before.num_prefix_cache_hit_tokens == 64
    assert after.prefix_cache_hit_rate == pytest.approx(64 / (67 + 71))
    cold = make_engine(block_size=16, enable_prefix_caching=False).generate([b], GREEDY)[0]
    assert out == cold and out.token_ids == reference(b, 8)
    # A block-aligned prompt seen before: its last block is recomputed for the logits.
    assert engine.generate([shared], GREEDY)[0].token_ids == reference(shared, 8)
    before = engine.stats()
    assert engine.generate([shared], GREEDY)[0].token_ids == reference(shared, 8)
    assert engine.stats().num_computed_prompt_tokens - before.num_computed_prompt_tokens == 16


def test_seeded_sampling_is_batch_independent(make_engine):
    seeded = SamplingParams(temperature=1.0, top_k=16, seed=11, max_tokens=12)
    alone = make_engine().generate([PROMPTS[5]], seeded)[0]
    mixed = make_engine(max_num_batched_tokens=16).generate(
        [PROMPTS[3], PROMPTS[5], PROMPTS[9], PROMPTS[5]],
        [GREEDY, seeded, SamplingParams(temperature=0.7, max_tokens=12), SamplingParams(temperature=1.0, seed=12)],
    )
    assert mixed[1] == alone
    assert alone.token_ids != reference(PROMPTS[5], 12)  # it did sample
    assert mixed[3].token_ids != alone.token_ids  # another seed, other tokens
    unseeded = SamplingParams(temperature=1.0, max_tokens=12)
    first, second = (make_engine(seed=5).generate([PROMPTS[2]], unseeded)[0] for _ in range(2))
    assert first == second  # the engine seed makes unseeded requests reproducible


def eos_prompt() -> list[int]:
    """The first single-token prompt whose greedy continuation hits EOS within 12 tokens."""
    return next([t] for t in range(1, VOCAB) if EOS in reference([t], 12))


def test_eos_stops_and_ignore_eos_does_not(make_engine):
    prompt = eos_prompt()
    expected = reference(prompt, 12)
    engine = make_engine()
    out = engine.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert out.token_ids == expected and out.token_ids[-1] == EOS and out.finish_reason == "stop"
    assert out.text == ToyTokenizer().decode(expected[:-1])
    out = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


def test_stop_string_is_cut_from_the_text(make_engine):
    prompt = PROMPTS[4]
    full = ToyTokenizer().decode(reference(prompt, 8))
    stop = full[3:5]
    engine = make_engine()
    out = engine.generate([prompt], SamplingParams(max_tokens=8, stop=(stop, "never")))[0]
    assert out.finish_reason == "stop" and out.text == full[: full.find(stop)]
    assert out.token_ids == reference(prompt, full.find(stop) + len(stop))
    plain = engine.generate([prompt], GREEDY)[0]
    assert (plain.text, plain.finish_reason) == (full, "length")


def test_stream_yields_deltas_that_add_up_to_the_text(make_engine):
    engine = make_engine()
    prompt = PROMPTS[4]
    full = ToyTokenizer().decode(reference(prompt, 8))
    deltas = list(engine.stream(prompt, GREEDY))
    assert len(deltas) == 8 and "".join(deltas) == full
    stop = SamplingParams(max_tokens=8, stop=full[4:7])
    deltas = list(engine.stream(prompt, stop))
    assert "".join(deltas) == engine.generate([prompt], stop)[0].text == full[: full.find(full[4:7])]
    stream = engine.stream(prompt, SamplingParams(max_tokens=50))
    next(stream)
    stream.close()  # aborts the request; the fixture checks its blocks came back


def test_abort_running_and_waiting_requests(make_engine):
    engine = make_engine(max_num_seqs=2)
    a, b, c = (engine.add_request(p, SamplingParams(max_tokens=20)) for p in PROMPTS[6:9])
    engine.step()
    engine.step()
    assert engine.stats().num_running == 2 and engine.stats().num_kv_blocks_used > 0
    assert engine.abort(b.request_id) and engine.abort(c.request_id)
    assert not engine.abort(b.request_id) and not engine.abort("unknown")
    while engine.has_unfinished():
        engine.step()
    assert (a.finish_reason, b.finish_reason, c.finish_reason) == ("length", "abort", "abort")
    assert a.output_token_ids == reference(PROMPTS[6], 20)


def test_invalid_requests_are_rejected_and_the_engine_keeps_serving(make_engine):
    engine = make_engine(max_seq_len=32, num_blocks=7)  # 24 tokens in the pool
    with pytest.raises(ValueError, match="the prompt has 33 tokens but the context holds 32"):
        engine.generate([[1] * 33], GREEDY)
    with pytest.raises(ValueError, match="the prompt has 25 tokens but the KV pool holds at most 24"):
        engine.generate([[1] * 4, [1] * 25], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, VOCAB]], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        engine.generate([[1], [2]], [GREEDY])
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate([[1]], {"temperature": 1.0})
    with pytest.raises(ValueError, match="chat=True needs text"):
        engine.generate([[1]], GREEDY, chat=True)
    assert not engine.has_unfinished()
    out = engine.generate([PROMPTS[2], [5] * 20], SamplingParams(max_tokens=8))
    assert out[0].token_ids == reference(PROMPTS[2], 8)
    # 20 prompt tokens in a 24-token pool: it stops at the pool's size.
    assert out[1].token_ids == reference([5] * 20, 4) and out[1].finish_reason == "length"


@pytest.mark.parametrize("num_prompt_tokens, max_tokens, outcome", [
    (30, 2, 2), (30, None, 2), (1, None, 31),  # None: up to the context (32)
    (30, 3, r"prompt has 30 tokens and max_tokens is 3: 33 tokens, more than the context holds 32 \(.*lower "
            "max_tokens to 2 or fewer"),
    (30, 10**12, "max_tokens is 1000000000000: 1000000000030 tokens"),
    (32, 1, "33 tokens, more than the context holds"),
    (32, None, "the prompt has 32 tokens, the whole context 32 .*: no room for an output token"),
])
def test_prompt_and_max_tokens_must_fit_in_the_context(make_engine, num_prompt_tokens, max_tokens, outcome):
    engine = make_engine(max_seq_len=32)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if isinstance(outcome, str):
        with pytest.raises(InputError, match=outcome) as error:
            engine.generate([[1] * num_prompt_tokens], params)
        # the field to change: the prompt when it fills the context, else max_tokens
        assert error.value.field == ("prompt" if num_prompt_tokens == 32 else "max_tokens")
        assert not engine.has_unfinished()
    else:
        (out,) = engine.generate([[1] * num_prompt_tokens], params)
        assert len(out.token_ids) == outcome and out.finish_reason == "length"


def test_text_and_chat_prompts_use_the_tokenizer(make_engine):
    engine = make_engine()
    tokenizer = ToyTokenizer()
    out = engine.generate(["hello"], GREEDY)[0]
    assert out.prompt_token_ids == tokenizer("hello")["input_ids"]
    assert out.text == tokenizer.decode(out.token_ids) and out.token_ids == reference(out.prompt_token_ids, 8)
    chat = engine.generate(["hello"], GREEDY, chat=True)[0]
    assert chat.prompt_token_ids == [0, *tokenizer("hello")["input_ids"], 0]


def test_config_from_manifest_and_kv_pool_sizing(tiny_artifact):
    from dataclasses import replace

    from optc.core.artifact import read_manifest
    from optc.core.settings import RuntimeSettings

    manifest = replace(read_manifest(tiny_artifact),
                       runtime=RuntimeSettings(max_num_seqs=8, max_seq_len=128, gpu_memory_utilization=0.5))
    config = EngineConfig.from_manifest(manifest, max_num_seqs=2)
    assert (config.block_size, config.max_num_seqs, config.max_seq_len) == (16, 2, 128)
    assert (config.gpu_memory_utilization, config.max_num_batched_tokens) == (0.5, 2048)
    with pytest.raises(TypeError, match="unknown engine option"):
        EngineConfig.from_manifest(manifest, max_batch=3)
    bytes_per_block = ToyModel().kv_bytes_per_block(4)
    sized = Engine(ToyModel(), None, EngineConfig(block_size=4, kv_cache_memory=10 * bytes_per_block + 5))
    assert sized.kv_manager.num_blocks == 11
    default = Engine(ToyModel(), None, EngineConfig(block_size=4, max_num_seqs=2, max_seq_len=30))
    assert default.kv_manager.num_blocks == 2 * 8 + 1
    assert default.runner.kv_caches[0].data.shape == (17, 2, 4, 1, 2)


# -- the real random:tiny artifact ---------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
TINY_PROMPTS = [[(i * 13 + j * 7) % 250 + 1 for j in range(1 + 5 * i)] for i in range(16)]  # 1..76 tokens


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory) -> Path:
    build = pytest.importorskip("optc.frontend.build")
    out = tmp_path_factory.mktemp("artifact") / "tiny"
    return build.build(build.BuildOptions(recipe=REPO / "recipes" / "tiny.yaml", out=out, quiet=True))


@pytest.fixture(scope="module", params=["float32", "int8"], ids=["float-kv", "int8-kv"])
def tiny_kv_artifact(request, tiny_artifact) -> Path:
    """random:tiny with a float KV cache, and with an int8 one (scales per token and KV head)."""
    return tiny_artifact if request.param == "float32" else request.getfixturevalue("tiny_int8_kv_artifact")


@pytest.fixture(scope="module")
def tiny_singles(tiny_kv_artifact) -> list[Completion]:
    engine = Engine.load(tiny_kv_artifact, enable_prefix_caching=False)
    out = [engine.generate([p], GREEDY)[0] for p in TINY_PROMPTS]
    assert_no_leaks(engine)
    return out


@pytest.mark.parametrize(
    "config",
    [{}, {"max_num_batched_tokens": 16}, {"num_blocks": 8, "max_num_batched_tokens": 16, "max_num_seqs": 5}],
    ids=["plain", "chunked16", "preempt-chunked16"],
)
def test_tiny_batched_equals_single(tiny_kv_artifact, tiny_singles, config):
    engine = Engine.load(tiny_kv_artifact, **config)
    cache = engine.runner.kv_caches[0]  # the manifest's KV format: float, or int8 with its scales
    assert cache.data.dtype == read(tiny_kv_artifact, verify=False).manifest.kv_layout.torch_dtype
    assert (cache.scales is None) == (cache.data.dtype == torch.float32)
    assert engine.generate(TINY_PROMPTS, GREEDY) == tiny_singles
    assert all(len(c.token_ids) == 8 for c in tiny_singles)  # random:tiny has no EOS
    if "num_blocks" in config:
        assert engine.stats().num_preemptions > 0
    assert_no_leaks(engine)


def test_tiny_prefix_hit_skips_work_with_identical_output(tiny_kv_artifact):
    engine = Engine.load(tiny_kv_artifact)
    assert engine.config.block_size == 16
    shared = [(j * 5) % 250 + 1 for j in range(64)]  # 4 blocks
    engine.generate([shared + [3, 4, 5]], GREEDY)
    before = engine.stats()
    out = engine.generate([shared + [9, 8, 7, 6, 5, 4, 3]], GREEDY)[0]
    after = engine.stats()
    assert after.num_computed_prompt_tokens - before.num_computed_prompt_tokens == 7
    cold = Engine.load(tiny_kv_artifact, enable_prefix_caching=False)
    assert out == cold.generate([shared + [9, 8, 7, 6, 5, 4, 3]], GREEDY)[0]
    assert_no_leaks(engine)


def test_tiny_text_prompts_follow_the_hf_tokenizer(tiny_artifact):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_artifact / "tokenizer")
    engine = Engine.load(tiny_artifact, max_seq_len=64)
    out = engine.generate(["hello world"], GREEDY)[0]
    assert out.prompt_token_ids == tokenizer("hello world")["input_ids"]
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    chat = engine.generate(["hello world"], GREEDY, chat=True)[0]
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello world"}], add_generation_prompt=True, tokenize=True
    )
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert chat.prompt_token_ids == list(expected) and len(expected) > len(out.prompt_token_ids)
    assert "".join(engine.stream("hello", GREEDY)) == engine.generate(["hello"], GREEDY)[0].text
    with pytest.raises(ValueError, match="the prompt has 65 tokens but the context holds 64"):
        engine.generate(["x" * 65], GREEDY)
    assert_no_leaks(engine)


def test_bench_reports_throughput_latency_and_the_hf_ratio(tiny_artifact, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from optc.commands.bench import BenchOptions, format_bench, run_bench

    options = BenchOptions(tiny_artifact, num_requests=5, input_len=20, output_len=4, max_num_seqs=2,
                           show_progress=False)
    result = run_bench(options)
    assert (result.num_prompt_tokens, result.num_output_tokens) == (100, 20)
    assert result.max_num_seqs == 2 and result.kv_cache["peak_blocks_used"] >= 2
    for key in ("output_tokens_per_s", "total_tokens_per_s", "peak_memory_bytes"):
        assert getattr(result, key) > 0
    assert set(result.ttft_ms) == set(result.tpot_ms) == {"p50", "p90", "p99", "mean"}
    assert result.ttft_ms["p50"] <= result.ttft_ms["p99"]
    assert "tok/s" in format_bench(result) and result.hf is None

    dataset = tmp_path / "prompts.txt"
    dataset.write_text("hello there\n\nsecond prompt\n")
    result = run_bench(BenchOptions(tiny_artifact, num_requests=3, output_len=2, dataset=dataset, show_progress=False))
    assert result.num_prompt_tokens == 11 + 13 + 11

    # one prompt three times, one request at a time: the 2nd and 3rd hit the 1st's full blocks; the
    # warm-up (prompts of one repeated token, at the workload's length) counts in neither the hit rate
    # nor the steps
    dataset.write_text("the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat, again\n")
    result = run_bench(BenchOptions(tiny_artifact, num_requests=3, output_len=2, dataset=dataset, max_num_seqs=1,
                                    show_progress=False))
    length, block = result.num_prompt_tokens // 3, result.kv_cache["block_size"]
    assert length % block and length > 2 * block
    assert result.kv_cache["prefix_cache_hit_rate"] == pytest.approx(2 * (length // block) * block / (3 * length))
    assert result.num_steps == 3 * 2  # per request: the prefill (and first token), then one decode

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    result = run_bench(BenchOptions(tiny_artifact, num_requests=3, input_len=6, output_len=3, max_num_seqs=2,
                                    hf_model_dir=tmp_path / "hf", show_progress=False))
    assert result.hf["num_output_tokens"] == 9
    assert result.hf["optc_over_hf"] == pytest.approx(
        result.output_tokens_per_s / result.hf["output_tokens_per_s"]
    )
