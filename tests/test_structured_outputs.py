"""Structured outputs in the engine (random:tiny, its byte tokenizer): every kind of grammar gives text the grammar
accepts, greedy and sampled, batched beside unconstrained rows; speculative decoding (n-gram, a draft model)
gives the same greedy text as plain constrained decoding; compiled grammars are cached; a bad grammar is an
InputError naming its field."""

import json

import jsonschema
import pytest

from optc.core.errors import InputError
from optc.core.settings import SpeculativeConfig
from optc.runtime.engine import Engine
from optc.runtime.grammar import GrammarKind, GrammarSpec
from optc.runtime.sampler import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
            "required": ["kind", "legs"], "additionalProperties": False}},
        "note": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
PROMPTS = [[5, 9, 5, 7], [100, 101], [42] * 20, [7, 7, 8, 9, 10, 11]]
SMALL_SCHEMA = {  # a short value, for the slower speculative runs
    "type": "object",
    "properties": {"a": {"type": "array", "maxItems": 3, "items": {"enum": ["xy", "z"]}},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    return Engine.load(tiny_artifact)


def constrained(grammar: GrammarSpec, temperature: float = 0.0, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=160, temperature=temperature, seed=seed, grammar=grammar)


def test_json_schema_output_is_valid_greedy_and_sampled_beside_free_rows(engine):
    spec = GrammarSpec.json_schema(SCHEMA)
    params = [constrained(spec), SamplingParams(max_tokens=20), constrained(spec, 1.0, 3), constrained(spec, 1.0, 4)]
    batched = engine.generate(PROMPTS, params)
    for out in [batched[0], *batched[2:]]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert engine.generate([PROMPTS[0]], [params[0]])[0].text == batched[0].text  # batching does not change a row


@pytest.mark.parametrize(("spec", "check"), [
    (GrammarSpec(GrammarKind.REGEX, r"[0-9]{3}-[a-c]{2}"), lambda t: len(t) == 6 and t[3] == "-"),
    (GrammarSpec(GrammarKind.CHOICE, '["yes", "no", "maybe not"]'), lambda t: t in ("yes", "no", "maybe not")),
    (GrammarSpec(GrammarKind.GRAMMAR, 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'),
     lambda t: t.startswith("(") and t.endswith(")")),
    (GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "object"}'), lambda t: isinstance(json.loads(t), dict)),
])
def test_regex_choice_lark_and_any_object(engine, spec, check):
    for params in (constrained(spec), constrained(spec, 1.0, 11)):
        out = engine.generate([PROMPTS[1]], params)[0]
        assert out.finish_reason == "stop" and check(out.text), out.text


def test_max_tokens_mid_value_is_length(engine):
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=5, grammar=GrammarSpec.json_schema(SCHEMA)))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5 and out.text.startswith("{")


def test_grammars_are_compiled_once_and_refusals_name_the_field(engine):
    spec = GrammarSpec.json_schema({"type": "array", "items": {"type": "integer"}, "maxItems": 2})
    engine.generate([PROMPTS[0]], constrained(spec))
    compiled = engine.grammars.num_compiled
    engine.generate([PROMPTS[1], PROMPTS[2]], [constrained(spec), constrained(spec, 1.0, 1)])
    assert engine.grammars.num_compiled == compiled
    for spec, words in ((GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "string", "format": "bogus"}',
                                     "response_format"), "Unknown format: bogus"),
                        (GrammarSpec(GrammarKind.REGEX, "(a"), "regex"),
                        (GrammarSpec(GrammarKind.LARK, "start: missing_rule"), "missing_rule")):
        with pytest.raises(InputError, match=words) as error:
            engine.generate([PROMPTS[0]], constrained(spec))
        assert error.value.field == spec.field


