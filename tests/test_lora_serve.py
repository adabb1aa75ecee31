"""`optc serve --lora NAME=DIR` as a live process on random:tiny: a request's `model` picks the adapter (the served
name the base), concurrent requests for the base and two adapters equal the engine's tokens under each, /v1/models
lists base and adapters, /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies, behind the key), an
unknown adapter is a 404, a bad adapter a 400 naming its file and tensor; `optc run --lora` and a bad --lora at
start (exit 2)."""

import concurrent.futures
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from optc.runtime import Engine, SamplingParams
from optc.testing import random_peft_adapter, serve_process

KEY = "lora-key"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    return {"a": random_peft_adapter(folder / "a", 4, 8, ["q_proj", "v_proj", "down_proj"], seed=1),
            "b": random_peft_adapter(folder / "b", 8, 8, ["o_proj", "gate_proj", "up_proj"], True, seed=2),
            "c": random_peft_adapter(folder / "c", 2, 4, ["k_proj"], seed=3)}


@pytest.fixture(scope="module")
def expected(tiny_artifact, adapters):
    engine = Engine.load(tiny_artifact, max_loras=3, max_lora_rank=8)
    for name, path in adapters.items():
        engine.load_lora(name, path)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    names = [None, "a", "b", "c"]
    return dict(zip(names, [c.text for c in engine.generate([PROMPT] * 4, params, loras=names)], strict=True))


def post(url: str, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


def complete(url: str, model: str) -> httpx.Response:
    return post(url, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                         "ignore_eos": True})


def test_serve_routes_requests_by_adapter(tiny_artifact, adapters, expected, tmp_path):
    args = ["--api-key", KEY, "--served-model-name", "tiny", "--lora", f"a={adapters['a']}",
            "--lora", f"b={adapters['b']}", "--max-loras", "3"]
    with serve_process(tiny_artifact, *args) as (url, _):
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
        assert [m["id"] for m in models] == ["tiny", "a", "b"] and models[1]["parent"] == "tiny"
        with concurrent.futures.ThreadPoolExecutor(6) as pool:  # base and adapters batched together
            jobs = [(m, pool.submit(complete, url, m)) for m in ["tiny", "a", "b"] * 2]
            for model, job in jobs:
                answer = job.result().json()
                assert answer["choices"][0]["text"] == expected[None if model == "tiny" else model], model
                assert answer["model"] == model
        missing = complete(url, "c")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert post(url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["c"])},
                    key=None).status_code == 401
        loaded = post(url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["c"])})
        assert loaded.status_code == 200, loaded.text
        assert complete(url, "c").json()["choices"][0]["text"] == expected["c"]
        full = post(url, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": str(adapters["c"])})
        assert full.status_code == 400 and "all 3 adapter slots are in use" in full.json()["error"]["message"]
        bad = tmp_path / "bad"
        shutil.copytree(adapters["a"], bad)
        config = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 99}))
        assert post(url, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
        refused = post(url, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
        assert refused.status_code == 400
        assert "adapter_config.json: rank 99 is above the maximum rank 8" in refused.json()["error"]["message"]
        assert complete(url, "b").status_code == 404
        assert post(url, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 404
        assert complete(url, "tiny").json()["choices"][0]["text"] == expected[None]


def test_run_with_lora_and_a_bad_lora_at_start(tiny_artifact, adapters, expected, tmp_path):
    optc = str(Path(sys.executable).parent / "optc")
    out = subprocess.run([optc, "run", str(tiny_artifact), "--prompt", PROMPT, "--max-tokens", "10", "--json",
                          "--lora", str(adapters["a"])], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["text"] == expected["a"]  # random:tiny has no end-of-sequence token
    bad = tmp_path / "wrong"
    shutil.copytree(adapters["a"], bad)
    (bad / "adapter_model.safetensors").unlink()
    served = subprocess.run([optc, "serve", str(tiny_artifact), "--port", "0", "--lora", f"w={bad}"],
                            capture_output=True, text=True, timeout=300)
    assert served.returncode == 2
    assert "adapter_model.safetensors: no such file" in served.stderr
