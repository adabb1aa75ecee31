"""quantize_fp8 (methods rtn and gptq) and quantize_rtn's `activations: dynamic` on random:tiny: structure,
idempotence, numerics within a stated bound, the manifest records, and the refusals (requantizing to another
format, int4 with dynamic activations, options that name no allowed value or belong to another method)."""

import pytest
import torch

from optc.core.errors import InputError
from optc.core.execute import Executor, bind_params, run_dense
from optc.core.formats import Activations, Format, FormatKind
from optc.core.ops import verify
from optc.frontend.passmanager import PassContext, make_pass
from optc.frontend.sources import load_source

# relative logits error bound on random:tiny (measured: fp8 per channel 0.043, per tensor 0.044, fp8 W8A8
# 0.059, int8 W8A8 0.016; Gaussian random weights are where int8's 255 even steps beat fp8's 3 mantissa bits)
CASES = [
    ("quantize_fp8", {}, FormatKind.FP8_E4M3, False, Activations.NONE, 0.07),
    ("quantize_fp8", {"per_tensor": True}, FormatKind.FP8_E4M3, True, Activations.NONE, 0.07),
    ("quantize_fp8", {"activations": "dynamic"}, FormatKind.FP8_E4M3, False, Activations.DYNAMIC, 0.09),
    ("quantize_rtn", {"bits": 8, "activations": "dynamic"}, FormatKind.INT8_WO, False, Activations.DYNAMIC, 0.03),
]


@pytest.fixture(scope="module")
def tiny():
    return load_source("random:tiny")


def _logits(graph, store, ids=None):
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1)) if ids is None else ids
    return run_dense(Executor(graph, bind_params(graph, store)), ids)


@pytest.mark.parametrize("name,options,kind,per_tensor,activations,bound", CASES,
                         ids=[f"{c[0]}-{'-'.join(f'{k}={v}' for k, v in c[1].items())}" for c in CASES])
def test_structure_idempotence_numerics(tiny, name, options, kind, per_tensor, activations, bound):
    p = make_pass(name, options)
    result = p.run(tiny.graph, tiny.store, PassContext())
    assert result.changed and result.stats["quantized"] == 14
    verify(result.graph, result.store)
    for node in result.graph.nodes:
        if not node.params:
            continue
        fmt = result.graph.tensors[node.params["weight"]].format
        if node.op == "linear":
            assert (fmt.kind, fmt.per_tensor, fmt.activations) == (kind, per_tensor, activations)
            parts = fmt.part_shapes(result.graph.tensors[node.params["weight"]].shape)
            assert all(result.store.entry(f"{node.params['weight']}.{r}").dtype == d for r, (_, d) in parts.items())
        else:  # embedding, norms and lm_head stay dense
            assert fmt.kind is FormatKind.DENSE
    assert tiny.graph.tensors["model.layers.0.mlp.up_proj.weight"].format.kind is FormatKind.DENSE  # input intact
    again = p.run(result.graph, result.store, PassContext())
    assert not again.changed and again.graph is result.graph
    p.requires(result.graph)  # its own format is not a requantization
    ref, out = _logits(tiny.graph, tiny.store), _logits(result.graph, result.store)
    assert float((out - ref).norm() / ref.norm()) < bound


def test_manifest_sections_record_the_format_and_the_activations(tiny):
    fp8 = make_pass("quantize_fp8", {"activations": "dynamic", "per_tensor": True}).run(tiny.graph, tiny.store,
                                                                                        PassContext())
    assert fp8.manifest["quantization"] == {"method": "rtn", "format": "fp8_e4m3", "scales": "per_tensor",
                                            "activations": "dynamic"}
    assert fp8.stats == {"quantized": 14, "method": "rtn"}
    rtn = make_pass("quantize_rtn", {"bits": 8, "activations": "dynamic"}).run(tiny.graph, tiny.store, PassContext())
    assert rtn.manifest["quantization"] == {"method": "rtn", "bits": 8, "group_size": None, "zero_point": False,
                                            "activations": "dynamic"}
    plain = make_pass("quantize_rtn", {"bits": 8}).run(tiny.graph, tiny.store, PassContext())
    assert "activations" not in plain.manifest["quantization"]  # weight-only records read as before


