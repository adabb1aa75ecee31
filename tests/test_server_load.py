"""`optc serve` under load and at its edges, as a live process: 50 concurrent streams of which 20
disconnect midway (the rest are exact, nothing is left running or holding KV blocks), 503 when full,
graceful shutdown with requests in flight (they finish, exit 0), the load tester against the server,
and on SmolLM2 greedy tokens over HTTP equal to `optc run --json`."""

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from optc.testing import serve_process  # noqa: E402

PROMPTS = ["one two three", "four five", "six seven eight nine", "ten"]


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def stream(client: httpx.AsyncClient, prompt: str, max_tokens: int, disconnect_after: int | None) -> str | None:
    """The streamed text, or None after closing the connection once `disconnect_after` chunks came."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text, num_chunks = [], 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text.append(json.loads(line[6:])["choices"][0]["text"])
            num_chunks += 1
            if disconnect_after is not None and num_chunks == disconnect_after:
                return None  # leaving the block closes the connection mid-stream
    return "".join(text)


def test_fifty_streams_twenty_disconnect(tiny_artifact):
    with serve_process(tiny_artifact, "--served-model-name", "tiny") as (url, _):
        expected = {p: httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
        }).json()["choices"][0]["text"] for p in PROMPTS}

        async def run():
            limits = httpx.Limits(max_connections=60)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
                return await asyncio.gather(*[
                    stream(client, PROMPTS[i % 4], 40, 3 if i % 5 in (1, 3) else None) for i in range(50)])

        texts = asyncio.run(run())
        assert sum(t is None for t in texts) == 20
        assert all(t == expected[PROMPTS[i % 4]] for i, t in enumerate(texts) if t is not None)
        deadline = time.monotonic() + 20
        while metric(url, "optc:num_requests_running") or metric(url, "optc:kv_cache_usage_perc"):
            assert time.monotonic() < deadline, "requests still running after every client left"
            time.sleep(0.2)
        assert metric(url, "optc:num_requests_waiting") == 0
        assert metric(url, "optc:request_success_total") >= 0
        text = httpx.get(f"{url}/metrics").text
        aborted = [line for line in text.splitlines() if line.startswith("optc:request_success_total")
                   and 'finished_reason="abort"' in line]
        assert float(aborted[0].rsplit(" ", 1)[1]) == 20
        again = httpx.post(f"{url}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0,
                                 "ignore_eos": True})
        assert again.json()["choices"][0]["text"] == expected[PROMPTS[0]]


def test_full_server_is_503_and_shutdown_finishes_requests_in_flight(tiny_artifact):
    args = ("--served-model-name", "tiny", "--max-num-seqs", "1", "--max-waiting", "1", "--shutdown-timeout", "60")
    with serve_process(tiny_artifact, *args) as (url, process):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        assert c.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2  # no key

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                body = {"model": "tiny", "prompt": "abc", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
                in_flight = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
                while metric(url, "optc:num_requests_running") + metric(url, "optc:num_requests_waiting") < 2:
                    await asyncio.sleep(0.05)
                full = await client.post("/v1/completions", json=body)
                process.send_signal(signal.SIGTERM)  # both requests are in flight
                return full, await asyncio.gather(*in_flight)

        full, finished = asyncio.run(run())
        assert full.status_code == 503 and full.json()["error"]["type"] == "service_unavailable"
        assert [r.status_code for r in finished] == [200, 200]
        assert [r.json()["usage"]["completion_tokens"] for r in finished] == [120, 120]
        assert process.wait(30) == 0


def test_load_tester_against_the_server(tiny_artifact):
    from optc.loadgen import LoadOptions, run_load

    with serve_process(tiny_artifact, "--served-model-name", "tiny") as (url, _):
        result = run_load(LoadOptions(url, num_requests=12, input_len=16, output_len=8, request_rate=50.0,
                                      max_concurrency=4, seed=0, show_progress=False))
    assert result.num_errors == 0 and result.num_requests == 12
    assert result.num_output_tokens == 12 * 8 and result.num_prompt_tokens == 12 * 16
    assert 0 < result.ttft_ms["p50"] <= result.e2e_ms["p50"] and result.itl_ms["p50"] > 0
    assert result.output_tokens_per_s > 0 and result.max_concurrency == 4


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
