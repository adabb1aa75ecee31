"""A property-based fuzzer (hypothesis) over the completion and chat request schemas, against a live
`optc serve` of random:tiny:

- a valid body generated from the schema gets 200 and the tokens the in-process engine (`optc run`) gives
  for the same prompt and sampling parameters;
- a valid body with one field mutated (a value of another JSON type, NaN, an infinity, negative, zero, huge,
  an empty or huge string, a lone surrogate, nested lists, an unknown field) gets a 4xx naming that field in
  `param` and in the message, within TIME_BOUND_S; raw bodies (malformed JSON, invalid UTF-8, nesting,
  over the size limit) get a 4xx. Never a 5xx, a hang or a dead server: /health, the running count and the
  KV blocks in use are checked after every run.

Seeded (`derandomize`), so CI runs the same examples every time: FUZZ_EXAMPLES per test, about a minute in
all on a 2-core machine. `OPTC_FUZZ_EXAMPLES=2000 pytest tests/test_server_fuzz.py` runs more, and
`OPTC_FUZZ_SEED=N` runs other examples (a random seed instead of the fixed derandomized ones).
"""

from __future__ import annotations

import json
import math
import os

import httpx
import pytest

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from optc.runtime import Engine, SamplingParams  # noqa: E402
from optc.runtime.grammar import GrammarKind, GrammarSpec  # noqa: E402
from optc.testing import serve_process  # noqa: E402

FUZZ_EXAMPLES = int(os.environ.get("OPTC_FUZZ_EXAMPLES", "0")) or None  # None: each test's CI default
FUZZ_SEED = os.environ.get("OPTC_FUZZ_SEED")
TIME_BOUND_S = 20.0  # per request; a hang fails the example
MAX_BODY = 262144
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "b", " ", "\n", "é", "日本"]


def fuzz_settings(ci_examples: int):
    kwargs = dict(max_examples=FUZZ_EXAMPLES or ci_examples, deadline=None, print_blob=True,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                         HealthCheck.data_too_large])
    if FUZZ_SEED is None:
        kwargs["derandomize"] = True
    return settings(**kwargs)


@pytest.fixture(scope="module")
def live(tiny_artifact):
    # a failure window of 1 us: a failed step is reported as the 500 it is (while hypothesis shrinks it), not
    # as a server that stopped after its second failure
    args = ("--served-model-name", "tiny", "--max-body-bytes", str(MAX_BODY), "--failure-window", "1e-6")
    with serve_process(tiny_artifact, *args) as (url, _):
        with httpx.Client(base_url=url, timeout=TIME_BOUND_S) as client:
            yield client


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    return Engine.load(tiny_artifact)


# --- valid bodies ---------------------------------------------------------------------------------

text = st.lists(st.sampled_from(WORDS), min_size=1, max_size=12).map("".join)
sampling = st.fixed_dictionaries({}, optional={
    "temperature": st.one_of(st.just(0), st.floats(0.0, 2.0)),
    "top_p": st.floats(0.0, 1.0, exclude_min=True),
    "top_k": st.one_of(st.integers(-1, 64), st.integers(-1, 2**31 - 1)),
    "seed": st.integers(-2**63, 2**63 - 1),
    "stop": st.one_of(st.sampled_from(WORDS[:8]), st.lists(st.sampled_from(WORDS[:8]), max_size=3)),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "user": st.text(max_size=8),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.1, 3.0),
    "logit_bias": st.dictionaries(st.integers(0, 255).map(str), st.floats(-100.0, 100.0), max_size=4),
    "stop_token_ids": st.lists(st.integers(0, 255), max_size=3),
    "min_tokens": st.integers(0, 1),
    "structured_outputs": st.sampled_from([{"choice": ["yes", "no"]}, {"regex": "[a-c]{1,4}"},
                                           {"json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
                                           {"grammar": 'start: "<" /[0-9]{1,3}/ ">"'}]),
})


def reproducible(fields: dict) -> dict:
    """Sampling without a seed draws from the server's generator: greedy then, so the engine can match it."""
    return fields if "seed" in fields else fields | {"temperature": 0}


def completion_bodies(vocab_size: int):
    prompt = st.one_of(text, st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=16), text.map(lambda t: [t]))
    return st.builds(lambda p, n, s: {"model": "tiny", "prompt": p, "max_tokens": n, "return_token_ids": True,
                                      **s, **({"min_tokens": min(n, s["min_tokens"])} if "min_tokens" in s else {})},
                     prompt, st.integers(1, 8), sampling.map(reproducible))


part = text.map(lambda t: {"type": "text", "text": t})
message = st.builds(lambda role, content: {"role": role, "content": content},
                    st.sampled_from(["system", "developer", "user", "assistant"]),
                    st.one_of(text, st.lists(part, min_size=1, max_size=3)))
chat_bodies = st.builds(
    lambda m, n, which, s: {"model": "tiny", "messages": m + [{"role": "user", "content": "hi"}], which: n, **s},
    st.lists(message, max_size=3), st.integers(1, 8), st.sampled_from(["max_tokens", "max_completion_tokens"]),
    sampling.map(reproducible))