def test_requantizing_to_another_format_is_refused(tiny):
    int8 = make_pass("quantize_rtn", {"bits": 8}).run(tiny.graph, tiny.store, PassContext())
    with pytest.raises(InputError, match=r"already quantized \(int8_wo\); quantize_fp8 would quantize it again to "
                                         r"fp8_e4m3/act-dynamic: keep one quantization pass"):
        make_pass("quantize_fp8", {"activations": "dynamic"}).requires(int8.graph)
    with pytest.raises(InputError, match=r"activations=none\); quantize_rtn would quantize it again to bits=8 "
                                         "group_size=None zero_point=False activations=dynamic"):
        make_pass("quantize_rtn", {"bits": 8, "activations": "dynamic"}).requires(int8.graph)
    fp8 = make_pass("quantize_fp8", {}).run(tiny.graph, tiny.store, PassContext())
    with pytest.raises(InputError, match=r"already quantized \(fp8_e4m3\); quantize_fp8 would .* fp8_e4m3/per-tensor"):
        make_pass("quantize_fp8", {"per_tensor": True}).requires(fp8.graph)


def test_dynamic_activations_need_int8(tiny):
    with pytest.raises(InputError, match="activations: dynamic needs bits: 8 .int8 W8A8., got bits: 4"):
        make_pass("quantize_rtn", {"bits": 4, "activations": "dynamic"})


CALIBRATION = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))


def _calibrated() -> PassContext:
    return PassContext(calibration_tokens=lambda: CALIBRATION)


@pytest.mark.parametrize("activations,gain", [(Activations.NONE, 0.8), (Activations.DYNAMIC, 0.95)])
def test_gptq_method_structure_idempotence_numerics(tiny, activations, gain):
    p = make_pass("quantize_fp8", {"method": "gptq", "activations": activations.value})
    result = p.run(tiny.graph, tiny.store, _calibrated())
    assert result.changed and result.stats == {"quantized": 14, "method": "gptq"}
    verify(result.graph, result.store)
    linears = {n.params["weight"] for n in result.graph.nodes if n.op == "linear"}
    assert {result.graph.tensors[t].format for t in linears} == {Format(FormatKind.FP8_E4M3, activations=activations)}
    assert {result.store.entry(f"{t}.qweight").dtype for t in linears} == {torch.float8_e4m3fn}
    assert result.manifest["quantization"] == {"method": "gptq", "format": "fp8_e4m3", "scales": "per_channel",
                                               "activations": activations.value, "damp": 0.01, "act_order": False,
                                               "calibration": {}}
    again = p.run(result.graph, result.store, _calibrated())
    assert not again.changed and again.graph is result.graph
    # on the tokens it was calibrated on, error feedback beats the nearest e4m3 value (measured relative logits
    # error: 0.031 vs 0.042 weight-only, 0.050 vs 0.055 with fp8 activations, whose own error it cannot touch;
    # on other random ids the two are within 10% of each other: random Gaussian weights and embeddings give
    # nearly uncorrelated inputs, the case GPTQ cannot improve)
    rtn = make_pass("quantize_fp8", {"activations": activations.value}).run(tiny.graph, tiny.store, PassContext())
    ref = _logits(tiny.graph, tiny.store, CALIBRATION[:2])
    gptq_err = float((_logits(result.graph, result.store, CALIBRATION[:2]) - ref).norm() / ref.norm())
    rtn_err = float((_logits(rtn.graph, rtn.store, CALIBRATION[:2]) - ref).norm() / ref.norm())
    assert gptq_err < gain * rtn_err


def test_fp8_options_name_the_key_and_what_is_allowed():
    with pytest.raises(InputError, match="method: 'gtpq' is not allowed; allowed: rtn, gptq"):
        make_pass("quantize_fp8", {"method": "gtpq"})
    with pytest.raises(InputError, match="activations: 'static' is not allowed; allowed: none, dynamic"):
        make_pass("quantize_fp8", {"activations": "static"})
    with pytest.raises(InputError, match=r"damp, act_order: only with method: gptq \(GPTQ's options\); method is rtn"):
        make_pass("quantize_fp8", {"damp": 0.1, "act_order": True})
    assert make_pass("quantize_fp8", {"method": "gptq", "act_order": True}).options.act_order


def test_recipe_errors_name_the_pass_option(tmp_path):
    from optc.frontend.recipe import load_recipe
    from optc.frontend.schema import RecipeError

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: random:tiny\npasses:\n  - quantize_fp8: {method: awq}\n")
    with pytest.raises(RecipeError, match=r"r.yaml:3: passes\[0\].quantize_fp8.method: str 'awq' is not allowed; "
                                         "allowed: rtn, gptq"):
        load_recipe(recipe)
    recipe.write_text("model: random:tiny\npasses:\n  - quantize_fp8: {block_size: 256}\n")
    with pytest.raises(RecipeError, match=r"passes\[0\].quantize_fp8: block_size: only with method: gptq"):
        load_recipe(recipe)
