"""`optc serve` at its edges, as a live process of its own: 503 when full, graceful shutdown with
requests in flight (they finish, exit 0), and on SmolLM2 greedy tokens over HTTP equal to
`optc run --json`."""

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from optc.testing import serve_process  # noqa: E402
from tests.test_server import metrics  # noqa: E402


def test_full_server_is_503_and_shutdown_finishes_requests_in_flight(tiny_artifact):
    args = ("--served-model-name", "tiny", "--max-num-seqs", "1", "--max-waiting", "1", "--shutdown-timeout", "60")
    with serve_process(tiny_artifact, *args) as (url, process):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        assert c.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2  # no key

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                # 400 tokens each (>= 0.4 s even on an idle machine): both are still in flight when the third comes
                body = {"model": "tiny", "prompt": "abc", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
                in_flight = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
                while (m := metrics(url))["optc:num_requests_running"] + m["optc:num_requests_waiting"] < 2:
                    await asyncio.sleep(0.05)
                full = await client.post("/v1/completions", json=body)
                process.send_signal(signal.SIGTERM)  # both requests are in flight
                return full, await asyncio.gather(*in_flight)

        full, finished = asyncio.run(run())
        assert full.status_code == 503 and full.json()["error"]["type"] == "service_unavailable"
        assert [r.status_code for r in finished] == [200, 200]
        assert [r.json()["usage"]["completion_tokens"] for r in finished] == [400, 400]
        assert process.wait(30) == 0


@pytest.mark.slow
def test_smollm2_greedy_over_http_equals_optc_run(smollm2_f32_artifact):
    prompt = "The capital of France is"
    run = subprocess.run([str(Path(sys.executable).parent / "optc"), "run", str(smollm2_f32_artifact), "--prompt",
                          prompt, "--max-tokens", "24", "--json"], capture_output=True, text=True, timeout=300)
    expected = json.loads(run.stdout)
    with serve_process(smollm2_f32_artifact, "--served-model-name", "smollm2") as (url, _):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)
        out = c.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0,
                                   extra_body={"return_token_ids": True})
    assert out.choices[0].token_ids == expected["token_ids"]
    assert out.choices[0].text == expected["text"]
    assert out.usage.completion_tokens == expected["completion_tokens"]
