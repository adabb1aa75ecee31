"""Issue 45's acceptance on SmolLM2 bf16 through a live `optc serve`: every case of benchmarks/json_schemas.py
through the openai client's `parse()` and its streaming `stream()` parses and validates at temperature 0 and at
1.0 (seeded); `tool_choice` required and named gives arguments that validate against the function's parameters;
a third-party framework (langchain-openai) gets a pydantic object and a tool call. The requests of each test are sent
at once, so the server batches them."""

from __future__ import annotations

import asyncio
import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from optc.testing import serve_process  # noqa: E402
from tests.test_json_schemas import CASES  # noqa: E402  (benchmarks/json_schemas.py)

MAX_TOKENS = 400  # every case's JSON fits (its strings and arrays are bounded); a run to the limit fails the test
TEMPERATURES = (0.0, 1.0)
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount of money between two currencies.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["amount", "source", "target"],
                       "properties": {"amount": {"type": "number", "minimum": 0, "maximum": 1000000},
                                      "source": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                      "target": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}},
    {"type": "function", "function": {
        "name": "add_todo", "description": "Add an item to the todo list.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["title", "priority", "tags"],
                       "properties": {"title": {"type": "string", "maxLength": 60},
                                      "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                               "maxItems": 3}}}}},
]
TOOL_PROMPTS = ("What's the weather like in Paris today?", "How many yen is 250 US dollars?",
                "Remind me to buy milk tomorrow, it's urgent.", "Plan my weekend.")


@pytest.fixture(scope="module")
def server(smollm2_bf16_artifact):
    with serve_process(smollm2_bf16_artifact, "--served-model-name", "smollm2", "--max-num-seqs", "64",
                       timeout=300) as (url, _):
        yield f"{url}/v1"


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key="unused", timeout=900, max_retries=0)


def _messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Answer with JSON only."}, {"role": "user", "content": prompt}]


async def _parse(client, case, temperature: float, seed: int):
    return await client.chat.completions.parse(
        model="smollm2", messages=_messages(case.prompt), response_format=case.model,
        temperature=temperature, seed=seed, max_tokens=MAX_TOKENS)


async def _stream(client, case, temperature: float, seed: int):
    async with client.chat.completions.stream(
            model="smollm2", messages=_messages(case.prompt), response_format=case.model,
            temperature=temperature, seed=seed, max_tokens=MAX_TOKENS) as stream:
        return await stream.get_final_completion()


@pytest.mark.slow
def test_every_schema_parses_and_validates_plain_and_streamed(server):
    """25 cases x 2 temperatures x (parse, stream) = 100 requests in flight together; `parse()` raises
    LengthFinishReasonError on a run to max_tokens and ValidationError on an answer that does not fit."""
    async def run():
        async with _client(server) as client:
            jobs = [(how.__name__, case, t, seed) for how in (_parse, _stream) for t in TEMPERATURES
                    for seed, case in enumerate(CASES)]
            results = await asyncio.gather(*(how(client, case, t, seed) for how in (_parse, _stream)
                                             for t in TEMPERATURES for seed, case in enumerate(CASES)),
                                           return_exceptions=True)
            return list(zip(jobs, results, strict=True))

    failures = []
    for (how, case, t, seed), out in asyncio.run(run()):
        if isinstance(out, BaseException):
            failures.append(f"{how} {case.name} T={t} seed={seed}: {type(out).__name__}: {str(out)[:300]}")
            continue
        choice = out.choices[0]
        if choice.finish_reason != "stop" or not isinstance(choice.message.parsed, case.model):
            failures.append(f"{how} {case.name} T={t}: finish {choice.finish_reason}, {choice.message.content!r}")
            continue
        # the parsed object is exactly the text's JSON, and the text validates with the model on its own
        assert case.model.model_validate_json(choice.message.content) == choice.message.parsed
    assert not failures, f"{len(failures)} of {4 * len(CASES)} failed:\n" + "\n".join(failures)


@pytest.mark.slow
def test_required_and_named_tool_calls_validate(server):
    """tool_choice required (any of 3 tools; one call, and one or more) and each tool named, over 4 prompts at
    temperature 0 and 1: every call names a given tool (the named one where named) and its arguments validate.
    With parallel calls allowed the grammar takes any number of calls, and SmolLM2 keeps calling until
    max_tokens: such a reply's finish_reason is "length", and its complete calls must still validate."""
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    choices = [("required", False), ("required", None),
               *(({"type": "function", "function": {"name": n}}, None) for n in parameters)]
    jobs = [(prompt, choice, parallel, t, seed) for seed, prompt in enumerate(TOOL_PROMPTS)
            for choice, parallel in choices for t in TEMPERATURES]

    async def run():
        async with _client(server) as client:
            return await asyncio.gather(*(client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": prompt}], tools=TOOLS, tool_choice=choice,
                temperature=t, seed=seed, max_tokens=MAX_TOKENS,
                **({} if parallel is None else {"parallel_tool_calls": parallel}))
                for prompt, choice, parallel, t, seed in jobs))

    outs = asyncio.run(run())
    num_calls = 0
    for (prompt, choice, parallel, t, _), out in zip(jobs, outs, strict=True):
        message, finish = out.choices[0].message, out.choices[0].finish_reason
        is_many = choice == "required" and parallel is None
        assert finish == "tool_calls" or (is_many and finish == "length"), (prompt, choice, t, finish, message)
        assert message.tool_calls and (is_many or len(message.tool_calls) == 1), (prompt, choice, t, message)
        for call in message.tool_calls:
            if choice != "required":
                assert call.function.name == choice["function"]["name"]
            jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
            num_calls += 1
    assert num_calls >= len(jobs)


def _langchain_openai():
    try:
        import langchain_openai
    except ImportError as e:
        pytest.skip(f"langchain-openai is not installed (pip install -e '.[frameworks]'): {e}")
    return langchain_openai


@pytest.mark.slow
def test_langchain_structured_output_and_tool_call(server):
    """langchain-openai's ChatOpenAI against optc serve: `with_structured_output(Model)` (json_schema) gives the
    pydantic object, and `bind_tools(..., tool_choice=NAME)` a tool call whose arguments validate."""
    langchain_openai = _langchain_openai()
    llm = langchain_openai.ChatOpenAI(base_url=server, api_key="unused", model="smollm2", temperature=0,
                                      max_tokens=MAX_TOKENS, max_retries=0, timeout=600)
    cases = CASES[:4]
    tool = TOOLS[0]["function"]
    structured = [llm.with_structured_output(case.model, method="json_schema", strict=True) for case in cases]
    with_tools = llm.bind_tools(TOOLS, tool_choice=tool["name"])

    async def run():  # one event loop: ChatOpenAI keeps its async client
        return await asyncio.gather(*(s.ainvoke(_messages(case.prompt)) for s, case in zip(structured, cases,
                                                                                           strict=True)),
                                    *(with_tools.ainvoke(prompt) for prompt in TOOL_PROMPTS))

    out = asyncio.run(run())
    objects, replies = out[:len(cases)], out[len(cases):]
    for case, obj in zip(cases, objects, strict=True):
        assert isinstance(obj, case.model), (case.name, obj)
    for prompt, reply in zip(TOOL_PROMPTS, replies, strict=True):
        assert [c["name"] for c in reply.tool_calls] == [tool["name"]], (prompt, reply)
        jsonschema.validate(reply.tool_calls[0]["args"], tool["parameters"])
