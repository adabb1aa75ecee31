"""The importer of pre-quantized checkpoints (`load_source` of a HF folder whose config has
`quantization_config`): AutoAWQ GEMM (a real AutoAWQ fixture) and GPTQ (a checkpoint packed in the
test exactly as AutoGPTQ's QuantLinear.pack does, written as a one-layer HF folder)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from optc.core.formats import dequantize, part_name, unpack_int4
from optc.frontend.models import config_from_hf, param_shapes
from optc.frontend.sources import SourceError, load_source

AWQ = "tiny-llama-awq-gemm"


def _parts(source, name: str) -> dict[str, torch.Tensor]:
    """The stored parts of logical tensor `name` of a loaded source."""
    info = source.graph.tensors[name]
    return {r: source.store.get(part_name(name, r, info.format)) for r in info.format.part_shapes(info.shape)}


# --- AutoAWQ's published dequantization (awq/utils/packing_utils.py), written out independently ---
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def _awq_unpack(qweight, qzeros):
    shifts = torch.arange(0, 32, 4)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    return iweights.view(iweights.shape[0], -1), izeros.view(izeros.shape[0], -1)


def _awq_reverse_order(iweights, izeros):
    order = torch.arange(iweights.shape[-1], dtype=torch.int32).view(-1, 8)[:, AWQ_REVERSE_ORDER].view(-1)
    return iweights[:, order], izeros[:, order]


def _awq_dequantize_gemm(qweight, qzeros, scales, group_size):
    iweight, izeros = _awq_reverse_order(*_awq_unpack(qweight, qzeros))
    iweight, izeros = torch.bitwise_and(iweight, 15), torch.bitwise_and(izeros, 15)
    scales = scales.float().repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    return ((iweight - izeros) * scales).T  # (K, N) -> (N, K)


def test_awq_gemm_fixture_matches_autoawq_formula(shared_fixture):
    awq_dir = shared_fixture(AWQ)
    tensors = load_file(awq_dir / "model.safetensors")
    source = load_source(str(awq_dir))
    quantized = {t: i for t, i in source.graph.tensors.items() if i.format.is_quantized}
    assert source.quantization["method"] == "awq"
    assert len(quantized) == 2 * 7
    assert not source.graph.tensors["lm_head.weight"].format.is_quantized
    assert not any(t.endswith((".qweight", ".qzeros")) for t in source.graph.tensors)
    for name, info in quantized.items():
        base = name[: -len(".weight")]
        expected = _awq_dequantize_gemm(tensors[f"{base}.qweight"], tensors[f"{base}.qzeros"],
                                        tensors[f"{base}.scales"], 64)
        fmt = info.format
        assert fmt.zero_point and fmt.group_size == 64 and fmt.dtype == "float16"
        assert torch.equal(dequantize(_parts(source, name), fmt, torch.float32), expected), name


def test_awq_gemm_fixture_logits(shared_fixture):
    from transformers import LlamaConfig, LlamaForCausalLM

    awq_dir = shared_fixture(AWQ)
    config = json.loads((awq_dir / "config.json").read_text())
    source = load_source(str(awq_dir))
    state = {t: dequantize(_parts(source, t), i.format, torch.float32) if i.format.is_quantized
             else source.store.get(t).float() for t, i in source.graph.tensors.items()}
    hf_config = {k: v for k, v in config.items() if k != "quantization_config"}
    model = LlamaForCausalLM(LlamaConfig(**{**hf_config, "dtype": "float32"})).eval()
    model.load_state_dict(state, strict=True)
    expected = load_file(awq_dir / "expected_logits.safetensors")
    with torch.no_grad():
        logits = model(expected["input_ids"]).logits
    rel = (logits - expected["logits"]).norm() / expected["logits"].norm()
    assert rel < 2e-3, f"relative error {rel:.2e}"


# --- GPTQ, packed as AutoGPTQ's QuantLinear.pack does ---
def _gptq_pack(intweight_nk, zeros_gn, bits=4, v1=True):
    """intweight (N, K) ints, zeros (K/G, N) ints -> qweight (K/8, N), qzeros (K/G, N/8) int32."""
    intweight = intweight_nk.T.contiguous().to(torch.int64)  # (K, N)
    qweight = torch.zeros(intweight.shape[0] // 32 * bits, intweight.shape[1], dtype=torch.int64)
    i, row = 0, 0
    while row < qweight.shape[0]:
        for j in range(i, i + 32 // bits):
            qweight[row] |= intweight[j] << (bits * (j - i))
        i += 32 // bits
        row += 1
    zeros = (zeros_gn.to(torch.int64) - (1 if v1 else 0)) & 0xFFFFFFFF  # numpy uint32 arithmetic
    qzeros = torch.zeros(zeros.shape[0], zeros.shape[1] // 32 * bits, dtype=torch.int64)
    i, col = 0, 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 32 // bits):
            qzeros[:, col] |= zeros[:, j] << (bits * (j - i))
        i += 32 // bits
        col += 1
    as_int32 = lambda t: torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)  # .astype(np.int32)
    return as_int32(qweight & 0xFFFFFFFF), as_int32(qzeros & 0xFFFFFFFF)


def _gptq_case(n=64, k=256, g=64, sym=True, desc_act=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.full((k // g, n), 8) if sym else torch.randint(1, 16, (k // g, n), generator=gen)
    scales = (torch.rand(k // g, n, generator=gen) * 0.01 + 1e-3).half()
    g_idx = torch.arange(k) // g
    if desc_act:  # AutoGPTQ: g_idx[perm[i]] = i // g for the act-order permutation perm
        perm = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // g
    expected = (q - zeros.T[:, g_idx]) * scales.float().T[:, g_idx]  # (N, K)
    return q, zeros, scales, g_idx.to(torch.int32), expected


GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True,
               "checkpoint_format": "gptq"}
Q = "model.layers.0.self_attn.q_proj"  # (64, 256): the linear the GPTQ cases pack


def _gptq_folder(path, qweight, qzeros, scales, g_idx, **quantization_config):
    """A one-layer Llama HF folder (hidden 256, q/k/v bias) whose q_proj is GPTQ-packed; the rest dense fp32."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "vocab_size": 32, "attention_bias": True, "quantization_config": {**GPTQ_CONFIG, **quantization_config}}
    gen = torch.Generator().manual_seed(0)
    shapes = param_shapes(config_from_hf(cfg, "test"))
    shapes.update({f"model.layers.0.self_attn.{p}_proj.bias": (n,) for p, n in (("q", 64), ("k", 32), ("v", 32))})
    tensors = {n: torch.randn(s, generator=gen) for n, s in shapes.items() if n != f"{Q}.weight"}
    tensors.update({f"{Q}.qweight": qweight, f"{Q}.qzeros": qzeros, f"{Q}.scales": scales, f"{Q}.g_idx": g_idx})
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("v1", [True, False])
def test_gptq_import_recovers_the_integers(tmp_path, sym, desc_act, v1):
    q, zeros, scales, g_idx, expected = _gptq_case(sym=sym, desc_act=desc_act)
    qweight, qzeros = _gptq_pack(q, zeros, v1=v1)
    source = load_source(_gptq_folder(tmp_path, qweight, qzeros, scales, g_idx, desc_act=desc_act, sym=sym,
                                      checkpoint_format="gptq" if v1 else "gptq_v2"))
    fmt, parts = source.graph.tensors[f"{Q}.weight"].format, _parts(source, f"{Q}.weight")
    assert fmt.zero_point == (not sym) and fmt.act_order == desc_act
    assert torch.equal(dequantize(parts, fmt, torch.float32), expected)
    stored = unpack_int4(parts["qweight"]).long()
    perm = parts["perm"].long() if desc_act else torch.arange(256)
    assert torch.equal(stored, q[:, perm])  # the integers themselves, never requantized
    if desc_act:  # groups are contiguous in the stored order
        assert torch.equal(g_idx.long()[perm], torch.arange(256) // 64)


def test_import_quantized_gptq_config_and_errors(tmp_path):
    q, zeros, scales, g_idx, expected = _gptq_case(sym=True)
    qweight, qzeros = _gptq_pack(q, zeros)
    source = load_source(_gptq_folder(tmp_path / "ok", qweight, qzeros, scales, g_idx))
    assert source.quantization == {"method": "gptq", "imported": True, "bits": 4, "group_size": 64, "linears": 1,
                                   "checkpoint_format": "gptq"}
    dense = sorted(t for t, i in source.graph.tensors.items() if not i.format.is_quantized)
    assert f"{Q}.bias" in dense and "model.norm.weight" in dense and len(dense) == len(source.graph.tensors) - 1
    assert not any(t.endswith((".qweight", ".qzeros", ".g_idx")) for t in source.graph.tensors)
    fmt = source.graph.tensors[f"{Q}.weight"].format
    assert not fmt.zero_point and torch.equal(dequantize(_parts(source, f"{Q}.weight"), fmt, torch.float32), expected)
    with pytest.raises(SourceError, match="bits=3: only 4-bit"):
        load_source(_gptq_folder(tmp_path / "bits", qweight, qzeros, scales, g_idx, bits=3))
    with pytest.raises(SourceError, match="checkpoint_format 'marlin' is not supported"):
        load_source(_gptq_folder(tmp_path / "marlin", qweight, qzeros, scales, g_idx, checkpoint_format="marlin"))
    with pytest.raises(SourceError, match="quant_method 'bitsandbytes' is not supported"):
        load_source(_gptq_folder(tmp_path / "bnb", qweight, qzeros, scales, g_idx, quant_method="bitsandbytes"))
    with pytest.raises(SourceError, match=r"q_proj.qweight: shape \[16, 64\], expected \[32, 64\]"):
        load_source(_gptq_folder(tmp_path / "short", qweight[:16], qzeros, scales, g_idx))


def test_gptq_v1_zero_point_of_zero_is_an_error(tmp_path):
    q, zeros, scales, g_idx, _ = _gptq_case(sym=False)
    zeros[0, 0] = 0  # stored as -1: the v1 format cannot hold it
    qweight, qzeros = _gptq_pack(q, zeros, v1=True)
    with pytest.raises(SourceError, match="q_proj: a GPTQ v1 zero point of 0"):
        load_source(_gptq_folder(tmp_path, qweight, qzeros, scales, g_idx, sym=False))


def test_sources_import_the_awq_fixture_and_match_autoawq_logits(shared_fixture):
    from optc.core.execute import Executor, bind_params, run_dense
    from optc.core.ops import verify
    from optc.frontend.passmanager import PassContext
    from optc.passes.cast import Cast

    awq_dir = shared_fixture(AWQ)
    source = load_source(str(awq_dir))
    assert source.quantization["method"] == "awq" and source.quantization["linears"] == 14
    info = source.graph.tensors["model.layers.1.mlp.down_proj.weight"]
    assert info.shape == (128, 256) and info.format.kind.value == "int4_g" and info.format.zero_point
    verify(source.graph, source.store)
    cast = Cast(Cast.Options("float32")).run(source.graph, source.store, PassContext())
    expected = load_file(awq_dir / "expected_logits.safetensors")
    executor = Executor(cast.graph, bind_params(cast.graph, cast.store))
    logits = run_dense(executor, expected["input_ids"])
    rel = (logits - expected["logits"]).norm() / expected["logits"].norm()
    assert rel < 2e-3, f"relative error {rel:.2e}"
