"""IR: JSON round trip, verify, text dump."""

from __future__ import annotations

import json

import pytest

from optc.core.ir import REFERENCE_KERNEL, Graph, Node
from optc.core.ops import VerifyError, verify
from optc.frontend.sources import load_source


@pytest.fixture()
def tiny():
    return load_source("random:tiny")


def test_json_round_trip_is_exact(tiny):
    text = tiny.graph.dumps()
    again = Graph.from_json(json.loads(text))
    assert again.dumps() == text
    assert again.config == tiny.graph.config and again.tensors == tiny.graph.tensors


def test_config_dtype_is_recorded_and_read_back(tiny):
    assert tiny.graph.config.dtype == "float32" and tiny.graph.to_json()["config"]["dtype"] == "float32"
    d = json.loads(tiny.graph.dumps())
    d["config"]["dtype"] = "bfloat16"
    assert Graph.from_json(d).config.dtype == "bfloat16"


def test_node_kernel_is_the_attr_or_the_reference():
    node = Node("n", "rms_norm", ["x"], ["y"], {"eps": 1e-5})
    assert node.kernel == REFERENCE_KERNEL == "torch"
    node.attrs["kernel"] = "triton.rms_norm"
    assert node.kernel == "triton.rms_norm"


def test_text_dump_is_one_line_per_node(tiny):
    lines = tiny.graph.text().splitlines()
    assert lines[0] == "graph(input_ids, positions) -> logits"
    assert len(lines) == 1 + len(tiny.graph.nodes)
    assert "model.layers.0.attn = attention(model.layers.0.q_rot, model.layers.0.k_rot, " in tiny.graph.text()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda g: g.nodes.insert(0, g.nodes.pop(2)), "used before it is defined"),
        (lambda g: g.nodes.insert(2, Node("dup", "add", ["h.0", "h.0"], ["h.0"])), "defined twice"),
        (lambda g: g.nodes.append(Node("x", "gelu", ["h.0"], ["y"])), "unknown op"),
        (lambda g: g.nodes[1].attrs.pop("eps"), "missing attrs"),
        (lambda g: g.nodes[2].attrs.update(out_features=65), "has shape"),
        (lambda g: g.nodes[-1].params.update(weight="nope"), "not in the tensor table"),
        (lambda g: g.nodes.pop(), "graph output 'logits' is never produced"),
    ],
    ids=["order", "twice", "op", "attrs", "shape", "param", "output"],
)
def test_verify_rejects(tiny, edit, message):
    g = tiny.graph.copy()
    edit(g)
    with pytest.raises(VerifyError, match=message):
        verify(g, tiny.store)


def test_verify_checks_stored_parts(tiny):
    verify(tiny.graph, tiny.store)
    store = tiny.store.with_entries(remove=["model.norm.weight"])
    with pytest.raises(VerifyError, match="'model.norm.weight'.*missing"):
        verify(tiny.graph, store)