@pytest.fixture(scope="module")
def tiny_bf16_artifact(tmp_path_factory, recipes):
    from optc.testing import build_artifact

    # the C++ ops, whose verification rows are decode's bits (tests/test_speculative_bf16.py)
    passes = ("passes=[fuse_qkv, fuse_gate_up, fuse_add_rmsnorm, fuse_rope_kv, {kv_layout: {block_size: 16}}, "
              "select_kernels]")
    return build_artifact(tmp_path_factory.mktemp("tiny-bf16") / "a", recipes / "tiny.yaml", "dtype=bfloat16", passes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_constrained_greedy_equals_plain_constrained(request, dtype, method):
    artifact = request.getfixturevalue("tiny_artifact" if dtype == "float32" else "tiny_bf16_artifact")
    spec = GrammarSpec.json_schema(SMALL_SCHEMA)
    params = [SamplingParams(max_tokens=60, grammar=spec) for _ in PROMPTS]
    plain = Engine.load(artifact).generate(PROMPTS, params)
    config = SpeculativeConfig(method, 4, draft=str(artifact) if method == "draft" else None, adaptive=False)
    fast = Engine.load(artifact, speculative=config)
    out = fast.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    stats = fast.speculator.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0  # drafts were both accepted and rejected


def test_masks_of_chains_and_trees_equal_one_matcher_per_row(engine):
    """A speculative row's mask is the one after its drafts: a chain's (llguidance walks the drafts) and a tree's
    (each path consumed and rolled back) equal a fresh matcher advanced over the same tokens; a row past a refused
    draft allows everything; the matcher is where it was afterwards."""
    from optc.runtime.grammar import Masks

    spec = GrammarSpec.json_schema(SCHEMA)
    matcher = engine.grammars.matcher(spec)
    ids = engine.tokenizer('{"name": "ab"', add_special_tokens=False)["input_ids"]
    for token in ids[:2]:
        assert matcher.consume(token)
    chain = [[], ids[2:3], ids[2:4], ids[2:5]]
    tree = [[], ids[2:3], [ord("x")], ids[2:4], [ord("x"), ids[3]]]  # node 2 refused: its row and child all-allowed
    masks = Masks(beside=True).start([(matcher, chain), (matcher.copy(), tree)]).result()
    expected = []
    for history in chain + tree:
        fresh = engine.grammars.matcher(spec)
        ok = all(fresh.consume(t) for t in ids[:2] + list(history))
        expected.append(Masks(beside=True).start([(fresh, [[]])]).result()[0] if ok else None)
    for row, want in enumerate(expected):
        assert masks[row].tolist() == (want.tolist() if want is not None else [-1] * masks.shape[1]), row
    assert matcher.num_valid(ids[2:]) == len(ids) - 2  # rolled back to after ids[:2]


def test_the_grammar_cache_is_bounded(tiny_artifact):
    from optc.runtime.grammar import GrammarCompiler

    engine = Engine.load(tiny_artifact)
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, (), cache_size=2)
    specs = [GrammarSpec(GrammarKind.REGEX, f"a{{{n}}}") for n in (1, 2, 3)]
    for spec in [*specs, specs[2], specs[0]]:  # the third evicts the first; the first then compiles again
        compiler.matcher(spec)
    assert compiler.num_compiled == 4


def test_preemption_and_chunked_prefill_keep_the_grammar_state(tiny_artifact, engine):
    """A pool too small for the batch preempts requests (their K/V recomputed) and small token budgets chunk the
    prompts; the matchers follow the output tokens, so the text is the roomy engine's."""
    spec = GrammarSpec.json_schema(SMALL_SCHEMA)
    prompts = [p * 3 for p in PROMPTS]
    params = [SamplingParams(max_tokens=60, grammar=spec, temperature=t, seed=s) for t, s in ((0, None), (1.0, 5),
                                                                                            (0, None), (1.0, 6))]
    expected = [o.text for o in engine.generate(prompts, params)]
    tight = Engine.load(tiny_artifact, num_blocks=9, max_num_batched_tokens=16)
    assert [o.text for o in tight.generate(prompts, params)] == expected
    assert tight.stats().num_preemptions > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vocab_size,num_words", [(100, 4), (96, 3), (130, 4)])
def test_masked_sets_exactly_the_refused_tokens_to_minus_inf(dtype, vocab_size, num_words):
    """Bit j of word w allows token 32 w + j; tokens past the words are refused; the input is left as it was."""
    import torch

    from optc.runtime.grammar import masked

    g = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(3, vocab_size, generator=g).to(getattr(torch, dtype))
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, num_words), dtype=torch.int32, generator=g)
    before = logits.clone()
    expected = logits.clone()
    for r in range(3):
        for t in range(vocab_size):
            if t // 32 >= num_words or not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    out = masked(logits, bitmask)
    assert out.dtype == logits.dtype and torch.equal(out, expected)
    assert torch.equal(logits, before)