def params_of(body: dict, max_tokens: int) -> SamplingParams:
    """What the server runs a body with (protocol.py sampling_params), for the in-process engine."""
    stop = body.get("stop") or ()
    grammar = None
    if "structured_outputs" in body:
        (kind, value), = body["structured_outputs"].items()
        kind = {"json": GrammarKind.JSON_SCHEMA, "regex": GrammarKind.REGEX, "choice": GrammarKind.CHOICE,
                "grammar": GrammarKind.GRAMMAR}[kind]
        grammar = GrammarSpec(kind, value if isinstance(value, str) else json.dumps(value))
    return SamplingParams(temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
                          top_k=max(0, body.get("top_k", 0)), seed=body.get("seed"), max_tokens=max_tokens,
                          stop=(stop,) if isinstance(stop, str) else tuple(stop),
                          ignore_eos=body.get("ignore_eos", False),
                          presence_penalty=body.get("presence_penalty", 0.0),
                          frequency_penalty=body.get("frequency_penalty", 0.0),
                          repetition_penalty=body.get("repetition_penalty", 1.0),
                          logit_bias=tuple((int(k), v) for k, v in body.get("logit_bias", {}).items()),
                          stop_token_ids=tuple(body.get("stop_token_ids", ())), grammar=grammar,
                          min_tokens=min(body.get("min_tokens", 0), max_tokens))


def answer(live: httpx.Client, path: str, body: dict) -> tuple[str, list[int] | None]:
    """(text, token ids) of a 200 answer, streamed or not."""
    if not body.get("stream"):
        response = live.post(path, content=json.dumps(body))
        assert response.status_code == 200, (body, response.text)
        choice = response.json()["choices"][0]
        return choice.get("text", (choice.get("message") or {}).get("content")), choice.get("token_ids")
    texts, ids = [], []
    with live.stream("POST", path, content=json.dumps(body)) as response:
        assert response.status_code == 200, (body, response.read())
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, (body, event)
                choice = event["choices"][0]
                texts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                ids += choice.get("token_ids") or []
    return "".join(texts), ids if "token_ids" in body or body.get("return_token_ids") else None


@fuzz_settings(60)
@given(data=st.data())
def test_valid_completions_give_the_engines_tokens(live, engine, data):
    body = data.draw(completion_bodies(engine.model.vocab_size))
    text_out, token_ids = answer(live, "/v1/completions", body)
    prompt = body["prompt"][0] if isinstance(body["prompt"], list) and isinstance(body["prompt"][0], str) \
        else body["prompt"]
    expected = engine.generate([prompt], params_of(body, body["max_tokens"]))[0]
    assert token_ids == expected.token_ids and text_out == expected.text, body


@fuzz_settings(30)
@given(body=chat_bodies)
def test_valid_chats_give_the_engines_text(live, engine, body):
    text_out, _ = answer(live, "/v1/chat/completions", body)
    messages = [{"role": "system" if m["role"] == "developer" else m["role"],
                 "content": m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])}
                for m in body["messages"]]
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    n = body.get("max_tokens") or body.get("max_completion_tokens")
    assert text_out == engine.generate([ids], params_of(body, n))[0].text, body


# --- one field mutated ----------------------------------------------------------------------------

