"""CUDA-graph runner: bucket choice, the static buffers and their padding rows, which steps replay,
capture refusal, and replay == eager.

Without a GPU the capture itself cannot run, so `EagerReplays` stands in for it: each "graph" runs
`Model.forward` on the static padded batch, exactly what a capture records. On a `target: cuda`
artifact (Triton kernels under TRITON_INTERPRET=1 here) that covers the captured path minus the
CUDA graph: padding rows, static buffers reused across steps, and the decode kernel's split count
fixed for the whole context. The `gpu` test captures for real.
"""

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from optc.core.artifact import read
from optc.core.kv_cache import KVCache
from optc.runtime import Engine, SamplingParams
from optc.runtime.batch import ForwardBatch
from optc.runtime.cuda_graphs import (
    CudaGraphRunner,
    GraphConfig,
    StaticBatch,
    bucket_for,
    capture_blockers,
    is_pure_decode,
    make_runner,
    plan_batch_sizes,
)
from optc.runtime.loader import load_model
from optc.testing import assert_close, build_artifact

PROMPTS = [[(i * 13 + j * 7) % 250 + 1 for j in range(3 + 11 * i)] for i in range(5)]  # 3..47 tokens
PASSES = "fuse_qkv, fuse_gate_up, kv_layout, fuse_add_rmsnorm, fuse_rope_kv, select_kernels"


# cuda-targeted artifacts on CPU tensors run only under the Triton interpreter, which conftest turns on where no GPU
# is present; on a GPU machine the gpu-marked tests below run the same paths on the device
INTERPRETED = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through cuda kernels: the Triton "
                                 "interpreter is off where a GPU is present (the gpu tests cover the device)")


def load(path):
    """The artifact's Model on the CPU (cuda-targeted ones run there under the Triton interpreter)."""
    return load_model(read(path, device="cpu"))


class EagerReplays(CudaGraphRunner):
    """The runner with each capture replaced by an eager run of the same static batch (CPU tests)."""

    def _capture(self, device):
        self.replays = {b: 0 for b in self.config.batch_sizes}
        for bucket in self.config.batch_sizes:
            out = torch.empty(bucket, self.model.vocab_size)
            self._graphs[bucket] = (SimpleNamespace(replay=self._replayer(bucket, out)), out)

    def _replayer(self, bucket, out):
        def replay():
            self.replays[bucket] += 1
            out.copy_(self.model.forward(self.static.view(bucket), self.kv_caches))
        return replay


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("graphs")
    built = {}
    for target in ("cpu", "cuda"):
        recipe = tmp / f"{target}.yaml"
        recipe.write_text(f"model: random:tiny\ndtype: float32\ntarget: {target}\npasses: [{PASSES}, "
                          "{cuda_graphs: {batch_sizes: [1, 2, 4, 8]}}]\n"
                          "runtime: {max_num_seqs: 8, max_seq_len: 128}\n")
        built[target] = build_artifact(tmp / target, recipe)
    return built


