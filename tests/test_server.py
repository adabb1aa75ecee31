r"""`optc serve` as a live process on 127.0.0.1 (random:tiny), driven by the official `openai` client
(sync and async, streaming and not) and by httpx: the answers equal the in-process engine's, logprobs
equal transformers' log-softmax, and every error has OpenAI's shape and the documented status.
Also 50 concurrent streams with 20 disconnects, and the load tester. Shutdown, a full server and
SmolLM2 are in test_server_load.py.

Every bad input the tests send, and its answer (status, `param`; the message names the field too):

| endpoint     | input                                                                | status | param             |
|--------------|----------------------------------------------------------------------|--------|-------------------|
| completions  | `n` 0 or 17, `best_of` 3, penalties out of range, `repetition_penalty` 0 | 400 | that field      |
| completions  | `logit_bias` "x", 101, a token past the vocabulary; `stop_token_ids` | 400    | that field        |
| completions  | `min_tokens` above `max_tokens`                                      | 400    | `min_tokens`      |
| completions  | 17 `stop` strings or one of 257 characters                           | 400    | `stop`            |
| completions  | a grammar llguidance refuses (`structured_outputs`, `response_format`) | 400  | that field        |
| completions  | an unknown field (`made_up`)                                         | 400    | `made_up`         |
| completions  | `max_tokens` "many", `temperature` -1, `logprobs` 21, `top_p` 0      | 400    | that field        |
| completions  | `prompt` of 2 prompts, `prompt` null                                 | 400    | `prompt`          |
| completions  | `prompt` "\ud800" or ["a\udfffb"] (a lone surrogate)                 | 400    | `prompt`          |
| completions  | `seed` 2**80, 2**63, -2**63 - 1 (outside the signed 64-bit range)    | 400    | `seed`            |
| completions  | `max_tokens` 10**12                                                  | 400    | `max_tokens`      |
| completions  | 600 prompt tokens (context: 512)                                     | 400    | `prompt`          |
| completions  | 509 prompt tokens and `max_tokens` 4, 50 or left out (16)            | 400    | `max_tokens`      |
| completions  | a prompt token id outside the vocabulary                             | 400    | `prompt`          |
| completions  | a field named "\ud800" (pydantic cannot read the key)                | 400    | null              |
| completions  | a body that is not JSON                                              | 400    | null              |
| completions  | no key, a wrong key                                                  | 401    | null              |
| completions  | `model` "gpt-4"                                                      | 404    | `model`           |
| completions  | a request beyond max_num_seqs + max_waiting (test_server_load.py)    | 503    | null              |
| chat         | `response_format` json_schema without a schema, or type "xml"        | 400    | `response_format` |
| chat         | `top_logprobs` without `logprobs`                                    | 400    | `top_logprobs`    |
| chat         | `messages` empty, or a content part that is not text                 | 400    | `messages`        |
| chat         | a message content (string or text part) with a lone surrogate        | 400    | `messages`        |
| chat         | `seed` 2**80                                                         | 400    | `seed`            |
| chat         | `max_tokens` 10**12; `max_completion_tokens` 10**12                  | 400    | that field        |
| /tokenize    | `prompt` or a message with a lone surrogate                          | 400    | `prompt`/`messages` |
| /detokenize  | token id -1                                                          | 400    | `tokens`          |
| /v1/nothing  | an unknown route                                                     | 404    | null              |
"""

import asyncio
import json
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from optc.core.errors import UserError  # noqa: E402
from optc.runtime import Engine, SamplingParams  # noqa: E402
from optc.testing import serve_process, tiny_hf_model  # noqa: E402

KEY = "test-key-1234"
PROMPT = "The quick brown fox"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tiny_artifact):
    with serve_process(tiny_artifact, "--api-key", KEY, "--served-model-name", "tiny") as (url, process):
        yield url


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    return Engine.load(tiny_artifact)


@pytest.fixture(scope="module", params=["float32", "int8"], ids=["float-kv", "int8-kv"])
def served(request):
    """(URL, in-process engine) for tiny_artifact's server, and for a server of the int8 KV build."""
    if request.param == "float32":
        yield request.getfixturevalue("server"), request.getfixturevalue("engine")
        return
    artifact = request.getfixturevalue("tiny_int8_kv_artifact")
    with serve_process(artifact, "--api-key", KEY, "--served-model-name", "tiny") as (url, process):
        yield url, Engine.load(artifact)


def client(url: str, key: str = KEY) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=60, max_retries=0)


