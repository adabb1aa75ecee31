"""quantize_lm_head: a tied lm_head gets its own quantized tensor (the embedding stays dense), the artifact
runs with it on the reference and on the packed CPU lm_head kernels, and those kernels match logits_ref."""

import pytest
import torch

from optc.core.artifact import read
from optc.core.errors import InputError
from optc.core.execute import Executor, Step, bind_params, run_dense
from optc.core.formats import Format
from optc.core.ir import Node
from optc.core.ops import OPS, Param
from optc.core.ops.linear import logits_ref
from optc.core.store import TensorStore
from optc.frontend.passmanager import PassContext, make_pass
from optc.frontend.quant.rtn import make_format, quantize_weight
from optc.kernels.int4_cpu import int4pack_logits, prepare_int4pack_logits
from optc.kernels.int8_cpu import int8pack_logits, int_mm_logits
from optc.kernels.registry import impls
from optc.testing import build_artifact

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """A tiny tied-embedding Llama checkpoint (SmolLM2's layout)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    path = tmp_path_factory.mktemp("tied")
    model.save_pretrained(str(path))
    return path


def _passes(lm_head: str) -> str:
    return ("passes=[fuse_qkv, fuse_gate_up, {quantize_rtn: {bits: 4, group_size: 32}}, "
            f"{{quantize_lm_head: {lm_head}}}, {{kv_layout: {{block_size: 16}}}}, select_kernels]")


@pytest.mark.parametrize("lm_head,kernel", [("{bits: 8}", "cpu.int8pack_logits"),
                                            ("{bits: 4, group_size: 32}", "cpu.int4pack_logits")])
def test_tied_lm_head_gets_its_own_quantized_tensor(tmp_path, tied_dir, lm_head, kernel):
    out = build_artifact(tmp_path / "a", None, "dtype=bfloat16", "target=cpu", _passes(lm_head), model=str(tied_dir))
    art = read(out)
    g = art.graph
    head, embed = g.node("lm_head"), next(n for n in g.nodes if n.op == "embedding")
    assert head.params["weight"] == "lm_head.weight" and embed.params["weight"] == "model.embed_tokens.weight"
    assert not g.config.tie_word_embeddings  # the artifact now holds two tensors, as an untied model does
    assert not g.tensors["model.embed_tokens.weight"].format.is_quantized
    fmt = g.tensors["lm_head.weight"].format
    assert fmt.is_quantized
    store = TensorStore.from_safetensors(sorted(out.glob("weights-*.safetensors")))
    expected = quantize_weight(store.get("model.embed_tokens.weight"), fmt)
    for role, part in expected.items():
        assert torch.equal(store.get(f"lm_head.weight.{role}"), part), role
    # the measured choice binds the packed kernel at decode sizes
    assert kernel in {head.kernel} | {k for _, k in head.attrs.get("kernel_by_m", ())}
    # the kernel-bound logits agree with the references': same argmax on every row
    params = bind_params(g, store)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(1))
    names = {n.kernel for n in g.nodes} | {k for n in g.nodes for _, k in n.attrs.get("kernel_by_m", ())}
    fast = run_dense(Executor(g, params, impls(names - {"torch"})), ids, all_logits=False)
    ref = run_dense(Executor(g, params, use_references=True), ids, all_logits=False)
    assert torch.equal(fast.argmax(-1), ref.argmax(-1))


def _head_weight(fmt: Format, n=96, k=64, seed=0) -> dict:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quantize_weight(w, fmt)


@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("kernel", ["int4pack", "int8pack", "int_mm"])
def test_packed_lm_head_kernels_match_logits_ref(m, kernel):
    bits = 4 if kernel == "int4pack" else 8
    fmt = make_format(bits, 32 if bits == 4 else None, bits == 4, "bfloat16")
    parts = _head_weight(fmt)
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).bfloat16()
    ref = logits_ref(x, parts, fmt)
    if kernel == "int8pack":
        out = int8pack_logits(x, parts, fmt)
    elif kernel == "int_mm":  # x rounded to int8 per row: the rest moves by about the int8 weight's error
        out = int_mm_logits(x, parts, fmt)
    else:
        out = int4pack_logits(x, prepare_int4pack_logits({"weight": Param(parts, fmt)})["weight"].parts, fmt)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # each row's best logits are recomputed in fp32 from the stored parts by both: equal there
    top = ref.topk(4, dim=-1)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    assert torch.equal(out.gather(-1, top.indices), top.values)
    # the rest is the bf16 matmul's rounding (and int_mm's of x)
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()


def test_lm_head_kernel_choice_routes_on_the_selected_rows(monkeypatch):
    # a node whose table sends M <= 1 to the packed kernel: 7 hidden rows with 1 selected is M = 1
    fmt = make_format(8, None, False, "bfloat16")
    params = {"weight": Param(_head_weight(fmt), fmt)}
    node = Node("lm_head", "lm_head", ["final"], ["logits"],
                {"kernel": "cpu.int8pack_logits", "kernel_by_m": [[1, "cpu.int8pack_logits"], [None, "torch"]]},
                {"weight": "w"})
    calls = []
    import optc.kernels.int8_cpu as int8_cpu

    real = int8_cpu.int8pack_logits
    monkeypatch.setattr(int8_cpu, "int8pack_logits", lambda *a: calls.append(1) or real(*a))
    impl = impls(["cpu.int8pack_logits"])["cpu.int8pack_logits"]
    x = torch.randn(7, 64).bfloat16()
    step = Step(positions=torch.arange(7), batch=None, cos_sin=torch.zeros(1, 16), logits_indices=torch.tensor([6]))
    out = impl(node, [x], params, step)[0]
    assert calls and out.shape == (1, 96)
    assert torch.equal(out.argmax(-1), OPS["lm_head"].ref(node, [x], params, step)[0].argmax(-1))
    calls.clear()
    impl(node, [x], params, Step(torch.arange(7), None, torch.zeros(1, 16), None))  # all 7 rows: the reference
    assert not calls


def test_quantize_lm_head_runs_once_and_refuses_another_format():
    from optc.frontend.sources import load_source

    src = load_source("random:tiny")
    ctx = PassContext(target="cpu", dtype="float32")
    first = make_pass("quantize_lm_head", {"bits": 8}).run(src.graph, src.store, ctx)
    assert first.changed and first.stats["tensor"] == "lm_head.weight" and not first.stats["untied"]
    again = make_pass("quantize_lm_head", {"bits": 8})
    again.requires(first.graph)
    assert not again.run(first.graph, first.store, ctx).changed
    with pytest.raises(InputError, match="already quantized"):
        make_pass("quantize_lm_head", {"bits": 4, "group_size": 32}).requires(first.graph)
    with pytest.raises(InputError, match="lm_head.weight"):  # 64 features do not split into groups of 128
        make_pass("quantize_lm_head", {"bits": 4, "group_size": 128}).run(src.graph, src.store, ctx)


@pytest.mark.parametrize("options", [{"bits": 8}, {"bits": 4, "group_size": 32}])
def test_gptq_lm_head_beats_rtn_on_its_calibration_inputs(options):
    """`method: gptq` rounds the lm_head on its inputs over the calibration tokens, computed through the
    graph as quantized so far (here int4 RTN linears): on those tokens its logits are closer to the dense
    lm_head's than round-to-nearest's (GPTQ's objective; random weights give nearly uncorrelated inputs, where
    GPTQ gains least)."""
    from optc.frontend.sources import load_source

    src = load_source("random:tiny")
    tokens = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    ctx = PassContext(target="cpu", dtype="float32", calibration_tokens=lambda: tokens)
    body = make_pass("quantize_rtn", {"group_size": 32}).run(src.graph, src.store, ctx)
    gptq = make_pass("quantize_lm_head", {**options, "method": "gptq"}).run(body.graph, body.store, ctx)
    rtn = make_pass("quantize_lm_head", options).run(body.graph, body.store, ctx)
    assert gptq.stats["method"] == "gptq" and gptq.stats["gptq_loss"] > 0 and rtn.stats["method"] == "rtn"
    assert gptq.graph.tensors["lm_head.weight"].format == rtn.graph.tensors["lm_head.weight"].format
    for role in gptq.graph.tensors["lm_head.weight"].format.part_shapes((256, 64)):
        key = f"lm_head.weight.{role}"
        assert gptq.store.entry(key).shape == rtn.store.entry(key).shape
        assert gptq.store.entry(key).dtype == rtn.store.entry(key).dtype
    ids = tokens[:2]
    dense = run_dense(Executor(body.graph, bind_params(body.graph, body.store), use_references=True), ids)

    def error(result):
        out = run_dense(Executor(result.graph, bind_params(result.graph, result.store), use_references=True), ids)
        return float((out - dense).norm() / dense.norm())

    assert error(gptq) < 0.9 * error(rtn)


def test_gptq_lm_head_needs_calibration_and_its_options_need_gptq():
    from optc.frontend.sources import load_source

    src = load_source("random:tiny")
    with pytest.raises(InputError, match="quantize_lm_head needs calibration data: set `calibration:` in the recipe"):
        make_pass("quantize_lm_head", {"bits": 8, "method": "gptq"}).run(src.graph, src.store, PassContext())
    with pytest.raises(InputError, match="method: 'gtpq' is not allowed; allowed: rtn, gptq"):
        make_pass("quantize_lm_head", {"bits": 8, "method": "gtpq"})
    with pytest.raises(InputError, match=r"damp: only with method: gptq"):
        make_pass("quantize_lm_head", {"bits": 8, "damp": 0.1})


def test_int_mm_lm_head_kernel_is_offered_only_when_enabled():
    from optc.kernels.registry import KernelQuery, candidates

    fmt = make_format(8, None, False, "bfloat16")
    query = KernelQuery("lm_head", "bfloat16", fmt, (96, 64))
    assert [k.name for k in candidates(query, "cpu")] == ["cpu.int8pack_logits", "cpu.qdot_logits"]
    enabled = [k.name for k in candidates(query, "cpu", ("cpu.int_mm_logits",))]
    assert enabled == ["cpu.int8pack_logits", "cpu.qdot_logits", "cpu.int_mm_logits"]
    f32 = KernelQuery("lm_head", "float32", make_format(8), (96, 64))
    assert [k.name for k in candidates(f32, "cpu", ("cpu.int_mm_logits",))] == ["cpu.int8pack_logits",
                                                                               "cpu.qdot_logits"]
