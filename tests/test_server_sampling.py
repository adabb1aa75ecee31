"""`optc serve` (random:tiny) with the sampling and structured-output fields production clients send: `n` with a
seed per completion, penalties and logit_bias (equal to the engine's), `response_format` through the openai
client's `parse()`, vLLM's `structured_outputs`, a chat template that raises (400 quoting it), and a huge prompt
tokenized off the engine thread (another request's tokens keep coming)."""

import asyncio
import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from pydantic import BaseModel, Field  # noqa: E402

from optc.runtime import Engine, SamplingParams  # noqa: E402
from optc.testing import serve_process  # noqa: E402

KEY = "test-key-1234"
PROMPT = "The quick brown fox"
STRICT_TEMPLATE = (  # roles must alternate (as Gemma's, Mistral's templates say); tools listed by name, briefly
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}</tools>{% endif %}"
    "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


class Pet(BaseModel):
    kind: str = Field(max_length=5)
    legs: int = Field(ge=0, le=8)


class Owner(BaseModel):
    name: str = Field(max_length=6)
    pets: list[Pet] = Field(max_length=2)
    adult: bool


@pytest.fixture(scope="module")
def server(tiny_artifact, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "strict.jinja"
    template.write_text(STRICT_TEMPLATE)
    with serve_process(tiny_artifact, "--api-key", KEY, "--served-model-name", "tiny",
                       "--chat-template", str(template), "--tool-call-parser", "hermes") as (url, process):
        yield url


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    return Engine.load(tiny_artifact)


def client(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=60, max_retries=0)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_n_completions_each_with_its_seed(server, engine):
    c = client(server)
    out = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=3)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    expected = engine.generate([PROMPT] * 3, [SamplingParams(max_tokens=8, temperature=1.0, seed=5 + i)
                                              for i in range(3)])
    assert [ch.text for ch in out.choices] == [e.text for e in expected]
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == len(expected[0].prompt_token_ids)
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, temperature=1.0, seed=9, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    whole = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                      temperature=1.0, seed=9, n=2)
    for index in (0, 1):
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks
                           if ch.choices and ch.choices[0].index == index)
        assert streamed == whole.choices[index].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 12
    assert whole.choices[0].message.content != whole.choices[1].message.content


def test_penalties_and_logit_bias_equal_the_engines(server, engine):
    fields = {"presence_penalty": -2.0, "frequency_penalty": -0.5, "logit_bias": {"65": 3.0}}
    out = post(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                           "repetition_penalty": 0.5, "min_tokens": 2, **fields})
    params = SamplingParams(max_tokens=10, presence_penalty=-2.0, frequency_penalty=-0.5, logit_bias=((65, 3.0),),
                            repetition_penalty=0.5, min_tokens=2)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] == engine.generate([PROMPT], params)[0].text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_returns_a_valid_object_streaming_or_not(server, temperature):
    c = client(server)
    messages = [{"role": "user", "content": "An owner and pets, as JSON."}]
    out = c.chat.completions.parse(model="tiny", messages=messages, response_format=Owner, max_tokens=200,
                                   temperature=temperature, seed=3)
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(out.choices[0].message.parsed, Owner)
    with c.chat.completions.stream(model="tiny", messages=messages, response_format=Owner, max_tokens=200,
                                   temperature=temperature, seed=3) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == out.choices[0].message.parsed
    plain = post(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "temperature": 0,
                                             "response_format": {"type": "json_object"}}).json()["choices"][0]
    # a random model's free key may run to max_tokens; a finished one is an object
    assert plain["text"].startswith("{") and (plain["finish_reason"] == "length"
                                              or isinstance(json.loads(plain["text"]), dict))


def test_structured_outputs_extension(server):
    for constraint, check in (({"choice": ["red", "green"]}, lambda t: t in ("red", "green")),
                              ({"regex": "[0-9]{4}"}, lambda t: len(t) == 4 and t.isdigit()),
                              ({"grammar": 'start: "<" WORD ">"\nWORD: /[a-z]{1,5}/'},
                               lambda t: t[0] == "<" and t[-1] == ">")):
        out = post(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 20,
                                               "structured_outputs": constraint})
        assert out.status_code == 200 and check(out.json()["choices"][0]["text"]), out.text
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    out = post(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert out.json()["choices"][0]["finish_reason"] == "length"  # cut mid-value


def test_a_chat_template_that_raises_is_a_400_quoting_it(server):
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    for path, body in (("/v1/chat/completions", {"model": "tiny", "messages": twice}), ("/tokenize",
                                                                                         {"messages": twice})):
        out = post(server, path, body)
        assert out.status_code == 400, out.text
        error = out.json()["error"]
        assert error["param"] == "messages" and "Conversation roles must alternate" in error["message"]


def test_a_huge_prompt_does_not_stall_other_requests(server):
    """A 7 MiB prompt (seconds to tokenize) is answered 400 (longer than the context) while a stream goes on."""
    huge = "hello world " * (7 * 2**20 // 12)

    async def run():
        async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=120) as http:
            gaps, last = [], None

            async def stream():
                nonlocal last
                body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True,
                        "ignore_eos": True}
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            now = time.perf_counter()
                            if last is not None:
                                gaps.append(now - last)
                            last = now

            async def big():
                await asyncio.sleep(0.3)
                start = time.perf_counter()
                response = await http.post("/v1/completions", json={"model": "tiny", "prompt": huge,
                                                                     "max_tokens": 1})
                return response, time.perf_counter() - start

            (response, seconds), _ = await asyncio.gather(big(), stream())
            return response, seconds, gaps

    response, seconds, gaps = asyncio.run(run())
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert seconds > 2.0  # tokenizing it took long enough to matter
    assert max(gaps) < seconds / 2, (max(gaps), seconds)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 8},
                                                "unit": {"enum": ["C", "F"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_validate_streaming_or_not(server, tool_choice, temperature):
    import jsonschema

    c = client(server)
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, TIME],
                  tool_choice=tool_choice, max_tokens=150, temperature=temperature, seed=2, parallel_tool_calls=False)
    out = c.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
    chunks = list(c.chat.completions.create(**kwargs, stream=True))
    streamed: dict[int, dict] = {}
    for ch in chunks:
        for delta in ch.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert [(e["name"], e["arguments"]) for e in streamed.values()] == \
        [(t.function.name, t.function.arguments) for t in choice.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tools_history_and_bad_tool_choice(server):
    c = client(server)
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"}]
    out = c.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=8, temperature=0)
    assert out.choices[0].message.content is not None or out.choices[0].message.tool_calls
    bad = post(server, "/v1/chat/completions", {"model": "tiny", "messages": history, "tools": [WEATHER],
                                                "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
    both = post(server, "/v1/chat/completions", {"model": "tiny", "messages": history, "tools": [WEATHER],
                                                 "tool_choice": "required",
                                                 "response_format": {"type": "json_object"}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "tool_choice"