def post(url: str, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    """POST `body` as ASCII JSON: a lone surrogate goes out as its `\\ud800` escape, as a client sends it
    (httpx's `json=` encodes UTF-8 and cannot)."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    return httpx.post(f"{url}{path}", content=json.dumps(body), headers=headers, timeout=60)


def test_completions_sync_equal_the_engine_streaming_or_not(served):
    server, engine = served
    expected = engine.generate([PROMPT], SamplingParams(max_tokens=12))[0]
    c = client(server)
    out = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == expected.text and out.choices[0].finish_reason == expected.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(expected.prompt_token_ids), 12)
    ids = engine.tokenizer(PROMPT)["input_ids"]
    by_ids = c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == expected.text
    chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [ch.choices[0].finish_reason for ch in chunks[:-1]][-1] == "length"


def test_chat_async_equal_the_engine_streaming_or_not(served):
    server, engine = served
    ids = engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    expected = engine.generate([list(ids)], SamplingParams(max_tokens=10, stop=("ab",)))[0]

    async def run():
        c = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, timeout=60, max_retries=0)
        kwargs = dict(model="tiny", messages=CHAT, max_completion_tokens=10, temperature=0, stop=["ab"])
        whole, stream = await asyncio.gather(
            c.chat.completions.create(**kwargs), c.chat.completions.create(**kwargs, stream=True))
        chunks = [ch async for ch in stream]
        await c.close()
        return whole, chunks

    whole, chunks = asyncio.run(run())
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == len(expected.token_ids)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_seeded_sampling_is_reproducible(server):
    c = client(server)
    runs = [c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.9, top_p=0.9,
                                 seed=7, extra_body={"top_k": 20}).choices[0].text for _ in range(2)]
    assert runs[0] == runs[1]


def test_echo_logprobs_equal_the_models_log_softmax(server, engine):
    ids = list(engine.tokenizer(PROMPT)["input_ids"])
    out = post(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 0, "echo": True,
                                           "logprobs": 3}).json()
    logprobs = out["choices"][0]["logprobs"]
    assert out["choices"][0]["text"] == PROMPT and out["usage"]["completion_tokens"] == 0
    with torch.no_grad():
        reference = tiny_hf_model()(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = [float(reference[p - 1, ids[p]]) for p in range(1, len(ids))]
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    assert logprobs["tokens"] == [engine.tokenizer.decode([t]) for t in ids]
    for p in range(1, len(ids)):  # the 3 most likely tokens and the prompt's own one
        top = reference[p - 1].topk(3)
        assert sorted(logprobs["top_logprobs"][p].values())[-1] == pytest.approx(float(top.values[0]), abs=1e-4)
        assert len(logprobs["top_logprobs"][p]) <= 4


def test_output_logprobs(server, engine):
    prompt = list(engine.tokenizer(PROMPT)["input_ids"])
    request = engine.add_request(prompt, SamplingParams(max_tokens=4, logprobs=2))
    while engine.has_unfinished():
        engine.step()
    out = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    assert out.choices[0].logprobs.token_logprobs == pytest.approx([e.logprob for e in request.logprobs], abs=1e-5)
    chat = client(server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0,
                                                  logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: the top token


@pytest.mark.parametrize("body, param", [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"best_of": 3}, "best_of"), ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -2.1}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"x": 2.0}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"9999": 1}}, "logit_bias"), ({"stop_token_ids": [256]}, "stop_token_ids"),
    ({"min_tokens": 3}, "min_tokens"), ({"stop": ["a"] * 17}, "stop"), ({"stop": "a" * 257}, "stop"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "response_format"),
    ({"made_up": 1}, "made_up"), ({"max_tokens": "many"}, "max_tokens"),
    ({"temperature": -1}, "temperature"), ({"logprobs": 21}, "logprobs"), ({"top_p": 0}, "top_p"),
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": None}, "prompt"),
    ({"prompt": "\ud800"}, "prompt"), ({"prompt": ["a\udfffb"]}, "prompt"),
    ({"seed": 2**80}, "seed"), ({"seed": 2**63}, "seed"), ({"seed": -2**63 - 1}, "seed"),
    ({"max_tokens": 10**12}, "max_tokens"),
])
def test_invalid_or_unsupported_completion_fields_are_400_naming_the_field(server, body, param):
    response = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": []}, "messages"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}, "messages"),
    ({"seed": 2**80}, "seed"), ({"max_tokens": 10**12}, "max_tokens"),
    ({"max_completion_tokens": 10**12}, "max_completion_tokens"),
])
def test_unsupported_chat_fields_are_400(server, body, param):
    response = post(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "\ud800": 1}, None),  # pydantic cannot read the key
])
def test_lone_surrogates_are_400_not_500(server, path, body, param):
    response = post(server, path, body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("seed", [0, -1, 2**63 - 1, -2**63])
def test_every_signed_64_bit_seed_is_accepted(server, seed):
    response = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": 1,
                                                "seed": seed})
    assert response.status_code == 200, response.text


def test_context_limits(server, engine):
    too_long = post(server, "/v1/completions", {"model": "tiny", "prompt": [5] * 600, "max_tokens": 2})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"
    message = too_long.json()["error"]["message"]
    assert "600" in message and str(engine.max_model_len) in message
    near_full = [5] * (engine.max_model_len - 3)  # room for 3 tokens
    for max_tokens in (4, 50, None):  # None: left out, OpenAI's default of 16
        limit = {} if max_tokens is None else {"max_tokens": max_tokens}
        too_many = post(server, "/v1/completions", {"model": "tiny", "prompt": near_full, **limit})
        error = too_many.json()["error"]
        assert too_many.status_code == 400 and error["param"] == "max_tokens", too_many.text
        assert all(str(n) in error["message"] for n in (len(near_full), max_tokens or 16, engine.max_model_len))
    exact = post(server, "/v1/completions", {"model": "tiny", "prompt": near_full, "max_tokens": 3, "temperature": 0,
                                             "ignore_eos": True})
    assert exact.status_code == 200
    body = exact.json()
    assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["finish_reason"] == "length"
    # chat without max_tokens: up to the context
    chat = post(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "temperature": 0,
                                                 "ignore_eos": True}).json()
    assert chat["usage"]["total_tokens"] == engine.max_model_len and chat["choices"][0]["finish_reason"] == "length"
    bad_ids = post(server, "/v1/completions", {"model": "tiny", "prompt": [10**6], "max_tokens": 2})
    assert bad_ids.status_code == 400 and "vocabulary" in bad_ids.json()["error"]["message"]
    assert bad_ids.json()["error"]["param"] == "prompt"


def test_keys_models_health_and_unknown_routes(server):
    assert httpx.get(f"{server}/health").status_code == 200  # no key needed
    for key in (None, "wrong"):
        response = post(server, "/v1/completions", {"model": "tiny", "prompt": "x"}, key=key)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").models.list()
    assert [m.id for m in client(server).models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert httpx.get(f"{server}/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    not_json = httpx.post(f"{server}/v1/completions", content=b"{", headers={"Authorization": f"Bearer {KEY}"})
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]


def test_tokenize_and_detokenize(server, engine):
    ids = list(engine.tokenizer(PROMPT)["input_ids"])
    tokens = post(server, "/tokenize", {"prompt": PROMPT}).json()
    assert tokens["tokens"] == ids and tokens["count"] == len(ids)
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == engine.tokenizer.decode(ids)
    bad = post(server, "/detokenize", {"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    chat = post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    expected = engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    assert chat == list(expected["input_ids"] if hasattr(expected, "keys") else expected)


def test_metrics_count_tokens_and_finishes(server):
    values = metrics(server)
    assert values["optc:num_requests_running"] == 0 and values["optc:kv_cache_usage_perc"] == 0
    assert values["optc:generation_tokens_total"] > 0
    assert values['optc:request_success_total{finished_reason="length"}'] > 0
    assert values["optc:time_to_first_token_seconds_count"] > 0
    for name in ("inter_token_latency_seconds_count", "e2e_request_latency_seconds_count", "prompt_tokens_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_requests_waiting"):
        assert f"optc:{name}" in values


LOAD_PROMPTS = ["one two three", "four five", "six seven eight nine", "ten"]


def metrics(url: str) -> dict[str, float]:
    """Every `optc:` sample: {'name{labels}': value}, labels with model_name dropped."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("optc:"):
            name, value = line.rsplit(" ", 1)
            out[name.replace('model_name="tiny"', "").replace("{,", "{").replace(",}", "}").replace("{}", "")] = \
                float(value)
    return out


async def stream(client: httpx.AsyncClient, prompt: str, max_tokens: int, disconnect_after: int | None) -> str | None:
    """The streamed text, or None after closing the connection once `disconnect_after` chunks came."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
                if len(text) == disconnect_after:
                    return None  # leaving the block closes the connection mid-stream
    return "".join(text)


def test_fifty_streams_twenty_disconnect(server):
    body = {"model": "tiny", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    expected = {p: post(server, "/v1/completions", body | {"prompt": p}).json()["choices"][0]["text"]
                for p in LOAD_PROMPTS}
    aborted_before = metrics(server)['optc:request_success_total{finished_reason="abort"}']

    async def run():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=server, headers=headers, timeout=120,
                                     limits=httpx.Limits(max_connections=60)) as client:
            return await asyncio.gather(*[
                stream(client, LOAD_PROMPTS[i % 4], 400, 3) if i % 5 in (1, 3)  # leaves long before its end
                else stream(client, LOAD_PROMPTS[i % 4], 24, None) for i in range(50)])

    texts = asyncio.run(run())
    assert sum(t is None for t in texts) == 20
    kept = [i for i in range(50) if i % 5 not in (1, 3)]
    assert [t for t in texts if t is not None] == [expected[LOAD_PROMPTS[i % 4]] for i in kept]
    deadline = time.monotonic() + 20
    while (values := metrics(server))["optc:num_requests_running"] or values["optc:kv_cache_usage_perc"]:
        assert time.monotonic() < deadline, f"requests still running after every client left: {values}"
        time.sleep(0.2)
    assert values["optc:num_requests_waiting"] == 0
    assert values['optc:request_success_total{finished_reason="abort"}'] - aborted_before == 20
    again = post(server, "/v1/completions", body | {"prompt": LOAD_PROMPTS[0]})
    assert again.json()["choices"][0]["text"] == expected[LOAD_PROMPTS[0]]


def test_load_tester_against_the_server(server):
    from optc.commands.loadgen import LoadOptions, run_load

    result = run_load(LoadOptions(server, num_requests=12, input_len=16, output_len=8, request_rate=50.0,
                                  max_concurrency=4, api_key=KEY, show_progress=False))
    assert result.num_errors == 0 and result.num_requests == 12, result.errors
    assert result.num_output_tokens == 12 * 8 and result.num_prompt_tokens == 12 * 16
    assert 0 < result.ttft_ms["p50"] <= result.e2e_ms["p50"] and result.itl_ms["p50"] > 0
    assert result.output_tokens_per_s > 0 and result.max_concurrency == 4
    with pytest.raises(UserError, match="401"):
        run_load(LoadOptions(server, num_requests=2, input_len=4, output_len=2, api_key="wrong", show_progress=False))


def test_load_tester_sends_a_jsonl_datasets_prompts_and_output_lens(server, engine, tmp_path):
    """Each line's prompt text (not the raw JSON line) with its own output_len, as in-process `optc bench`."""
    from optc.commands.loadgen import LoadOptions, run_load

    dataset = tmp_path / "d.jsonl"
    lines = [{"prompt": "one two three", "output_len": 3}, {"prompt": "four", "output_len": 5}, {"prompt": "six"}]
    dataset.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    result = run_load(LoadOptions(server, num_requests=4, output_len=2, dataset=dataset, api_key=KEY,
                                  show_progress=False))
    assert result.num_errors == 0, result.errors
    assert result.num_output_tokens == 3 + 5 + 2 + 3  # the 4th request cycles back to the first line
    lengths = [len(engine.tokenizer(line["prompt"])["input_ids"]) for line in lines]
    assert result.num_prompt_tokens == sum(lengths) + lengths[0]


def test_a_non_streaming_client_that_leaves_has_its_request_aborted(server):
    before = metrics(server)['optc:request_success_total{finished_reason="abort"}']
    # the client gives up after 0.2 s, long before 480 tokens are generated (one engine step takes >= 1 ms)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=0.2, json={
            "model": "tiny", "prompt": [7] * 16, "max_tokens": 480, "ignore_eos": True})
    deadline = time.monotonic() + 20
    while True:  # the abort is counted, then the engine's stats snapshot follows
        values = metrics(server)
        if values['optc:request_success_total{finished_reason="abort"}'] == before + 1 and \
                values["optc:num_requests_running"] == 0 and values["optc:kv_cache_usage_perc"] == 0:
            break
        assert time.monotonic() < deadline, f"the request of a client that left was not aborted: {values}"
        time.sleep(0.1)


@pytest.mark.parametrize("args, words", [
    (["bench"], "--url"), (["bench", "--url", "http://127.0.0.1:9", "--eager"], "--eager"),
    (["bench", "--url", "ftp://x"], "--url"), (["bench", "--url", "http://127.0.0.1:9"], "/v1/models"),
    (["bench", "--url", "http://127.0.0.1:9", "--speculative", "ngram"], "--speculative is for in-process runs"),
    (["bench", "/nonexistent/artifact", "--request-rate", "5"], "--request-rate is for load tests of a server"),
    (["bench", "/nonexistent/artifact", "--max-concurrency", "2"], "--max-concurrency is for load tests"),
    (["serve", "/nonexistent/artifact", "--port", "0"], "/nonexistent/artifact"),
])
def test_cli_user_errors_are_one_line_and_exit_2(args, words):
    from typer.testing import CliRunner

    from optc.cli import app

    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and words in result.output and result.output.count("\n") == 1, result.output