def _decode_batch(lengths: list[int], block_size: int = 4) -> ForwardBatch:
    """Requests with lengths[b] tokens in context, each decoding one token; request b owns blocks
    10(b + 1) + 1, 10(b + 1) + 2, ..."""
    blocks = [[10 * (b + 1) + 1 + i for i in range(-(-(n + 1) // block_size))] for b, n in enumerate(lengths)]
    return ForwardBatch.build([[7 + b] for b in range(len(lengths))], lengths, blocks, block_size)


def test_bucket_choice_and_plan():
    sizes = (1, 2, 4, 8)
    assert [bucket_for(sizes, n) for n in (0, 1, 2, 3, 5, 8, 9)] == [None, 1, 2, 4, 8, 8, None]
    assert plan_batch_sizes(None, 16) == (1, 2, 4, 8, 16)
    assert plan_batch_sizes((64, 3, 3, 1), 32) == (1, 3)
    assert plan_batch_sizes((64,), 32) == ()
    config = GraphConfig((8, 2, 2), max_seq_len=100, block_size=16)
    assert (config.batch_sizes, config.max_blocks_per_request, config.max_capture_size) == ((2, 8), 7, 8)
    with pytest.raises(ValueError, match="batch_sizes must be non-empty"):
        GraphConfig((0, 2), 100, 16)


def test_only_pure_decode_batches_qualify():
    assert is_pure_decode(_decode_batch([5, 9]))
    prefill = ForwardBatch.build([[1, 2, 3], [4]], [0, 6], [[1], [2, 3]], 4)
    assert not is_pure_decode(prefill)  # a 3-token query
    verify = ForwardBatch.build([[1], [2]], [4, 4], [[1, 2], [3, 4]], 4, logits_per_request=[1, 1])
    assert is_pure_decode(verify)
    speculative = ForwardBatch.build([[1, 2], [3, 4]], [4, 4], [[1, 2], [3, 4]], 4, logits_per_request=[2, 2])
    assert not is_pure_decode(speculative)
    assert not is_pure_decode(ForwardBatch.build([], [], [], 4))


def test_static_batch_fills_rows_and_resets_padding():
    static = StaticBatch(GraphConfig((1, 2, 4), max_seq_len=16, block_size=4))  # 4 rows x 4 blocks
    static.fill(_decode_batch([5, 9, 2]), 4)
    assert static.input_ids.tolist() == [7, 8, 9, 0]
    assert static.positions.tolist() == [5, 9, 2, 0]
    assert static.seq_lens.tolist() == [6, 10, 3, 1]
    assert static.slot_mapping.tolist() == [4 * 12 + 1, 4 * 23 + 1, 4 * 31 + 2, -1]
    assert static.block_tables.tolist() == [[11, 12, 0, 0], [21, 22, 23, 0], [31, 0, 0, 0], [0, 0, 0, 0]]
    view = static.view(4)
    assert view.query_start_loc.tolist() == [0, 1, 2, 3, 4] and view.logits_indices.tolist() == [0, 1, 2, 3]
    assert (view.max_query_len, view.max_seq_len) == (1, 16) and static.view(4) is view

    static.fill(_decode_batch([1]), 2)  # row 1 back to padding; rows 2.. are outside bucket 2
    assert static.view(2).input_ids.tolist() == [7, 0]
    assert static.seq_lens.tolist() == [2, 1, 3, 1] and static.slot_mapping.tolist()[:2] == [4 * 11 + 1, -1]
    assert static.block_tables[:2].tolist() == [[11, 0, 0, 0], [0, 0, 0, 0]]
    static.fill(_decode_batch([3, 3]), 4)  # the stale row 2 is reset now
    assert static.seq_lens.tolist() == [4, 4, 1, 1] and static.slot_mapping.tolist()[2:] == [-1, -1]
    assert static.positions.tolist() == [3, 3, 0, 0] and static.block_tables[2:].tolist() == [[0] * 4] * 2
    with pytest.raises(ValueError, match="does not fit bucket 2"):
        static.fill(_decode_batch([1, 1, 1]), 2)


class OpLog(TorchDispatchMode):
    """The aten ops that touch data run inside it (not views; numpy writes to a host buffer are not ops)."""

    VIEWS = frozenset({"slice", "view", "select", "alias", "as_strided", "_unsafe_view", "detach"})

    def __enter__(self):
        self.ops = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.VIEWS:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_replayed_step_is_written_with_one_host_to_device_copy():
    # the graph path: the step's rows and the bucket's padding go host -> device in one copy, with no
    # device-side copies or fills, and hold what filling from an eager-built batch gives
    config = GraphConfig((1, 2, 4), max_seq_len=16, block_size=4)
    model = SimpleNamespace(graph=SimpleNamespace(nodes=[]), device="cpu", vocab_size=3,
                            forward=lambda batch, caches: torch.zeros(batch.num_requests, 3))
    runner = EagerReplays(model, [], config)
    expected = StaticBatch(config)
    for step, lengths in enumerate(([5, 9, 2], [1], [3, 3])):  # smaller after larger, then a stale row
        decode = _decode_batch(lengths)
        expected.fill(decode, bucket_for(config.batch_sizes, len(lengths)))
        blocks = [row[row > 0].tolist() for row in decode.block_tables]
        with OpLog() as log:
            batch = runner.build([[7 + b] for b in range(len(lengths))], lengths, blocks, 4)
        assert log.ops == ["copy_"]
        bucket = bucket_for(config.batch_sizes, len(lengths))
        for name in ("input_ids", "positions", "seq_lens", "slot_mapping", "block_tables"):
            assert torch.equal(getattr(runner.static.view(bucket), name), getattr(expected.view(bucket), name)), name
        assert batch.num_requests == len(lengths) and runner.static.holds(batch)
        runner.forward(batch, runner.kv_caches)
        assert runner.replays[bucket] == 1 and sum(runner.replays.values()) == step + 1  # replayed as built
    # steps that do not replay are built for eager: prefill, and more requests than the largest bucket
    assert not runner.static.holds(runner.build([[1, 2]], [0], [[1]], 4))
    assert not runner.static.holds(runner.build([[1]] * 5, [0] * 5, [[1]] * 5, 4))


def test_an_eager_step_is_built_with_one_host_to_device_copy():
    from optc.runtime.batch import BatchBuilder

    builder = BatchBuilder("cpu")  # the CUDA path on the CPU: one buffer, one copy
    args = ([[1, 2, 3], [4]], [0, 6], [[1], [2, 3]], 4)
    with OpLog() as log:
        batch = builder.build(*args)
    assert log.ops in (["_to_copy"], ["empty", "copy_"], ["empty_strided", "copy_"]), log.ops
    assert batch.input_ids.tolist() == [1, 2, 3, 4] and batch.positions.tolist() == [0, 1, 2, 6]
    assert batch.slot_mapping.tolist() == [4, 5, 6, 3 * 4 + 2] and batch.seq_lens.tolist() == [3, 7]
    assert batch.query_start_loc.tolist() == [0, 3, 4] and batch.logits_indices.tolist() == [2, 3]
    assert batch.block_tables.tolist() == [[1, 0], [2, 3]] and (batch.max_query_len, batch.max_seq_len) == (3, 7)
    again = builder.build([[9]], [2], [[5]], 4)  # the host buffer is reused: the first batch is intact
    assert batch.input_ids.tolist() == [1, 2, 3, 4] and again.input_ids.tolist() == [9]


@INTERPRETED
def test_capture_refuses_syncing_references_and_eager_paths(artifacts):
    cpu_model, cuda_model = load(artifacts["cpu"]), load(artifacts["cuda"])
    assert capture_blockers(cpu_model.graph) == [
        f"model.layers.{i}.self_attn.{op} ({op})" for i in (0, 1) for op in ("rope_kv_store", "attention")]
    assert capture_blockers(cuda_model.graph) == []
    config = GraphConfig((1, 2), 128, 16)
    blocked = r"4 node\(s\) run on torch references .*layers.0.self_attn.rope_kv_store.*select_kernels"
    with pytest.raises(ValueError, match=blocked):
        CudaGraphRunner(cpu_model, [], config)
    with pytest.raises(ValueError, match="CUDA graphs need a cuda device; the model is on cpu"):
        CudaGraphRunner(cuda_model, [], config)
    args = dict(batch_sizes=None, max_num_seqs=8, max_seq_len=128, block_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_runner(cuda_model, [], enforce_eager=False, **args) is None  # the CPU: eager, silently
    on_cuda = SimpleNamespace(device="cuda", graph=cpu_model.graph)
    assert make_runner(on_cuda, [], enforce_eager=True, **args) is None
    with pytest.warns(UserWarning, match="CUDA graphs off: 4 KV node"):
        assert make_runner(on_cuda, [], enforce_eager=False, **args) is None


@pytest.mark.parametrize("target", ["cpu", pytest.param("cuda", marks=INTERPRETED)])
def test_padded_static_batch_equals_eager_and_writes_no_padding(artifacts, target):
    model = load(artifacts[target])
    size, lengths = 16, [3, 20, 40]
    blocks = [[1 + 4 * b + i for i in range(-(-(n + 1) // size))] for b, n in enumerate(lengths)]
    caches = model.allocate_kv_caches(16, size)
    prompts = [[(5 * b + j) % 200 + 1 for j in range(n)] for b, n in enumerate(lengths)]
    model.forward(ForwardBatch.build(prompts, [0] * 3, blocks, size), caches)  # prefill
    for cache in caches:  # a recognizable null block: padding rows read it, nothing may write it
        cache.data[0] = 0.5
    decode = ForwardBatch.build([[11], [12], [13]], lengths, blocks, size)
    eager_caches = [KVCache(c.data.clone()) for c in caches]
    eager = model.forward(decode, eager_caches)
    static = StaticBatch(GraphConfig((1, 2, 4, 8), model.max_position_embeddings, size))
    static.fill(decode, 8)
    padded = model.forward(static.view(8), caches)
    assert padded.shape == (8, model.vocab_size)
    assert_close(padded[:3], eager, rtol=1e-5, what="padded logits")
    assert torch.equal(padded[:3].argmax(-1), eager.argmax(-1))
    for cache, eager_cache in zip((c.data for c in caches), (c.data for c in eager_caches), strict=True):
        assert torch.equal(cache[0], torch.full_like(cache[0], 0.5))  # padding rows stored nothing
        assert torch.equal(cache[13:], eager_cache[13:])  # unused blocks untouched
        assert_close(cache, eager_cache, rtol=1e-5, what="kv cache")


@INTERPRETED
def test_engine_with_replays_matches_eager_greedy_tokens(artifacts):
    target = "cuda"  # the runner refuses the cpu build (torch references)
    greedy = SamplingParams(max_tokens=7)
    eager = Engine.load(artifacts[target], max_num_batched_tokens=32)
    assert eager.runner.graph_runner is None  # CPU: no runner
    graphed = Engine.load(artifacts[target], max_num_batched_tokens=32)
    config = GraphConfig(plan_batch_sizes(graphed.config.cuda_graph_batch_sizes, 8), graphed.max_model_len, 16)
    assert config.batch_sizes == (1, 2, 4, 8) and config.max_seq_len == 128
    graphed.runner.graph_runner = runner = EagerReplays(graphed.model, graphed.runner.kv_caches, config)
    expected = [c.token_ids for c in eager.generate(PROMPTS, greedy)]
    assert [c.token_ids for c in graphed.generate(PROMPTS, greedy)] == expected
    # 5 requests decode in bucket 8 until they finish; staggered prefill gives smaller decode batches
    assert runner.replays[8] > 0 and sum(runner.replays.values()) >= 6
    # one request: bucket 1, and a batch after a larger one (stale rows) still matches
    assert [c.token_ids for c in graphed.generate(PROMPTS[:1], greedy)] == expected[:1]
    assert runner.replays[1] >= 6


def test_replays_of_a_sliding_window_model_read_a_static_table_per_kv_group(tmp_path):
    # random:gemma3-tiny: KV-cache groups full (layer 2) and sliding (layers 0, 1; window 12), whose
    # released blocks are null entries of its static table; its torch references sync with the host, so
    # the runner gets a stand-in that hides the graph from the capture check and runs the real forward
    artifact = build_artifact(tmp_path / "a", None, "dtype=float32", "passes=[]", model="random:gemma3-tiny")
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [p[:30] for p in PROMPTS]
    expected = [c.token_ids for c in Engine.load(artifact, block_size=4).generate(prompts, greedy)]
    graphed = Engine.load(artifact, block_size=4)
    model = graphed.model
    stand_in = SimpleNamespace(graph=SimpleNamespace(nodes=[]), device=model.device, vocab_size=model.vocab_size,
                               kv_windows=model.kv_windows, forward=model.forward)
    config = GraphConfig((1, 2, 4, 8), graphed.max_model_len, 4)
    graphed.runner.graph_runner = runner = EagerReplays(stand_in, graphed.runner.kv_caches, config)
    assert runner.static.num_groups == 3
    assert runner.static.view(8).group_tables[2][0].shape == (8, config.max_blocks_per_request)
    with OpLog() as log:  # groups too: one host -> device copy
        batch = runner.build([[1], [2]], [13, 2], [[1, 2, 3, 4, 0, 0, 0, 6, 7, 8, 9, 10], [11, 12, 13]], 4)
    assert log.ops == ["copy_"] and batch.block_tables[:, :4].tolist() == [[1, 2, 3, 4], [11, 0, 0, 0]]
    assert [t[:, :4].tolist() for t, _ in batch.group_tables[1:]] == [[[0, 0, 0, 6], [12, 0, 0, 0]],
                                                                     [[7, 8, 9, 10], [13, 0, 0, 0]]]
    assert [s.tolist() for _, s in batch.group_tables] == [[4 * 4 + 1, 11 * 4 + 2], [6 * 4 + 1, 12 * 4 + 2],
                                                           [10 * 4 + 1, 13 * 4 + 2]]
    assert [c.token_ids for c in graphed.generate(prompts, greedy)] == expected
    assert sum(runner.replays.values()) >= 19


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager_on_gpu(artifacts):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    greedy = SamplingParams(max_tokens=12)
    eager = Engine.load(artifacts["cuda"], device="cuda", enforce_eager=True, num_blocks=256)
    graphed = Engine.load(artifacts["cuda"], device="cuda", num_blocks=256)  # two engines share the GPU
    runner = graphed.runner.graph_runner
    assert eager.runner.graph_runner is None and runner is not None and runner.config.batch_sizes == (1, 2, 4, 8)
    expected = [c.token_ids for c in eager.generate(PROMPTS, greedy)]
    assert [c.token_ids for c in graphed.generate(PROMPTS, greedy)] == expected
    # logits of one decode step: replay vs eager on identical caches
    size, lengths = 16, [3, 20, 40]
    blocks = [[1 + 4 * b + i for i in range(-(-(n + 1) // size))] for b, n in enumerate(lengths)]
    prompts = [[(5 * b + j) % 200 + 1 for j in range(n)] for b, n in enumerate(lengths)]
    graphed.model.forward(ForwardBatch.build(prompts, [0] * 3, blocks, size).to("cuda"), graphed.runner.kv_caches)
    decode = ForwardBatch.build([[11], [12], [13]], lengths, blocks, size).to("cuda")
    assert runner.bucket(decode) == 4
    eager_logits = graphed.model.forward(decode, [KVCache(c.data.clone()) for c in graphed.runner.kv_caches])
    replayed = runner.forward(decode, graphed.runner.kv_caches).clone()
    assert_close(replayed, eager_logits, rtol=1e-4, what="replayed logits")
    assert torch.equal(replayed.argmax(-1), eager_logits.argmax(-1))


# --- `optc bench --compare-hf`: the transformers peer comes from the artifact's source -----------

def test_compare_hf_rebuilds_a_random_source_from_the_artifact(artifacts, tmp_path):
    from optc.commands.bench import BenchOptions, run_bench
    from optc.frontend.models import hf_model_from_artifact

    hf = hf_model_from_artifact(artifacts["cpu"], torch.device("cpu"), torch.float32)
    engine = Engine.load(artifacts["cpu"])
    ids = [(3 * j) % 250 + 1 for j in range(9)]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0, -1]
    logits = engine.model.forward(ForwardBatch.build([ids], [0], [[1]], 16), engine.runner.kv_caches)[0]
    assert_close(logits, expected, rtol=1e-5, what="optc vs rebuilt transformers logits")
    result = run_bench(BenchOptions(artifacts["cpu"], num_requests=3, input_len=6, output_len=3, max_num_seqs=2,
                                    compare_hf=True, show_progress=False))
    assert result.hf["model"] == "dense, rebuilt from random:tiny" and result.hf["num_output_tokens"] == 9
    assert result.cuda_graphs is None  # the CPU runs eager

    recipe = tmp_path / "int4.yaml"
    recipe.write_text("model: random:tiny\ndtype: float32\npasses: [{quantize_rtn: {bits: 4, group_size: 32}}]\n")
    with pytest.raises(ValueError, match="holds int4_g weights and its source has no transformers checkpoint"):
        hf_model_from_artifact(build_artifact(tmp_path / "int4", recipe), torch.device("cpu"), torch.float32)


def test_compare_hf_loads_an_hf_folder_source(artifacts, tmp_path):
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from optc.commands.bench import BenchOptions, run_bench

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    shutil.copytree(artifacts["cpu"] / "tokenizer", tmp_path / "hf", dirs_exist_ok=True)  # a byte tokenizer
    artifact = build_artifact(tmp_path / "a", None, "dtype=float32", model=str(tmp_path / "hf"))
    result = run_bench(BenchOptions(artifact, num_requests=2, input_len=5, output_len=2, compare_hf=True,
                                    show_progress=False))
    assert result.hf["model"] == str((tmp_path / "hf").resolve()) and result.hf["num_output_tokens"] == 4


def test_static_batch_holds_each_rows_lora_slot():
    static = StaticBatch(GraphConfig((1, 2, 4), max_seq_len=16, block_size=4), with_lora=True)
    assert static.lora_slots.tolist() == [-1] * 4 and static.view(4).lora_slots.tolist() == [-1] * 4
    batch = static.write([[7], [8], [9]], [5, 9, 2], [[11, 12], [21, 22, 23], [31]], 4, 4, lora_slots=[1, -1, 0])
    assert batch.lora_slots.tolist() == [1, -1, 0] and static.lora_slots.tolist() == [1, -1, 0, -1]
    static.write([[7]], [5], [[11, 12]], 4, 2)  # a step without adapters: every row -1 again
    assert static.view(2).lora_slots.tolist() == [-1, -1]
    decode = _decode_batch([5, 9])
    decode.lora_slots = torch.tensor([2, 1])
    static.fill(decode, 4)
    assert static.lora_slots.tolist() == [2, 1, -1, -1]
    static.fill(_decode_batch([1]), 4)  # stale rows back to padding, a batch without slots to -1
    assert static.lora_slots.tolist() == [-1, -1, -1, -1]
    plain = StaticBatch(GraphConfig((1, 2), max_seq_len=16, block_size=4))
    assert plain.lora_slots is None and plain.view(2).lora_slots is None
    with pytest.raises(ValueError, match="with_lora=False"):
        plain.write([[7]], [5], [[11, 12]], 4, 1, lora_slots=[0])


def test_adapter_steps_replay_from_the_static_slots(tiny_artifact, tmp_path):
    # the captured path of a model with LoRA slots (EagerReplays on the CPU's C++ kernel; the gpu test below
    # captures the Triton kernel for real): mixed adapter rows replay, padding rows add nothing, and an adapter
    # loaded after the capture writes into the tables the graphs hold
    from optc.testing import random_peft_adapter

    a = random_peft_adapter(tmp_path / "a", 4, 8, ["q_proj", "v_proj", "down_proj"], seed=1)
    b = random_peft_adapter(tmp_path / "b", 8, 16, ["o_proj", "gate_proj"], seed=2)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts, loras = [PROMPTS[1], PROMPTS[2], PROMPTS[0]], ["a", None, "b"]
    eager = Engine.load(tiny_artifact, max_loras=2, max_lora_rank=8)
    eager.load_lora("a", a)
    eager.load_lora("b", b)
    expected = [c.token_ids for c in eager.generate(prompts, greedy, loras=loras)]
    assert expected != [c.token_ids for c in eager.generate(prompts, greedy)]  # the adapters change the tokens

    graphed = Engine.load(tiny_artifact, max_loras=2, max_lora_rank=8)
    graphed.load_lora("a", a)
    model = graphed.model
    stand_in = SimpleNamespace(graph=SimpleNamespace(nodes=[]), device=model.device, vocab_size=model.vocab_size,
                               kv_windows=model.kv_windows, forward=model.forward, lora=model.lora)
    config = GraphConfig((1, 2, 4), graphed.max_model_len, graphed.config.block_size)
    graphed.runner.graph_runner = runner = EagerReplays(stand_in, graphed.runner.kv_caches, config)
    assert runner.with_lora and runner.static.view(4).lora_slots.tolist() == [-1] * 4
    graphed.load_lora("b", b)  # after the "capture"
    assert [c.token_ids for c in graphed.generate(prompts, greedy, loras=loras)] == expected
    assert runner.replays[4] >= 6  # the three requests decoded in bucket 4, adapters and all


@pytest.mark.gpu
def test_captured_adapter_steps_equal_eager_on_gpu(artifacts, tmp_path):
    # the Triton LoRA kernels captured for real: mixed adapter rows replay as eager decodes them, with an adapter
    # loaded after the capture
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("peft")
    from optc.testing import random_peft_adapter

    a = random_peft_adapter(tmp_path / "a", 4, 8, ["q_proj", "v_proj", "down_proj"], seed=1)
    b = random_peft_adapter(tmp_path / "b", 8, 16, ["o_proj", "gate_proj"], seed=2)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts, loras = PROMPTS[:4], ["a", None, "b", "a"]
    engines = {}
    for name, eager in (("eager", True), ("graphed", False)):
        engines[name] = engine = Engine.load(artifacts["cuda"], device="cuda", enforce_eager=eager, num_blocks=256,
                                             max_loras=2, max_lora_rank=8)
        engine.load_lora("a", a)
        engine.load_lora("b", b)  # after the capture where graphed
    assert engines["graphed"].runner.graph_runner.with_lora
    expected = [c.token_ids for c in engines["eager"].generate(prompts, greedy, loras=loras)]
    assert expected != [c.token_ids for c in engines["eager"].generate(prompts, greedy)]
    assert [c.token_ids for c in engines["graphed"].generate(prompts, greedy, loras=loras)] == expected
