"""Float adapters over quantized bases (random:tiny): int8 and int4 RTN and AWQ artifacts keep their linears' quantized
kernels and add the adapter's float delta from the layer input. The adapter rows' logits equal the same artifact's
run through the op references (dequantized matmuls) with the same deltas, and lie near dense base + peft."""

import pytest
import torch

from optc.core.artifact import read
from optc.core.ir import REFERENCE_KERNEL
from optc.core.lora import load_adapter
from optc.runtime.batch import ForwardBatch
from optc.runtime.loader import load_model
from optc.testing import build_artifact, random_peft_adapter, tiny_hf_model

peft = pytest.importorskip("peft")
PROMPT = [5, 9, 13, 200, 3, 77, 41, 8]
QUANT = {  # name -> (dtype, quantization pass); select_kernels binds each format's CPU kernel
    "int8": ("float32", "{quantize_rtn: {bits: 8}}"),
    "int4": ("bfloat16", "{quantize_rtn: {bits: 4, group_size: 32, zero_point: true}}"),
    "awq4": ("bfloat16", "{quantize_awq: {bits: 4, group_size: 32, zero_point: true}}"),
}


def adapter_logits(model, adapter, slot_rows: list[int]) -> torch.Tensor:
    """Every position's logits of PROMPT twice in one batch: the first copy under slot_rows[0], the second [1]."""
    slots = model.enable_lora(1, 8)
    slots.load(adapter, 0)
    caches = model.allocate_kv_caches(4, 16)
    batch = ForwardBatch.build([PROMPT, PROMPT], [0, 0], [[1], [2]], 16, [len(PROMPT)] * 2, lora_slots=slot_rows)
    return model.forward(batch, caches).view(2, len(PROMPT), -1)


@pytest.mark.parametrize("name", list(QUANT))
def test_quantized_base_serves_a_float_adapter(name, tmp_path):
    dtype, quant = QUANT[name]
    recipe = tmp_path / "q.yaml"
    calibration = "calibration: {samples: 4, seq_len: 32}\n" if "awq" in quant else ""
    recipe.write_text(f"model: random:tiny\ndtype: {dtype}\ntarget: cpu\n{calibration}"
                      f"passes: [fuse_qkv, fuse_gate_up, {quant}, {{select_kernels: {{measure: false}}}}]\n")
    artifact = build_artifact(tmp_path / "a", recipe)
    folder = random_peft_adapter(tmp_path / "ad", 8, 16, ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    art = read(artifact)
    adapter = load_adapter(folder, art.graph)
    model = load_model(art, "cpu")
    bound = {n.kernel for n in model.graph.nodes if n.op == "linear"}
    assert bound - {REFERENCE_KERNEL}, f"no quantized kernel bound: {bound}"
    got = adapter_logits(model, adapter, [0, -1])
    refs = adapter_logits(load_model(read(artifact), "cpu", use_references=True), adapter, [0, -1])
    tol = 1e-4 if dtype == "float32" else 0.1
    torch.testing.assert_close(got, refs, rtol=tol, atol=tol)
    # the adapter rows differ from the base rows of the same batch, and sit near dense base + peft
    assert (got[0] - got[1]).abs().max() > 0.1
    hf = peft.PeftModel.from_pretrained(tiny_hf_model(), folder).eval()
    with torch.no_grad():
        dense = hf(torch.tensor([PROMPT])).logits[0].float()
    kl = torch.nn.functional.kl_div(got[0].float().log_softmax(-1), dense.log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    assert kl < 0.05, f"KL(dense + peft || {name} + adapter) = {kl:.4f}"