NAN, INF = math.nan, math.inf
# values no field of either schema takes
ALWAYS_BAD = [NAN, INF, -INF, {"nested": [[[]]]}, [[[[1]]]], "\ud800"]
# per field: values of a wrong type or out of range (OpenAI's ranges, and this server's limits)
BAD = {
    "model": [None, 5, ["tiny"], "", "gpt-4", "x" * 100_000],
    "prompt": [None, 5, {}, [], [-1], [10**9], [1.5], ["a", "b"], [[1], [2]], [True], "a\udfffb", "x" * 200_000],
    "messages": [None, [], "hi", [{}], [{"role": "tool", "content": "x"}], [{"role": "user"}],
                 [{"role": "user", "content": None}], [{"role": "user", "content": [{"type": "image_url"}]}],
                 [{"role": "user", "content": "\udc00"}], [{"role": "user", "content": "x", "extra": 1}]],
    "max_tokens": [-1, 1.5, "8", True, 10**12, 10**30, 1e308],
    "max_completion_tokens": [0, -1, 1.5, "8", 10**12],
    "temperature": [-0.01, 2.01, 1e308, -1e308, "0.5", True, [0.5]],
    "top_p": [0, -0.5, 1.01, 1e308, "1", False],
    "top_k": [-2, -10**30, 10**30, 2**31, 1.5, "5", True],
    "seed": [2**63, -2**63 - 1, 10**40, 1.0, "7", True],
    "stop": [5, [5], [""], "", [None], {"s": 1}],
    "stream": [1, "true", None],
    "ignore_eos": [1, "yes", None],
    "n": [0, 17, -1, 1.0, 10**30],
    "presence_penalty": [2.5, -2.5, 1e308, "0"],
    "frequency_penalty": [-2.01, 3, "0"],
    "repetition_penalty": [0, -1, 101, "1"],
    "logit_bias": [{"x": 5}, {"1": 101}, {"-1": 1}, {"99999": 1}, [1], "x", {str(i): 1 for i in range(1025)}],
    "stop_token_ids": [[-1], [256], [1.5], "1", 1],
    "min_tokens": [-1, 3, 1.5, "1"],
    "structured_outputs": [{}, {"regex": "(a"}, {"choice": []}, {"grammar": "start: nope"}, {"regex": 1},
                           {"json": {"type": "strng"}}, {"regex": "a", "choice": ["b"]}, {"made_up": 1}, "x"],
    "user": [5, ["u"]],
    "stream_options": [5, {"include_usage": 1}, {"made_up": True}],
    "logprobs": [-1, 21, 2.0, "3"],
    "echo": [1, "no"],
    "best_of": [0, 2, 1.5],
    "suffix": [5, "tail", "x" * 100_000],
    "return_token_ids": [1, "yes"],
    "top_logprobs": [-1, 21, 1.5],
    "response_format": [{"type": "xml"}, "json", {}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"uniqueItems": True,
                                                                                       "type": "array"}}}],
    "tools": [[{"type": "function"}], "x", [{"type": "function", "function": {"name": "a b"}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]],
    "tool_choice": ["sometimes", {"type": "function"}, {"type": "function", "function": {"name": "f"}}, 5],
    "parallel_tool_calls": [1, "yes"],
}
SAMPLING_FIELDS = ["n", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                   "stop_token_ids", "min_tokens", "structured_outputs", "response_format"]
COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                     "ignore_eos", "user", "stream_options", "logprobs", "echo", "best_of", "suffix",
                     "return_token_ids", *SAMPLING_FIELDS]
CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
               "stop", "stream", "ignore_eos", "user", "stream_options", "logprobs", "top_logprobs", "tools",
               "tool_choice", "parallel_tool_calls", *SAMPLING_FIELDS]
BASE = {"/v1/completions": {"model": "tiny", "prompt": "hello", "max_tokens": 2},
        "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
UNKNOWN = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12).filter(
    lambda k: k not in CHAT_FIELDS + COMPLETION_FIELDS)


def mutations(path: str):
    fields = COMPLETION_FIELDS if path == "/v1/completions" else CHAT_FIELDS
    known = st.sampled_from(fields).flatmap(
        lambda f: st.tuples(st.just(f), st.sampled_from(BAD.get(f, []) + ALWAYS_BAD)))
    unknown = st.tuples(UNKNOWN, st.one_of(st.none(), st.integers(), st.text(max_size=4)))
    return st.one_of(known, unknown)


def dumps(body: dict) -> bytes:
    """JSON as clients send it: NaN and the infinities as Python's json writes them (NaN, Infinity), a lone
    surrogate as its escape."""
    return json.dumps(body, allow_nan=True).encode()


@pytest.mark.parametrize("path", list(BASE))
def test_one_bad_field_is_a_4xx_naming_it(live, path):
    @fuzz_settings(150)
    @given(mutation=mutations(path))
    def run(mutation):
        field, value = mutation
        body = BASE[path] | {field: value}
        if field in ("top_logprobs",):
            body["logprobs"] = True  # so the value itself is what is judged
        if field in ("tool_choice", "parallel_tool_calls"):  # judged beside a valid tool
            body["tools"] = [{"type": "function", "function": {"name": "g"}}]
        response = live.post(path, content=dumps(body), headers={"Content-Type": "application/json"})
        assert 400 <= response.status_code < 500, (body, response.status_code, response.text[:300])
        error = response.json()["error"]
        if response.status_code == 413:  # over the body limit: refused before it is parsed
            assert len(dumps(body)) > MAX_BODY
            return
        assert error["param"] == field and field in error["message"], (body, error)

    run()


raw_bodies = st.one_of(
    st.binary(max_size=64),  # mostly not JSON, often not UTF-8
    st.text(max_size=64).map(str.encode),
    st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 5000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.just(b"x" * (MAX_BODY + 1)),
    st.sampled_from([b"null", b"[]", b'"x"', b"1", b"true", b'{"model": "tiny", "prompt": "\\ud800\\u"}']),
)


@pytest.mark.parametrize("path", [*BASE, "/tokenize", "/detokenize"])
def test_raw_bodies_are_4xx(live, path):
    @fuzz_settings(40)
    @given(raw=raw_bodies)
    def run(raw):
        response = live.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert 400 <= response.status_code < 500, (raw[:100], response.status_code, response.text[:300])
        assert response.status_code != 413 or len(raw) > MAX_BODY
        assert "error" in response.json()

    run()


def test_the_server_is_healthy_afterwards(live):
    assert live.get("/health").status_code == 200
    metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in live.get("/metrics").text.splitlines()
               if line.startswith(("optc:num_requests_running", "optc:kv_cache_usage_perc"))}
    assert metrics == {"optc:num_requests_running": 0.0, "optc:kv_cache_usage_perc": 0.0}
