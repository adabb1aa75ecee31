"""int4_g packed n8_tiles and its CUDA kernels (triton.w4a16_decode / triton.w4a16_prefill), on the CPU:
the packing against k8_lsb bit for bit (and the reference reading it), the kernels against the op's
reference under TRITON_INTERPRET=1, the per-M table (the build's default, its refinement by a fake timer
and its cache), and a tiny artifact built with the packing. The `gpu` tests run the kernels compiled.
"""

import json

import pytest
import torch

from optc.core.formats import (
    Format,
    FormatKind,
    dequantize,
    k8_parts,
    linear_ref,
    pack_int4,
    tile_int4,
    tiles_format,
    untile_int4,
)
from optc.frontend.passmanager import PassContext, make_pass
from optc.kernels import w4a16_tiles
from optc.kernels.choose_cuda import CUDA_M_BUCKETS, cached_choices, default_by_m, refine
from optc.testing import assert_close

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _k8(n, k, group, zero_point, dtype="bfloat16", seed=0):
    g = torch.Generator().manual_seed(seed)
    fmt = Format(FormatKind.INT4_G, dtype=dtype, bits=4, group_size=group, zero_point=zero_point, packing="k8_lsb")
    parts = {"qweight": pack_int4(torch.randint(0, 16, (n, k), generator=g)),
             "scales": (torch.rand(n, k // group, generator=g) * 0.02 + 0.005).to(DTYPES[dtype])}
    if zero_point:
        parts["zeros"] = torch.randint(0, 16, (n, k // group), generator=g).to(torch.uint8)
    return parts, fmt


def _tiled(n, k, group, zero_point, dtype="bfloat16", seed=0):
    parts, fmt = _k8(n, k, group, zero_point, dtype, seed)
    return parts, fmt, tile_int4(parts, tiles_format(fmt)), tiles_format(fmt)


def _bits(parts):
    return {r: t.view(torch.int16) if t.is_floating_point() else t for r, t in parts.items()}


# --- the packing --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_tiles_round_trip_bit_exact_and_the_reference_reads_them(dtype, zero_point, group):
    parts, fmt, tiled, tfmt = _tiled(24, 256, group, zero_point, dtype)
    parts["scales"] = -parts["scales"]  # sign bits set: the 16-bit patterns survive the int32 words
    tiled = tile_int4(parts, tfmt)
    assert tfmt.packing == "n8_tiles" and tfmt.label == f"int4_g/g{group}/n8_tiles"
    assert tiled["qtiles"].shape == tfmt.part_shapes((24, 256))["qtiles"][0] == (3, 256 // group, group + 8)
    back = untile_int4(tiled["qtiles"], tfmt)
    assert back.keys() == parts.keys() and all(torch.equal(_bits(back)[r], _bits(parts)[r]) for r in parts)
    assert torch.equal(dequantize(tiled, tfmt), dequantize(parts, fmt))
    x = torch.randn(3, 256).to(DTYPES[dtype])
    assert torch.equal(linear_ref(x, tiled, tfmt), linear_ref(x, parts, fmt))


def test_tiles_layout_word_by_word():
    # chunk (t, g): words [0, G) are rows 8t..8t+7's k8_lsb words of group g, row r at r G/8; words G + r
    # hold row r's scale bits (0-15) and zero point (16-23; 8 when symmetric)
    group = 32
    for zero_point in (False, True):
        parts, fmt, tiled, _ = _tiled(16, 128, group, zero_point, "float16")
        qt, qw = tiled["qtiles"], parts["qweight"]
        for t, g, r in ((0, 0, 0), (1, 2, 5), (1, 3, 7)):
            row = 8 * t + r
            assert torch.equal(qt[t, g, r * 4:(r + 1) * 4], qw[row, g * 4:(g + 1) * 4])
            meta = int(qt[t, g, group + r])
            assert meta & 0xFFFF == int(parts["scales"][row, g].view(torch.int16)) & 0xFFFF
            assert meta >> 16 == (int(parts["zeros"][row, g]) if zero_point else 8)
    # docs/FORMATS.md's worked example: bf16 scale 0.01251 (0x3C4D), zero point 9, row 3 of a tile -> word 35
    fmt = Format(FormatKind.INT4_G, dtype="bfloat16", bits=4, group_size=32, zero_point=True, packing="n8_tiles")
    parts = {"qweight": torch.zeros(8, 4, dtype=torch.int32), "scales": torch.full((8, 1), 0.0125).to(torch.bfloat16),
             "zeros": torch.full((8, 1), 9, dtype=torch.uint8)}
    assert int(tile_int4(parts, fmt)["qtiles"][0, 0, 35]) == 0x00093C4D


def test_tiles_format_rules_slices_and_exports():
    parts, fmt, tiled, tfmt = _tiled(32, 256, 64, True)
    for bad in ({"dtype": "float32"}, {"act_order": True}):
        with pytest.raises(ValueError, match="16-bit scales"):
            Format(**{**tfmt.__dict__, **bad})
    with pytest.raises(Exception, match="whole tiles of 8"):
        tfmt.check_shape((36, 256), "w")
    # fused rows split back into their siblings' tiles; tensor-parallel slices are slices of whole tiles/groups
    a, b = tfmt.scheme.split_rows("qtiles", tiled["qtiles"], [8, 24], tfmt)
    assert torch.equal(torch.cat([a, b]), tiled["qtiles"]) and a.shape[0] == 1
    with pytest.raises(ValueError, match="cut a tile"):
        tfmt.scheme.split_rows("qtiles", tiled["qtiles"], [12, 20], tfmt)
    rows = tfmt.part_slices((32, 256), 0, ((8, 24),))
    cols = tfmt.part_slices((32, 256), 1, ((128, 256),))
    assert rows == {"qtiles": (0, ((1, 3),))} and cols == {"qtiles": (1, ((2, 4),))}
    sliced = untile_int4(tiled["qtiles"][1:3], tfmt)
    assert torch.equal(sliced["qweight"], parts["qweight"][8:24])
    # exports: compressed-tensors gets k8_lsb's tensors; ONNX refuses by name
    assert all(torch.equal(x, y) for x, y in zip(tfmt.scheme.to_compressed_tensors(tiled, tfmt, (32, 256)).values(),
                                                    fmt.scheme.to_compressed_tensors(parts, fmt, (32, 256)).values(),
                                                    strict=True))
    assert "n8_tiles" in tfmt.scheme.export_refusal(tfmt, "ort") and tfmt.scheme.export_refusal(tfmt, "hf") is None
    assert k8_parts(parts, fmt) is parts


def test_magic_numbers_are_exact():
    # the dot path's 16-bit dequantization: (MAGIC | q) is 1024 + q (fp16) / 128 + q (bf16); minus the same for z
    # is q - z exactly, so (v - z) * s rounds once, as the reference's fp32 (q - z) * s cast to the dtype
    q = torch.arange(16, dtype=torch.int16)
    for dtype, magic, base in ((torch.float16, 0x6400, 1024), (torch.bfloat16, 0x4300, 128)):
        v = (q | magic).view(dtype)
        assert torch.equal(v.float(), base + q.float())
        s = (torch.rand(16, 16) * 0.05).to(dtype)
        w = (v[:, None] - v[None, :]) * s  # every (q, z) pair
        assert torch.equal(w, ((q[:, None] - q[None, :]).float() * s.float()).to(dtype))


# --- the kernels under the interpreter ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_kernels_match_the_reference(dtype, group):
    # N = 72: 9 tiles of 8, ragged for every BLOCK_N; M = 1 (FMA path), 3 and 16 (16-row dot tiles), 64 (GEMM)
    parts, fmt, tiled, tfmt = _tiled(72, 256, group, group != 64, dtype)
    bias = torch.randn(72, generator=torch.Generator().manual_seed(2)).to(DTYPES[dtype])
    for m in (1, 3, 16, 64):
        x = (torch.randn(m, 256, generator=torch.Generator().manual_seed(m)) * 0.5).to(DTYPES[dtype])
        ref = linear_ref(x, parts, fmt, bias)
        exact = x.double() @ dequantize(parts, fmt, torch.float64).T + bias.double()  # unrounded weights
        for launch in (w4a16_tiles.w4a16_decode_linear, w4a16_tiles.w4a16_prefill_linear):
            out = launch(x, tiled, tfmt, bias)
            assert out.dtype == x.dtype and out.shape == (m, 72)
            if m == 1 and launch is w4a16_tiles.w4a16_decode_linear:  # fp32 FMA on the exact weights
                assert_close(out, exact, rtol=2 ** -7 if dtype == "bfloat16" else 2 ** -10, what=f"M={m}")
            else:  # the reference's weights, bit for bit: fp32 sums in another order, one rounding
                assert_close(out, ref, rtol=2 ** -7 if dtype == "bfloat16" else 2 ** -10, what=f"M={m}")


@pytest.mark.parametrize("launcher,tuner,configs", [
    ("w4a16_decode_linear", "_M1", w4a16_tiles.M1_CONFIGS), ("w4a16_decode_linear", "_DECODE",
                                                              w4a16_tiles.DECODE_CONFIGS),
    ("w4a16_prefill_linear", "_PREFILL", w4a16_tiles.PREFILL_CONFIGS)])
def test_every_autotune_config_matches_the_reference(monkeypatch, launcher, tuner, configs):
    # K = 288: 9 groups of 32, so every K step (128 to 1,024 values) ends past K (masked)
    parts, fmt, tiled, tfmt = _tiled(40, 288, 32, True, "float16")
    m = 1 if tuner == "_M1" else 5
    x = torch.randn(m, 288, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    ref = linear_ref(x, parts, fmt)
    for config in configs:
        monkeypatch.setattr(getattr(w4a16_tiles, tuner), "configs", [config])
        getattr(w4a16_tiles, tuner).cache.clear()
        assert_close(getattr(w4a16_tiles, launcher)(x, tiled, tfmt), ref, rtol=2 ** -9, what=str(config))


# --- the per-M table ----------------------------------------------------------------------------------------

def test_default_table():
    assert default_by_m(["triton.w4a16_decode", "triton.w4a16_prefill"]) == [
        [16, "triton.w4a16_decode"], [None, "triton.w4a16_prefill"]]
    assert default_by_m(["torch.int4pack", "triton.w4a16"]) == [[16, "torch.int4pack"], [None, "triton.w4a16"]]
    assert default_by_m(["torch.int4pack", "triton.w4a16_decode", "triton.w4a16_prefill"])[0][1] == "torch.int4pack"
    assert default_by_m(["triton.w4a16"]) == [[None, "triton.w4a16"]]


def _tiny_int4(dtype="bfloat16"):
    from optc.frontend.sources import load_source

    src = load_source("random:tiny")
    ctx = PassContext(target="cuda", dtype=dtype)
    graph, store = src.graph, src.store
    for name, options in (("cast", {"dtype": dtype}), ("quantize_rtn", {"bits": 4, "group_size": 32}),
                          ("fuse_qkv", {}), ("fuse_gate_up", {})):
        r = make_pass(name, options).run(graph, store, ctx)
        graph, store = r.graph, r.store
    return graph, store, ctx


def test_select_kernels_lays_out_tiles_and_records_the_default_table():
    graph, store, ctx = _tiny_int4()
    k8 = make_pass("select_kernels").run(graph, store, ctx)  # the default packing: k8_lsb, triton.w4a16
    assert {n.kernel for n in k8.graph.nodes if n.op == "linear"} == {"triton.w4a16"}
    assert not any("kernel_candidates" in n.attrs for n in k8.graph.nodes)
    r = make_pass("select_kernels", {"int4_packing": "n8_tiles"}).run(graph, store, ctx)
    linears = [n for n in r.graph.nodes if n.op == "linear"]
    for n in linears:
        w = r.graph.tensors[n.params["weight"]]
        assert w.format.packing == "n8_tiles" and f"{n.params['weight']}.qtiles" in r.store
        assert n.attrs["kernel_candidates"] == ["triton.w4a16_decode", "triton.w4a16_prefill"]
        assert n.kernel == "triton.w4a16_decode" and n.attrs["kernel_by_m"] == [
            [16, "triton.w4a16_decode"], [None, "triton.w4a16_prefill"]]
        tiled = r.store.get(f"{n.params['weight']}.qtiles")
        k8_parts_ = {role: store.get(f"{n.params['weight']}.{role}") for role in ("qweight", "scales")}
        assert torch.equal(untile_int4(tiled, w.format)["qweight"], k8_parts_["qweight"])
    assert r.stats["int4_layout"] == {"int4_packing": "n8_tiles", "laid_out": len(linears)}
    assert not any(f"{n.params['weight']}.qweight" in r.store for n in linears)
    again = make_pass("select_kernels", {"int4_packing": "n8_tiles"}).run(r.graph, r.store, ctx)
    assert not again.changed and again.graph.to_json() == r.graph.to_json()
    with pytest.raises(Exception, match="for target cuda"):
        make_pass("select_kernels", {"int4_packing": "n8_tiles"}).run(graph, store, PassContext(target="cpu"))
    # float32 scales cannot be tiled: kept k8_lsb, with the reason in the stats
    g32, s32, ctx32 = _tiny_int4("float32")
    r32 = make_pass("select_kernels", {"int4_packing": "n8_tiles"}).run(g32, s32, ctx32)
    assert r32.stats["int4_layout"]["laid_out"] == 0 and "16-bit" in str(r32.stats["int4_layout"]["kept_k8_lsb"])


def _graph_with_candidates():
    graph, store, ctx = _tiny_int4()
    return make_pass("select_kernels", {"int4_packing": "n8_tiles", "enable": ("torch.int4pack",)}).run(
        graph, store, ctx).graph


def test_refine_measures_once_per_shape_and_device_then_reads_the_cache(tmp_path):
    graph = _graph_with_candidates()
    calls = []
    speed = {"torch.int4pack": 1.0, "triton.w4a16_decode": 2.0, "triton.w4a16_prefill": 3.0}

    def fake(spec, shape, m):  # decode fastest up to 4 rows, tinygemm at 16, the GEMM from 64 on
        calls.append((spec.name, shape.weight_shape, m))
        rank = {1: ["triton.w4a16_decode"], 4: ["triton.w4a16_decode"], 16: ["torch.int4pack"]}.get(
            m, ["triton.w4a16_prefill"])
        return 1e-6 * (0.5 if spec.name in rank else speed[spec.name])

    refined, report = refine(graph, "Fake GPU", fake, tmp_path)
    shapes = {tuple(graph.tensors[n.params["weight"]].shape) for n in graph.nodes if "kernel_candidates" in n.attrs}
    assert len(calls) == 3 * len(CUDA_M_BUCKETS) * len(shapes)  # every candidate, bucket and distinct shape
    expected = [[4, "triton.w4a16_decode"], [16, "torch.int4pack"], [None, "triton.w4a16_prefill"]]
    for n in refined.nodes:
        if "kernel_candidates" in n.attrs:
            assert n.attrs["kernel_by_m"] == expected and n.kernel == "triton.w4a16_decode"
    assert all(not r["cached"] for r in report.values()) and len(list(tmp_path.glob("*.json"))) == len(shapes)

    def broken(*args):
        raise AssertionError("a cached choice must not be measured again")

    again, report2 = refine(graph, "Fake GPU", broken, tmp_path)
    assert again.to_json() == refined.to_json() and all(r["cached"] for r in report2.values())
    calls.clear()
    refine(graph, "Other GPU", fake, tmp_path)  # another device measures for itself
    assert calls and len(list(tmp_path.glob("*.json"))) == 2 * len(shapes)
    seen = cached_choices(graph, tmp_path)
    assert all(set(devices) == {"Fake GPU", "Other GPU"} for devices in seen.values()) and len(seen) == len(shapes)
    entry = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert entry["by_m"] == expected and set(entry["micros"]) == {str(m) for m in CUDA_M_BUCKETS}


def test_loader_refines_on_cuda_unless_told_not_to(tmp_path, monkeypatch):
    # the runtime's hook (runtime/loader.py) with the device faked: it measures through choose_cuda.time_on_cuda
    import contextlib

    from optc.kernels import choose_cuda
    from optc.runtime.loader import _refine_kernel_choice

    graph = _graph_with_candidates()
    monkeypatch.setenv("OPTC_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(choose_cuda, "time_on_cuda", lambda spec, shape, m: 0.5 if spec.name == "torch.int4pack" else 1)
    monkeypatch.setenv("OPTC_KERNEL_REFINE", "0")
    assert _refine_kernel_choice(graph, "cuda") is graph  # the build's default tables
    monkeypatch.delenv("OPTC_KERNEL_REFINE")
    refined = _refine_kernel_choice(graph, "cuda:0")
    assert {n.kernel for n in refined.nodes if "kernel_candidates" in n.attrs} == {"torch.int4pack"}
    assert not any("kernel_by_m" in n.attrs for n in refined.nodes if "kernel_candidates" in n.attrs)
    assert list((tmp_path / "kernel_choice").glob("*.json"))


def test_inspect_shows_packing_default_table_and_measured_choice(tmp_path, monkeypatch):
    from optc.commands.inspect import render, summarize
    from optc.testing import build_artifact

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: random:tiny\ndtype: bfloat16\ntarget: cuda\npasses: [fuse_qkv, fuse_gate_up, "
                      "{quantize_rtn: {bits: 4, group_size: 32}}, {select_kernels: {int4_packing: n8_tiles}}]\n")
    art = build_artifact(tmp_path / "a", recipe)
    monkeypatch.setenv("OPTC_CACHE", str(tmp_path / "cache"))
    from optc.core.artifact import read

    graph = read(art).graph
    refine(graph, "Fake GPU", lambda spec, shape, m: 1.0 if spec.name.endswith("decode") == (m > 16) else 0.5)
    s = summarize(art)
    text = render(s)
    assert "int4_g/g32/n8_tiles x" in text
    assert "M<=16 triton.w4a16_decode, M>16 triton.w4a16_prefill (default; measured per M at the first load" in text
    assert "measured on Fake GPU: linear" in text and s["kernel_choice_cache"]


# --- a tiny artifact built with the packing --------------------------------------------------------------------

def test_tiny_artifact_with_tiles_reads_as_the_k8_build_and_runs_its_kernels(tmp_path, monkeypatch):
    from optc.core.artifact import read
    from optc.core.execute import Executor, bind_params, run_dense
    from optc.kernels.registry import impls
    from optc.testing import build_artifact

    def build(name, select):
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(f"model: random:tiny\ndtype: bfloat16\ntarget: cuda\npasses: [fuse_qkv, fuse_gate_up, "
                          f"{{quantize_rtn: {{bits: 4, group_size: 32, zero_point: true}}}}, {select}]\n")
        return read(build_artifact(tmp_path / name, recipe))

    tiles = build("tiles", "{select_kernels: {int4_packing: n8_tiles}}")
    k8 = build("k8", "select_kernels")
    packings = {name: {t.format.packing for t in a.graph.tensors.values() if t.format.bits == 4}
                for name, a in (("tiles", tiles), ("k8", k8))}
    assert packings == {"tiles": {"n8_tiles"}, "k8": {"k8_lsb"}}
    names = {n.kernel for n in tiles.graph.nodes} | {k for n in tiles.graph.nodes
                                                     for _, k in n.attrs.get("kernel_by_m", ())}
    assert {"triton.w4a16_decode", "triton.w4a16_prefill"} <= names
    launched = []
    launch = w4a16_tiles._launch
    monkeypatch.setattr(w4a16_tiles, "_launch", lambda x, *a, prefill: launched.append((x.shape[0], prefill))
                        or launch(x, *a, prefill=prefill))
    params = bind_params(tiles.graph, tiles.store)
    for batch, tokens in ((2, 9), (2, 3), (1, 1)):  # 18 rows: the GEMM; 6 and 1: the decode kernel
        ids = torch.randint(0, 256, (batch, tokens), generator=torch.Generator().manual_seed(tokens))
        ref = {name: run_dense(Executor(a.graph, bind_params(a.graph, a.store), use_references=True), ids)
               for name, a in (("tiles", tiles), ("k8", k8))}
        assert torch.equal(ref["tiles"], ref["k8"])  # the reference reads the packing bit for bit
        kernels = run_dense(Executor(tiles.graph, params, impls(names - {"torch"})), ids)
        assert_close(kernels, ref["k8"], rtol=2e-2, what=f"logits {batch}x{tokens}")  # bf16 through every kernel
    assert {(m, prefill) for m, prefill in launched} == {(18, True), (6, False), (1, False)}


def test_quantized_linear_nodes_only():
    # a weight an lm_head reads (rows indexed by the reference) stays k8_lsb, named in the stats
    graph, store, ctx = _tiny_int4()
    r = make_pass("quantize_lm_head", {"bits": 4, "group_size": 32}).run(graph, store, ctx)
    out = make_pass("select_kernels", {"int4_packing": "n8_tiles"}).run(r.graph, r.store, ctx)
    head = next(n for n in out.graph.nodes if n.op == "lm_head")
    assert out.graph.tensors[head.params["weight"]].format.packing == "k8_lsb"
    assert head.params["weight"] in out.stats["int4_layout"]["kept_k8_lsb"]


# --- on a GPU -------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m", [1, 8, 32, 512])
def test_kernels_on_cuda_match_the_reference(monkeypatch, dtype, m):
    monkeypatch.setenv("OPTC_AUTOTUNE", "0")  # the first config per launch shape: formats, not speed
    parts, fmt, tiled, tfmt = _tiled(4096, 4096, 128, True, dtype)
    parts, tiled = ({r: t.cuda() for r, t in p.items()} for p in (parts, tiled))
    x = torch.randn(m, 4096, device="cuda").to(DTYPES[dtype])
    ref = linear_ref(x, parts, fmt)
    for launch in (w4a16_tiles.w4a16_decode_linear, w4a16_tiles.w4a16_prefill_linear):
        assert_close(launch(x, tiled, tfmt), ref, rtol=2e-2 if dtype == "bfloat16" else 4e-3, what=launch.__name__)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_autotune_config_on_cuda(monkeypatch):
    # every config compiled and run at Llama-3-8B's down_proj shape (K = 14336: 112 groups of 128)
    parts, fmt, tiled, tfmt = _tiled(4096, 14336, 128, True, "bfloat16")
    parts, tiled = ({r: t.cuda() for r, t in p.items()} for p in (parts, tiled))
    for launcher, tuner, m in (("w4a16_decode_linear", "_M1", 1), ("w4a16_decode_linear", "_DECODE", 8),
                               ("w4a16_prefill_linear", "_PREFILL", 64)):
        x = torch.randn(m, 14336, device="cuda").to(torch.bfloat16)
        ref = linear_ref(x, parts, fmt)
        for config in getattr(w4a16_tiles, tuner).configs:
            monkeypatch.setattr(getattr(w4a16_tiles, tuner), "configs", [config])
            getattr(w4a16_tiles, tuner).cache.clear()
            assert_close(getattr(w4a16_tiles, launcher)(x, tiled, tfmt), ref, rtol=2e-2, what=str(config))
            monkeypatch.undo()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_refine_on_cuda_times_the_candidates(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTC_AUTOTUNE", "0")  # each candidate's first config: the timing path, not the tuning
    graph = _graph_with_candidates()
    refined, report = refine(graph, torch.cuda.get_device_name(), cache_dir=tmp_path)
    assert report and all(not r["cached"] for r in report.values())
    assert all(t > 0 for r in report.values() for times in r["micros"].values() for t in times.values())
    assert refine(graph, torch.cuda.get_device_name(), cache_dir=tmp_path)[0].to_json() == refined.to_json()

