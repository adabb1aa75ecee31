"""LoRA adapters (optc/core/lora.py, optc/core/ops/lora.py, runtime/lora.py) on random:tiny in float32: bad adapters
refused by name, the grouped deltas and lora.cpp's kernel against the op reference, concurrent mixed requests for
the base and three adapters of different ranks and targets equal to transformers + peft token for token (on a fused
qkv / gate_up artifact), prefix blocks keyed by adapter, adapter steps kept in the fused CPU step with the
node-by-node logits bit for bit, unloading after the requests in flight."""

import json
import shutil

import pytest
import torch

from optc.core.artifact import read
from optc.core.lora import AdapterError, load_adapter
from optc.core.ops.lora import lora_delta_grouped, lora_delta_ref, slot_groups
from optc.runtime import Engine, SamplingParams
from optc.runtime.lora import UnknownAdapterError
from optc.testing import assert_no_leaks, build_artifact, cpu_extension, hf_greedy, random_peft_adapter, tiny_hf_model

peft = pytest.importorskip("peft")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> (rank, alpha, rslora, targets): different ranks and targets
    "all4": (4, 8, False, ATTENTION + MLP),
    "qv8": (8, 16, True, ["q_proj", "v_proj"]),
    "mlp16": (16, 8, False, ["gate_proj", "down_proj", "o_proj"]),
}
PROMPTS = [[5, 9, 13, 200, 3], [7] * 21, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [250, 3]]
MAX_TOKENS = 12


def make_adapter(folder, name: str, seed: int = 0):
    """A random peft adapter of ADAPTERS[name] on random:tiny's transformers model, saved to folder/name."""
    rank, alpha, rslora, targets = ADAPTERS[name]
    return random_peft_adapter(folder / name, rank, alpha, targets, rslora, seed)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(folder, name, seed) for seed, name in enumerate(ADAPTERS)}


def peft_greedy(adapter_dir, prompt):
    model = tiny_hf_model() if adapter_dir is None else peft.PeftModel.from_pretrained(tiny_hf_model(), adapter_dir)
    return hf_greedy(model.eval(), prompt, MAX_TOKENS)


