"""cast, fuse_qkv, fuse_gate_up: expected structure, idempotence, and numerics (exact for layout passes)."""

from __future__ import annotations

import re

import pytest
import torch

from optc.core.execute import Executor, bind_params, run_dense
from optc.core.ops import verify
from optc.frontend.passmanager import PassContext, PassError, PassManager, make_pass
from optc.frontend.sources import load_source
from optc.testing import assert_close

IDS = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(3))


def _run(name, graph, store, **options):
    result = make_pass(name, options).run(graph, store, PassContext(dtype="float32"))
    verify(result.graph, result.store)
    return result


def _logits(graph, store):
    return run_dense(Executor(graph, bind_params(graph, store)), IDS)


@pytest.fixture()
def tiny():
    return load_source("random:tiny")


def test_fuse_qkv_structure(tiny):
    num_nodes = len(tiny.graph.nodes)
    r = _run("fuse_qkv", tiny.graph, tiny.store)
    assert r.changed and r.stats == {"fused": 2}
    node = r.graph.node("model.layers.0.self_attn.qkv_proj")
    assert node.op == "linear" and node.attrs["split"] == [64, 32, 32] and node.attrs["out_features"] == 128
    assert node.outputs == [f"model.layers.0.self_attn.{x}_proj" for x in "qkv"]
    assert node.params == {"weight": "model.layers.0.self_attn.qkv_proj.weight"}
    assert "model.layers.0.self_attn.q_proj.weight" not in r.graph.tensors
    assert "model.layers.0.self_attn.q_proj.weight" not in r.store
    assert len(r.graph.nodes) == num_nodes - 4
    assert len(tiny.graph.nodes) == num_nodes == 31, "the input graph was mutated"


def test_fuse_gate_up_structure(tiny):
    r = _run("fuse_gate_up", tiny.graph, tiny.store)
    assert r.changed and r.stats == {"fused": 2}
    node = r.graph.node("model.layers.1.mlp.gate_up_proj")
    assert node.attrs["split"] == [128, 128]
    assert r.graph.tensors["model.layers.1.mlp.gate_up_proj.weight"].shape == (256, 64)
    w = r.store.get("model.layers.1.mlp.gate_up_proj.weight")
    assert torch.equal(w[:128], tiny.store.get("model.layers.1.mlp.gate_proj.weight"))
    assert torch.equal(w[128:], tiny.store.get("model.layers.1.mlp.up_proj.weight"))


def test_cast_structure(tiny):
    r = _run("cast", tiny.graph, tiny.store, dtype="bfloat16")
    assert r.changed and r.stats == {"cast": 21, "dtype": "bfloat16"}  # 3 + 2 layers x (2 norms + 7 linears)
    assert {i.format.dtype for i in r.graph.tensors.values()} == {"bfloat16"}
    assert (tiny.graph.config.dtype, r.graph.config.dtype) == ("float32", "bfloat16")  # the activations follow
    assert r.store.get("model.norm.weight").dtype == torch.bfloat16
    assert tiny.store.get("model.norm.weight").dtype == torch.float32


@pytest.mark.parametrize("name", ["fuse_qkv", "fuse_gate_up", "cast"])
def test_second_run_changes_nothing(tiny, name):
    once = _run(name, tiny.graph, tiny.store, **({"dtype": "bfloat16"} if name == "cast" else {}))
    twice = _run(name, once.graph, once.store, **({"dtype": "bfloat16"} if name == "cast" else {}))
    assert once.changed and not twice.changed
    assert twice.graph.dumps() == once.graph.dumps()


@pytest.mark.parametrize("names", [["fuse_qkv"], ["fuse_gate_up"], ["fuse_qkv", "fuse_gate_up"]])
def test_fusion_keeps_logits_exactly(tiny, names):
    before = _logits(tiny.graph, tiny.store)
    graph, store, records, _ = PassManager([(n, {}) for n in names], verify_each=True).run(
        tiny.graph, tiny.store, PassContext())
    assert torch.equal(_logits(graph, store), before)
    assert [r.name for r in records] == names


def test_cast_numerics_within_bf16_rounding(tiny):
    before = _logits(tiny.graph, tiny.store)
    r = _run("cast", tiny.graph, tiny.store, dtype="bfloat16")
    assert_close(_logits(r.graph, r.store), before, rtol=0.05, what="bf16 logits")
    assert not torch.equal(_logits(r.graph, r.store), before)


def test_failing_pass_is_named_with_those_before_it(tiny, monkeypatch):
    from optc.core.errors import InputError, UserError
    from optc.passes.fuse_gate_up import FuseGateUp

    def user_error(self, graph, store, ctx):
        raise InputError("synthetic bad option")

    monkeypatch.setattr(FuseGateUp, "run", user_error)
    pm = PassManager([("cast", {}), ("fuse_qkv", {}), ("fuse_gate_up", {})])
    where = r"pass 'fuse_gate_up' \(#3 of 3; passes before it: cast, fuse_qkv\) failed"
    with pytest.raises(PassError, match=where + ": synthetic bad option") as caught:
        pm.run(tiny.graph, tiny.store, PassContext())
    assert isinstance(caught.value, UserError)

    def bug(self, graph, store, ctx):
        raise KeyError("synthetic bug")

    monkeypatch.setattr(FuseGateUp, "run", bug)
    with pytest.raises(KeyError, match="synthetic bug") as caught:  # a bug stays a bug, with the pass named
        pm.run(tiny.graph, tiny.store, PassContext())
    assert not isinstance(caught.value, UserError)
    assert any(re.fullmatch(where, note) for note in caught.value.__notes__)


def test_every_pass_is_a_pass_named_after_its_file_and_imports_no_other_pass():
    import ast
    import importlib
    from pathlib import Path

    from optc.frontend.passmanager import Pass, registry

    found = registry()
    files = sorted(Path(importlib.import_module("optc.passes").__path__[0]).glob("*.py"))
    stems = [f.stem for f in files if not f.stem.startswith("_")]
    assert sorted(found) == stems
    for name, cls in found.items():
        assert issubclass(cls, Pass) and cls.name == name and cls.__doc__
        assert isinstance(make_pass(name).options, cls.Options)
    for f in files:  # helpers (passes/_*.py) may be shared; passes are not
        imported = [n.module for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.ImportFrom)]
        others = [m for m in imported if m and m.startswith("optc.passes.") and not m.split(".")[-1].startswith("_")]
        assert not others, f"{f.name} imports {others}"
