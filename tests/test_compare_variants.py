"""optc compare: variant expansion (leave-one-out, add-one, variants file) and validation before any build."""

from pathlib import Path

import pytest

from optc.commands.compare.variants import Mode, expand
from optc.core.errors import UserError
from optc.frontend.recipe import load_recipe

RECIPE = """\
model: random:tiny
dtype: float32
passes:
  - fuse_qkv
  - fuse_gate_up
  - quantize_rtn: {bits: 8}
"""


@pytest.fixture
def base(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    return load_recipe(path)


def _passes(variant) -> list[str]:
    return [p.name for p in variant.recipe.passes]


def test_leave_one_out_drops_each_pass_once(base):
    e = expand(base, Mode.LEAVE_ONE_OUT)
    assert e.baseline == "base"
    assert [v.name for v in e.variants] == ["base", "-fuse_qkv", "-fuse_gate_up", "-quantize_rtn"]
    assert [_passes(v) for v in e.variants] == [
        ["fuse_qkv", "fuse_gate_up", "quantize_rtn"], ["fuse_gate_up", "quantize_rtn"],
        ["fuse_qkv", "quantize_rtn"], ["fuse_qkv", "fuse_gate_up"]]
    assert [v.pass_name for v in e.variants] == [None, "fuse_qkv", "fuse_gate_up", "quantize_rtn"]
    assert e.variants[3].recipe.passes[1].options == base.passes[1].options
    assert e.skipped == ()


def test_add_one_adds_each_pass_to_the_bare_recipe(base):
    e = expand(base, Mode.ADD_ONE)
    assert e.baseline == "bare"
    assert [v.name for v in e.variants] == ["bare", "+fuse_qkv", "+fuse_gate_up", "+quantize_rtn", "full"]
    assert [_passes(v) for v in e.variants] == [[], ["fuse_qkv"], ["fuse_gate_up"], ["quantize_rtn"],
                                                ["fuse_qkv", "fuse_gate_up", "quantize_rtn"]]
    assert e.variants[3].recipe.passes[0].options["bits"] == 8  # the recipe's options, not the defaults


def test_variants_file_drop_add_set(base, tmp_path):
    f = tmp_path / "v.yaml"
    f.write_text("""\
int4:
  - drop: quantize_rtn
  - add: {quantize_rtn: {bits: 4, group_size: 32}}
    after: fuse_qkv
f16: [{set: {dtype: float16, runtime.max_num_seqs: 4}}]
first: [{add: kv_layout, before: fuse_qkv}]
""")
    e = expand(base, Mode.FILE, f)
    assert [v.name for v in e.variants] == ["base", "int4", "f16", "first"]
    int4, f16, first = e.variants[1:]
    assert _passes(int4) == ["fuse_qkv", "quantize_rtn", "fuse_gate_up"]
    assert int4.recipe.passes[1].options["bits"] == 4 and int4.recipe.passes[1].options["group_size"] == 32
    assert f16.recipe.dtype == "float16" and f16.recipe.runtime.max_num_seqs == 4
    assert _passes(f16) == _passes(e.variants[0])
    assert _passes(first) == ["kv_layout", "fuse_qkv", "fuse_gate_up", "quantize_rtn"]
    assert int4.edits[0] == "drop: quantize_rtn"


def test_dropping_a_cast_the_build_reinserts_is_skipped_with_the_reason(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: random:tiny\ndtype: float32\npasses: [cast, fuse_qkv]\n")
    e = expand(load_recipe(path), Mode.LEAVE_ONE_OUT)
    assert [v.name for v in e.variants] == ["base", "-fuse_qkv"]
    (skip,) = e.skipped
    assert skip.name == "-cast" and "same artifact as 'base'" in skip.reason and "float32" in skip.reason


def test_identical_variants_in_a_file_are_skipped(base, tmp_path):
    f = tmp_path / "v.yaml"
    f.write_text("a: [{set: {dtype: float32}}]\n")  # already float32: the base again
    e = expand(base, Mode.FILE, f)
    assert [v.name for v in e.variants] == ["base"] and e.skipped[0].name == "a"


@pytest.mark.parametrize("text, message", [
    ("bad: [{drop: fuse_rope_kv}]", "variant 'bad', edit 1 (drop: fuse_rope_kv): cannot drop 'fuse_rope_kv'"),
    ("bad: [{add: no_such_pass}]", "variant 'bad', edit 1 (add: no_such_pass): passes[0]: unknown pass"),
    ("bad: [{add: {quantize_gptq: {bits: 3}}}]", "variant 'bad', edit 1"),
    ("bad: [{add: fuse_qkv}]", "cannot add 'fuse_qkv': the recipe already runs it"),
    ("bad: [{add: kv_layout, after: nope}]", "'nope' is not among the passes"),
    ("bad: [{set: {runtime.nope: 1}}]", "variant 'bad'"),
    ("bad: [{set: {dtype: int3}}]", "variant 'bad' (set: {\"dtype\": \"int3\"}): dtype"),
    ("bad: [{set: {passes: []}}]", "passes are edited with drop/add"),
    ("bad: [{rename: x}]", "an edit is {drop: PASS}"),
    ("bad: [{drop: fuse_qkv, extra: 1}]", "unexpected key(s) 'extra'"),
    ("bad: []", "variant 'bad': expected a non-empty list of edits"),
    ("base: [{drop: fuse_qkv}]", "variant names must be unique"),
    ("- a\n- b", "expected a mapping of variant name"),
])
def test_invalid_variants_name_the_variant_and_the_edit(base, tmp_path, text, message):
    f = tmp_path / "v.yaml"
    f.write_text(text + "\n")
    with pytest.raises(UserError) as e:
        expand(base, Mode.FILE, f)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_a_bad_variant_stops_the_comparison_before_any_build(base, tmp_path, monkeypatch):
    import optc.frontend.build
    from optc.commands.compare import CompareOptions, run_compare

    monkeypatch.setattr(optc.frontend.build, "build", lambda *a, **k: pytest.fail("built before validating"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    f = tmp_path / "v.yaml"
    f.write_text("good: [{drop: fuse_qkv}]\nbad: [{add: {quantize_rtn: {bits: 5}}}]\n")
    with pytest.raises(UserError, match="variant 'bad'"):
        run_compare(CompareOptions(recipe, Mode.FILE, f, out=tmp_path / "out", cache_dir=tmp_path / "c"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "c").exists()


def test_missing_variants_file(base):
    with pytest.raises(UserError, match="variants file nope.yaml does not exist"):
        expand(base, Mode.FILE, Path("nope.yaml"))


def test_kv_cache_dtype_variants(base, tmp_path):
    # the KV format is a kv_layout option: a variant adds the pass with it; a bad dtype names what is allowed
    path = tmp_path / "v.yaml"
    path.write_text("int8-kv: [{add: {kv_layout: {dtype: int8}}}]\nfp8-kv: [{add: {kv_layout: {dtype: fp8_e4m3}}}]\n")
    e = expand(base, Mode.FILE, path)
    assert [(v.name, v.recipe.passes[-1].name, v.recipe.passes[-1].options["dtype"]) for v in e.variants[1:]] == [
        ("int8-kv", "kv_layout", "int8"), ("fp8-kv", "kv_layout", "fp8_e4m3")]
    path.write_text("int4-kv: [{add: {kv_layout: {dtype: int4}}}]\n")
    with pytest.raises(UserError, match="int4.*int8, fp8_e4m3"):
        expand(base, Mode.FILE, path)
