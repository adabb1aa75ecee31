"""smoothquant on random:tiny: which groups it smooths and the exact factors it folds (structure), a second
run changes nothing (idempotence), the float model computes the same logits (numerics), and on a model with
activation outliers it makes int8 W8A8 closer to the float model (what it is for)."""

import pytest
import torch

from optc.core.errors import InputError
from optc.core.execute import Executor, bind_params, run_dense
from optc.core.store import Entry
from optc.frontend.passmanager import PassContext, make_pass
from optc.frontend.quant.blocks import start_calibration
from optc.frontend.quant.smoothquant import smooth_factors
from optc.frontend.sources import load_source
from optc.testing import assert_close

TOKENS = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
OUTLIERS = [3, 17]  # channels of every norm weight scaled by 40 in `outliers`


@pytest.fixture(scope="module")
def tiny():
    return load_source("random:tiny")


@pytest.fixture(scope="module")
def ctx():
    return PassContext(calibration_tokens=lambda: TOKENS)


def _logits(graph, store):
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    return run_dense(Executor(graph, bind_params(graph, store)), ids)


def test_smooth_factors_formula():
    act, w = torch.tensor([4.0, 1.0, 0.0, 9.0, 2.0]), torch.tensor([1.0, 4.0, 3.0, 0.0, 1e-9])
    s = smooth_factors(act, w, 0.5)
    # s = a^α / w^(1-α); a channel that never fires or has no weight keeps 1; w clamped at 1e-5
    assert torch.allclose(s, torch.tensor([2.0, 0.5, 1.0, 1.0, 2 ** 0.5 / 1e-5 ** 0.5]))
    assert torch.allclose(smooth_factors(act[:2], w[:2], 1.0), act[:2])


def test_structure_folds_the_exact_factors(tiny, ctx):
    result = make_pass("smoothquant", {"alpha": 0.5}).run(tiny.graph, tiny.store, ctx)
    assert result.changed
    assert result.stats["smoothed_groups"] == 6 and result.stats["smoothed_linears"] == 12
    smoothed = sorted(n.name for n in result.graph.nodes if "smoothquant_alpha" in n.attrs)
    # per layer: q/k/v after the input norm, gate/up after the post-attention norm, down after up;
    # o_proj is not smoothed: random:tiny has GQA (4 query heads over 2 KV heads), so no v rows to fold into
    per_layer = ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.q_proj",
                 "self_attn.v_proj"]
    assert smoothed == [f"model.layers.{i}.{n}" for i in range(2) for n in per_layer]
    assert {n.attrs["smoothquant_alpha"] for n in result.graph.nodes if "smoothquant_alpha" in n.attrs} == {0.5}
    # layer 0, q/k/v: s from the input norm's output on the calibration tokens and the three weights' columns
    runner, blocks = start_calibration(tiny.graph, tiny.store, ctx, "test")
    x = runner.run(blocks[0].nodes, runner.load(blocks[0].nodes))["model.layers.0.attn_in"]
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    w = torch.cat([tiny.store.get(n) for n in names])
    s = smooth_factors(x.abs().amax(0), w.abs().amax(0), 0.5)
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(result.store.get(norm), tiny.store.get(norm) / s)
    for n in names:
        assert torch.equal(result.store.get(n), tiny.store.get(n) * s)
    # gate/up: s1 on their columns; down: s2 on its columns and 1/s2 on the up rows (silu(g) * u / s2)
    old, new = ({p: st.get(f"model.layers.0.mlp.{p}_proj.weight") for p in ("gate", "up", "down")}
                for st in (tiny.store, result.store))
    s1, s2 = new["gate"][0] / old["gate"][0], new["down"][0] / old["down"][0]
    assert_close(new["gate"], old["gate"] * s1, rtol=1e-6, what="gate columns")
    assert_close(new["down"], old["down"] * s2, rtol=1e-6, what="down columns")
    assert_close(new["up"] * s2[:, None], old["up"] * s1, rtol=1e-6, what="up rows and columns")
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(result.store.get(o), tiny.store.get(o))


def test_idempotent_without_calibrating_again(tiny, ctx):
    p = make_pass("smoothquant", {})
    first = p.run(tiny.graph, tiny.store, ctx)
    again = p.run(first.graph, first.store, PassContext())  # no calibration data: nothing left to smooth
    assert not again.changed and again.graph is first.graph


def test_numerics_the_float_model_is_unchanged(tiny, ctx):
    result = make_pass("smoothquant", {"alpha": 0.8}).run(tiny.graph, tiny.store, ctx)
    ref = _logits(tiny.graph, tiny.store)
    assert_close(_logits(result.graph, result.store), ref, rtol=1e-5, what="logits after smoothing")


def test_refuses_quantized_linears(tiny, ctx):
    int8 = make_pass("quantize_rtn", {"bits": 8}).run(tiny.graph, tiny.store, ctx)
    with pytest.raises(InputError, match="is already quantized; smoothquant rescales dense weights: put it before"):
        make_pass("smoothquant", {}).requires(int8.graph)


@pytest.fixture(scope="module")
def outliers(tiny):
    """random:tiny with channels 3 and 17 of every norm weight scaled by 40: activation outliers."""
    entries = {}
    for name in tiny.graph.tensors:
        if name.endswith("layernorm.weight"):
            w = tiny.store.get(name).clone()
            w[OUTLIERS] *= 40
            entries[name] = Entry(tuple(w.shape), w.dtype, lambda w=w: w)
    return tiny.graph, tiny.store.with_entries(entries)


def test_smoothing_moves_outliers_out_of_int8_w8a8_activations(outliers, ctx):
    graph, store = outliers
    ref = _logits(graph, store)
    smoothed = make_pass("smoothquant", {"alpha": 0.5}).run(graph, store, ctx)
    # max |x| over the smoothed inputs, before and after (measured 1228 -> 17)
    assert smoothed.stats["max_abs_x_before"] > 20 * smoothed.stats["max_abs_x_after"]
    w8a8 = make_pass("quantize_rtn", {"bits": 8, "activations": "dynamic"})
    errors = []
    for g, s in ((graph, store), (smoothed.graph, smoothed.store)):
        q = w8a8.run(g, s, ctx)
        errors.append(float((_logits(q.graph, q.store) - ref).norm() / ref.norm()))
    assert errors[1] < 0.6 * errors[0], errors  # measured 0.105 -> 0.048
