"""quantize_rtn / quantize_awq / quantize_gptq on random:tiny: structure, idempotence, numerics."""

import pytest
import torch

from optc.core.execute import Executor, bind_params, run_dense
from optc.core.formats import FormatKind
from optc.core.ops import verify
from optc.frontend.passmanager import PassContext, make_pass
from optc.frontend.sources import load_source

CASES = [("quantize_rtn", {"group_size": 32}), ("quantize_rtn", {"bits": 8}),
         ("quantize_awq", {"group_size": 32}), ("quantize_awq", {"group_size": 32, "search_samples": 3}),
         ("quantize_gptq", {"group_size": 32}),
         ("quantize_gptq", {"bits": 8})]
# relative logits error bound on random:tiny (measured ~0.13 for int4 g32, ~0.01 for int8)
BOUND = {4: 0.2, 8: 0.02}


@pytest.fixture(scope="module")
def tiny():
    src = load_source("random:tiny")
    tokens = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    return src, PassContext(calibration_tokens=lambda: tokens)


def _logits(graph, store, ids):
    return run_dense(Executor(graph, bind_params(graph, store)), ids)


@pytest.mark.parametrize("name,options", CASES)
def test_structure_idempotence_numerics(tiny, name, options):
    src, ctx = tiny
    p = make_pass(name, options)
    result = p.run(src.graph, src.store, ctx)
    assert result.changed and result.stats["quantized"] == 14
    verify(result.graph, result.store)
    bits = options.get("bits", 4)
    for node in result.graph.nodes:
        fmt = result.graph.tensors[node.params["weight"]].format if node.params else None
        if node.op == "linear":
            assert fmt.kind is (FormatKind.INT4_G if bits == 4 else FormatKind.INT8_WO)
            assert bits == 8 or (fmt.group_size == 32 and fmt.zero_point)
        elif fmt is not None:  # embedding, norms and lm_head stay dense
            assert fmt.kind is FormatKind.DENSE
    assert result.manifest["quantization"]["method"] == name.removeprefix("quantize_")
    assert src.graph.tensors["model.layers.0.mlp.up_proj.weight"].format.kind is FormatKind.DENSE  # input intact
    again = p.run(result.graph, result.store, ctx)
    assert not again.changed and again.graph is result.graph
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    ref, out = _logits(src.graph, src.store, ids), _logits(result.graph, result.store, ids)
    assert float((out - ref).norm() / ref.norm()) < BOUND[bits]


def test_awq_folds_scales_into_norms_and_is_deterministic(tiny):
    src, ctx = tiny
    p = make_pass("quantize_awq", {"group_size": 32})
    a, b = p.run(src.graph, src.store, ctx), p.run(src.graph, src.store, ctx)
    assert a.stats["scaled_groups"] == 6  # per layer: q/k/v, gate/up, down (o skipped: GQA)
    norms = [t for t in src.graph.tensors if t.endswith("layernorm.weight")]
    changed = [t for t in norms if not torch.equal(a.store.get(t), src.store.get(t))]
    assert changed  # 1/s went into the norms (a norm stays put where the search chose α = 0)
    for key in ("model.layers.1.mlp.down_proj.weight.qweight", *norms):
        assert torch.equal(a.store.get(key), b.store.get(key))


def test_fused_linears_are_quantized_too(tiny):
    src, ctx = tiny
    g, s = src.graph, src.store
    for name in ("fuse_qkv", "fuse_gate_up"):
        r = make_pass(name).run(g, s, ctx)
        g, s = r.graph, r.store
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    ref = _logits(g, s, ids)
    for name in ("quantize_awq", "quantize_gptq"):
        r = make_pass(name, {"group_size": 32}).run(g, s, ctx)
        assert r.stats["quantized"] == 8  # qkv, o, gate_up, down per layer
        verify(r.graph, r.store)
        assert float((_logits(r.graph, r.store, ids) - ref).norm() / ref.norm()) < BOUND[4]


def test_calibrated_passes_need_calibration(tiny):
    src, _ = tiny
    with pytest.raises(ValueError, match="quantize_gptq needs calibration data"):
        make_pass("quantize_gptq").run(src.graph, src.store, PassContext())
    with pytest.raises(ValueError, match="unsupported bits 3"):
        make_pass("quantize_rtn", {"bits": 3})
