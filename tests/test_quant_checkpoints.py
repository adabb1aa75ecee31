"""Importers for pre-quantized checkpoints: AutoAWQ GEMM (a real AutoAWQ fixture) and GPTQ (a
checkpoint packed in the test exactly as AutoGPTQ's QuantLinear.pack does)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from optc.formats import dequantize, unpack_int4
from optc.quant.checkpoints import import_gptq, import_tensors

FIXTURES = Path("/work/shared/fixtures")
AWQ_DIR = FIXTURES / "tiny-llama-awq-gemm"
needs_fixture = pytest.mark.skipif(not AWQ_DIR.is_dir(), reason="AutoAWQ fixture not present")


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


@needs_fixture
def test_awq_gemm_fixture_matches_autoawq_formula():
    config = json.loads((AWQ_DIR / "config.json").read_text())
    tensors = load_file(AWQ_DIR / "model.safetensors")
    imported = import_tensors(config, tensors)
    assert imported.method == "awq"
    assert len(imported.quantized) == 2 * 7
    assert "lm_head.weight" in imported.dense
    assert "model.layers.0.self_attn.q_proj.qweight" not in imported.dense
    for name, qw in imported.quantized.items():
        base = name[: -len(".weight")]
        expected = _awq_dequantize_gemm(tensors[f"{base}.qweight"], tensors[f"{base}.qzeros"],
                                        tensors[f"{base}.scales"], 64)
        assert qw.fmt.zero_point and qw.fmt.group_size == 64 and qw.fmt.dtype == "float16"
        assert torch.equal(dequantize(qw.parts, qw.fmt, torch.float32), expected), name


@needs_fixture
def test_awq_gemm_fixture_logits():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((AWQ_DIR / "config.json").read_text())
    imported = import_tensors(config, load_file(AWQ_DIR / "model.safetensors"))
    state = {k: v.float() for k, v in imported.dense.items()}
    state.update({k: dequantize(q.parts, q.fmt, torch.float32) for k, q in imported.quantized.items()})
    hf_config = {k: v for k, v in config.items() if k != "quantization_config"}
    model = LlamaForCausalLM(LlamaConfig(**{**hf_config, "dtype": "float32"})).eval()
    model.load_state_dict(state, strict=True)
    expected = load_file(AWQ_DIR / "expected_logits.safetensors")
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


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("v1", [True, False])
def test_gptq_import_recovers_the_integers(sym, desc_act, v1):
    q, zeros, scales, g_idx, expected = _gptq_case(sym=sym, desc_act=desc_act)
    qweight, qzeros = _gptq_pack(q, zeros, v1=v1)
    imported = import_gptq(qweight, qzeros, scales, g_idx, 64, zeros_minus_one=v1, name="l.q")
    assert imported.fmt.zero_point == (not sym) and imported.fmt.act_order == desc_act
    assert torch.equal(dequantize(imported.parts, imported.fmt, torch.float32), expected)
    stored = unpack_int4(imported.parts["qweight"]).long()
    perm = imported.parts["perm"].long() if desc_act else torch.arange(256)
    assert torch.equal(stored, q[:, perm])  # the integers themselves, never requantized
    if desc_act:  # groups are contiguous in the stored order
        assert torch.equal(g_idx.long()[perm], torch.arange(256) // 64)


def test_import_quantized_gptq_config_and_errors():
    q, zeros, scales, g_idx, expected = _gptq_case(sym=True)
    qweight, qzeros = _gptq_pack(q, zeros)
    tensors = {"m.q_proj.qweight": qweight, "m.q_proj.qzeros": qzeros, "m.q_proj.scales": scales,
               "m.q_proj.g_idx": g_idx, "m.q_proj.bias": torch.ones(64), "m.norm.weight": torch.ones(8)}
    config = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False,
                                      "sym": True, "checkpoint_format": "gptq"}}
    imported = import_tensors(config, tensors)
    assert sorted(imported.dense) == ["m.norm.weight", "m.q_proj.bias"]
    qw = imported.quantized["m.q_proj.weight"]
    assert not qw.fmt.zero_point and torch.equal(dequantize(qw.parts, qw.fmt, torch.float32), expected)
    bad = {"quantization_config": {**config["quantization_config"], "bits": 3}}
    with pytest.raises(ValueError, match="bits=3: only 4-bit"):
        import_tensors(bad, tensors)
    bad = {"quantization_config": {**config["quantization_config"], "checkpoint_format": "marlin"}}
    with pytest.raises(ValueError, match="checkpoint_format 'marlin' is not supported"):
        import_tensors(bad, tensors)
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        import_tensors({"quantization_config": {"quant_method": "bitsandbytes"}}, tensors)


def test_gptq_v1_zero_point_of_zero_is_an_error():
    q, zeros, scales, g_idx, _ = _gptq_case(sym=False)
    zeros[0, 0] = 0  # stored as -1: the v1 format cannot hold it
    qweight, qzeros = _gptq_pack(q, zeros, v1=True)
    with pytest.raises(ValueError, match="l.q: a GPTQ v1 zero point of 0"):
        import_gptq(qweight, qzeros, scales, g_idx, 64, zeros_minus_one=True, name="l.q")


@needs_fixture
def test_frontend_imports_the_awq_fixture_and_matches_autoawq_logits():
    from optc.execute import Executor, bind_params, run_dense
    from optc.frontend import load_source
    from optc.ops import verify
    from optc.passes.cast import Cast
    from optc.passmanager import PassContext

    source = load_source(str(AWQ_DIR))
    assert source.quantization["method"] == "awq" and source.quantization["linears"] == 14
    info = source.graph.tensors["model.layers.1.mlp.down_proj.weight"]
    assert info.shape == (128, 256) and info.format.kind.value == "int4_g" and info.format.zero_point
    verify(source.graph, source.store)
    cast = Cast(Cast.Options("float32")).run(source.graph, source.store, PassContext())
    expected = load_file(AWQ_DIR / "expected_logits.safetensors")
    executor = Executor(cast.graph, bind_params(cast.graph, cast.store))
    logits = run_dense(executor, expected["input_ids"])
    rel = (logits - expected["logits"]).norm() / expected["logits"].norm()
    assert rel < 2e-3, f"relative error {rel:.2e}"