def test_grouped_deltas_equal_the_reference():
    torch.manual_seed(0)
    slots_count, rank, k, n = 3, 8, 24, 40
    a, b = torch.randn(slots_count, rank, k), torch.randn(slots_count, n, rank)
    a[1, 5:], b[1, :, 5:] = 0, 0  # slot 1 uses 5 of its 8 rank columns
    x = torch.randn(7, k)
    slots = torch.tensor([2, -1, 0, 2, 1, -1, 0])
    ref = lora_delta_ref(x, slots, a, b)
    got = lora_delta_grouped(x, slot_groups(slots), a, b, [8, 5, 8])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert got[1].abs().max() == 0 and got[5].abs().max() == 0  # rows without an adapter: no delta
    whole = torch.tensor([1] * 7)
    torch.testing.assert_close(lora_delta_grouped(x, slot_groups(whole), a, b, [8, 5, 8]),
                               lora_delta_ref(x, whole, a, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_adds_the_reference_deltas(dtype):
    """lora.cpp's lora_add on a fused linear's three outputs: slots of different ranks and projections (one without
    k), rows of no adapter left as they were, a slot of 40 rows (past GEMM_ROWS: its GEMM path), factors of x's
    dtype kind (float32, or bfloat16 beside bfloat16 activations)."""
    ext = cpu_extension()
    torch.manual_seed(0)
    sizes, k, max_rank = [24, 8, 8], 40, 8
    cap, n = max_rank * len(sizes), sum(sizes)
    a, bt = torch.zeros(3, cap, k), torch.zeros(3, cap, n)
    parts = torch.zeros(3, len(sizes), 2, dtype=torch.int64)
    for slot, ranks in enumerate(([8, 8, 8], [5, 0, 3], [1, 2, 7])):
        col = 0
        for p, r in enumerate(ranks):
            offset = sum(sizes[:p])
            a[slot, col:col + r] = torch.randn(r, k)
            bt[slot, col:col + r, offset:offset + sizes[p]] = torch.randn(r, sizes[p])
            parts[slot, p] = torch.tensor([col, r] if r else [0, 0])
            col += r
    factors = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    a, bt = a.to(factors), bt.to(factors)
    slots = torch.tensor([2, -1, 0, 2, 1, -1, 0] + [1] * 40)
    x = torch.randn(len(slots), k).to(dtype)
    base = torch.randn(len(slots), n).to(dtype)
    outs = [p.clone() for p in base.split(sizes, dim=1)]
    ext.lora_add(x, outs, slots, a, bt, parts)
    got = torch.cat(outs, dim=1)
    want = (base.float() + lora_delta_ref(x, slots, a, bt.transpose(1, 2))).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[[1, 5]], base[[1, 5]])  # rows without an adapter: untouched
    assert not torch.equal(got[7:], base[7:])  # the GEMM path added its deltas


def test_bad_adapters_are_refused_by_name(tiny_artifact, adapters, tmp_path):
    graph = read(tiny_artifact).graph
    with pytest.raises(AdapterError, match=r"rank 16 is above the maximum rank 8"):
        load_adapter(adapters["mlp16"], graph, max_rank=8)
    with pytest.raises(AdapterError, match="adapter_config.json: no such file"):
        load_adapter(tmp_path, graph)
    # a tensor of another base model's width, one for a module the graph lacks, a missing lora_B
    from safetensors.torch import load_file, save_file

    for case, edit, message in (
        ("wide", lambda t, k: t[k].repeat(1, 2) if "q_proj.lora_A" in k and "layers.1" in k else t[k],
         r"adapter_model.safetensors: base_model.model.model.layers.1.self_attn.q_proj is \(64 x 128\), this "
         r"model's model.layers.1.self_attn.q_proj is \(64 x 64\)"),
        ("lm_head", None, r"base_model.model.lm_head targets 'lm_head', which is not one of this model's projections"),
        ("no_b", None, r"layers.0.self_attn.q_proj has no lora_B.weight"),
    ):
        bad = tmp_path / case
        shutil.copytree(adapters["all4"], bad)
        tensors = load_file(bad / "adapter_model.safetensors")
        if case == "wide":
            tensors = {k: edit(tensors, k) for k in tensors}
        elif case == "lm_head":
            tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
            tensors["base_model.model.lm_head.lora_B.weight"] = torch.zeros(256, 4)
        else:
            del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
        save_file(tensors, bad / "adapter_model.safetensors")
        with pytest.raises(AdapterError, match=message):
            load_adapter(bad, graph)
    dora = tmp_path / "dora"
    shutil.copytree(adapters["all4"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="adapter_config.json: use_dora is not supported"):
        load_adapter(dora, graph)


def test_fused_projections_take_adapters_of_the_separate_ones(tiny_artifact, adapters):
    graph = read(tiny_artifact).graph
    assert any(n.name.endswith("qkv_proj") for n in graph.nodes)  # recipes/tiny.yaml fuses qkv and gate_up
    adapter = load_adapter(adapters["all4"], graph)
    assert len(adapter.factors) == 2 * 7 and adapter.scaling == 2.0


def test_mixed_requests_equal_peft(tiny_artifact, adapters):
    """Base and three adapters at once, every prompt under each, one engine: peft's greedy tokens."""
    engine = Engine.load(tiny_artifact, max_loras=3, max_lora_rank=16)
    for name, path in adapters.items():
        engine.load_lora(name, path)
    names = [None, *ADAPTERS]
    jobs = [(p, n) for p in PROMPTS for n in names]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    done = engine.generate([p for p, _ in jobs], params, loras=[n for _, n in jobs])
    expected = {(i, n): peft_greedy(None if n is None else adapters[n], p)
                for i, p in enumerate(PROMPTS) for n in names}
    got = {(i, n): c.token_ids for (p, n), c, i in zip(jobs, done, [PROMPTS.index(p) for p, _ in jobs], strict=True)}
    assert got == expected
    # the adapters change the tokens: the test would catch deltas that were never added
    assert all(expected[(i, n)] != expected[(i, None)] for i in range(len(PROMPTS)) for n in ADAPTERS)
    assert_no_leaks(engine)


def test_prefix_blocks_are_keyed_by_adapter(tiny_artifact, adapters):
    engine = Engine.load(tiny_artifact, max_loras=2, max_lora_rank=16)
    engine.load_lora("a", adapters["all4"])
    engine.load_lora("b", adapters["qv8"])
    prompt, params = list(range(1, 40)), SamplingParams(max_tokens=1, temperature=0.0)
    kv = engine.kv_manager

    def hits(lora):
        before = kv.num_prefix_hit_tokens
        engine.generate([prompt], params, loras=[lora])
        return kv.num_prefix_hit_tokens - before

    assert hits("a") == 0
    assert hits("b") == 0  # the same tokens under another adapter: no shared block
    assert hits(None) == 0  # nor the base
    assert hits("a") == 32 and hits("b") == 32 and hits(None) == 32  # each its own: two full blocks of 16
    assert_no_leaks(engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adapter_steps_stay_fused_bit_for_bit(tmp_path, adapters, dtype):
    """Base and adapter rows in one decode step run the planned fused CPU step (its linears add lora.cpp's deltas)
    and give the node-by-node step's logits bit for bit; in float32 the tokens are peft's."""
    cpu_extension()
    recipe = tmp_path / "step.yaml"
    recipe.write_text(f"model: random:tiny\ndtype: {dtype}\ntarget: cpu\npasses: [fuse_qkv, fuse_gate_up, "
                      "fuse_add_rmsnorm, fuse_rope_kv, kv_layout, {select_kernels: {measure: false}}, plan_cpu_step]\n")
    engine = Engine.load(build_artifact(tmp_path / "a", recipe), max_loras=3, max_lora_rank=16,
                         enable_prefix_caching=False)
    for name, path in adapters.items():
        engine.load_lora(name, path)
    model = engine.model
    (start, (stop, names, outs, fn, dead)), = model.executor._fused.items()
    taken = []

    def counted(values, step):
        out = fn(values, step)
        taken.append(out is not None and step.lora_slots is not None)
        return out

    loras = [None, *ADAPTERS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    def run(fused: dict) -> tuple[list, list[torch.Tensor]]:
        model.executor._fused = fused
        seen, forward = [], model.forward
        model.forward = lambda *args, **kwargs: seen.append(forward(*args, **kwargs).clone()) or seen[-1]
        try:
            done = engine.generate([PROMPTS[0]] * len(loras), params, loras=loras)
        finally:
            del model.forward
        return [c.token_ids for c in done], seen

    tokens, fused_logits = run({start: (stop, names, outs, counted, dead)})
    _, nodes_logits = run({})
    # every step, adapter rows and all, ran as the fused call: the prefill (5 rows a request) and each decode step
    assert taken == [True] * MAX_TOKENS
    assert len(fused_logits) == len(nodes_logits) and all(
        torch.equal(f, n) for f, n in zip(fused_logits, nodes_logits, strict=True))
    if dtype == "float32":
        assert tokens == [peft_greedy(None if n is None else adapters[n], PROMPTS[0]) for n in loras]


def test_unknown_and_unloaded_adapters(tiny_artifact, adapters):
    engine = Engine.load(tiny_artifact, max_loras=1, max_lora_rank=16)
    engine.load_lora("a", adapters["all4"])
    with pytest.raises(UnknownAdapterError, match="the model 'nope' does not exist"):
        engine.add_request([1, 2, 3], lora="nope")
    with pytest.raises(Exception, match="all 1 adapter slots are in use"):
        engine.load_lora("b", adapters["qv8"])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    request = engine.add_request(PROMPTS[0], params, lora="a")
    engine.step()
    engine.unload_lora("a")  # in flight: it finishes under its adapter first
    assert engine.lora_names() == []
    with pytest.raises(UnknownAdapterError):
        engine.add_request([1, 2, 3], lora="a")
    with pytest.raises(Exception, match="all 1 adapter slots are in use"):
        engine.load_lora("b", adapters["qv8"])  # the slot is still held by the finishing request
    while engine.has_unfinished():
        engine.step()
    assert request.output_token_ids == peft_greedy(adapters["all4"], PROMPTS[0])
    engine.load_lora("b", adapters["qv8"])  # the slot is free now
    assert engine.lora_names() == ["b"]
    assert_no_leaks(engine)


def test_the_triton_kernel_adds_the_reference_deltas():
    """kernels/lora_bgmv.py (under TRITON_INTERPRET=1 without a GPU) on a fused linear's three outputs: rows of
    several slots, rows of none untouched, slot ids read from a tensor."""
    from optc.kernels.lora_bgmv import lora_add

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    sizes, k, cap = [24, 8, 8], 40, 12
    a, bt = torch.randn(3, cap, k), torch.randn(3, cap, sum(sizes))
    a[1, 5:], bt[1, 5:] = 0, 0  # slot 1 uses 5 of its 12 columns
    slots = torch.tensor([2, -1, 0, 2, 1, -1, 0])
    x, base = torch.randn(len(slots), k), torch.randn(len(slots), sum(sizes))
    outs = [p.clone().to(device) for p in base.split(sizes, dim=1)]
    lora_add(x.to(device), outs, slots.to(device), a.to(device), bt.to(device))
    got = torch.cat(outs, dim=1).cpu()
    torch.testing.assert_close(got, base + lora_delta_ref(x, slots, a, bt.transpose(1, 2)), rtol=1e-5, atol=1e-4)
    assert torch.equal(got[[1, 5]], base[[1, 5]])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU artifact through the Triton kernel needs the interpreter, "
                    "off where a GPU is present (the kernel test above runs on the device there)")
def test_the_triton_kernel_serves_mixed_requests(tiny_artifact, adapters):
    """The runtime's CUDA path (kernels/lora_bgmv.py; here under TRITON_INTERPRET=1 on CPU tensors): peft's tokens."""
    from optc.runtime.lora import TRITON

    engine = Engine.load(tiny_artifact, max_loras=2, max_lora_rank=16)
    engine.model.lora.kernel = TRITON
    engine.load_lora("all4", adapters["all4"])
    engine.load_lora("qv8", adapters["qv8"])
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    loras = [None, "all4", "qv8"]
    done = engine.generate([PROMPTS[0]] * 3, params, loras=loras)
    want = [hf_greedy((tiny_hf_model() if n is None else peft.PeftModel.from_pretrained(tiny_hf_model(), adapters[n]))
                      .eval(), PROMPTS[0], 4) for n in loras]
    assert [c.token_ids for c in done] == want
