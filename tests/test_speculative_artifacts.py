"""Speculative decoding on real artifacts (random:tiny, with its int4 RTN build as the draft), through
`Engine.load`, the recipe default and the CLI: greedy identical to plain decoding, seeded sampling
reproducible, counters in `optc bench --json`, JSONL datasets, and the bad inputs (exit 2)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from optc.cli import app
from optc.core.errors import InputError
from optc.runtime import Engine, SamplingParams
from optc.runtime.speculative import SpeculativeConfig
from optc.testing import assert_no_leaks, build_artifact

RTN = "passes=[fuse_qkv, fuse_gate_up, {quantize_rtn: {bits: 4, group_size: 32}}]"
TEXT = "The quick brown fox jumps over the lazy dog. "
PROMPTS = [TEXT * (1 + i % 3) + TEXT[: 5 + i] for i in range(10)] + [
    "".join(chr(33 + (i * 31 + j * 17) % 90) for j in range(6 + 3 * i)) for i in range(10)
]
GREEDY = SamplingParams(max_tokens=24)


def optc(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory, recipes) -> Path:
    """random:tiny quantized to int4 (RTN): the same model, cheaper and slightly different."""
    return build_artifact(tmp_path_factory.mktemp("draft") / "a", recipes / "tiny.yaml", RTN)


@pytest.fixture(scope="module")
def target(request, tiny_artifact) -> Path:
    """The target model: random:tiny with a float KV cache, or (parametrized "int8") with an int8 one."""
    kv_dtype = getattr(request, "param", "float32")
    return tiny_artifact if kv_dtype == "float32" else request.getfixturevalue("tiny_int8_kv_artifact")


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    engine = Engine.load(target)
    return [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]


def other_tokenizer(artifact: Path, out: Path) -> Path:
    """A copy of the artifact whose tokenizer maps two tokens to each other's ids (manifest hashes updated)."""
    shutil.copytree(artifact, out)
    path = out / "tokenizer" / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    path.write_text(json.dumps(data))
    manifest = json.loads((out / "manifest.json").read_text())
    raw = path.read_bytes()
    manifest["files"]["tokenizer/tokenizer.json"] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


SMALL = {"max_num_batched_tokens": 32, "num_blocks": 24}  # chunked prefill and preemption


# int8 KV: rejected drafts roll back by block id as with a float cache (ngram only: the draft model's
# own pool is float either way, and the draft runs are the slow ones)
@pytest.mark.parametrize("method,target,config", [
    ("ngram", "float32", {}), ("draft", "float32", {}), ("ngram", "float32", SMALL), ("draft", "float32", SMALL),
    ("ngram", "int8", SMALL)], ids=["batch-ngram", "batch-draft", "small-ngram", "small-draft", "small-int8-kv-ngram"],
    indirect=["target"])
def test_greedy_identical_on_tiny(target, tiny_draft, plain, method, config):
    spec = SpeculativeConfig(method, 4, draft=tiny_draft if method == "draft" else None, disable_above_num_requests=32)
    engine = Engine.load(target, speculative=spec, **config)
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == plain
    assert [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS[::4]] == plain[::4]  # batch 1
    stats = engine.stats()
    assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0
    if "num_blocks" in config:
        assert stats.num_preemptions > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampling_is_reproducible(tiny_artifact, tiny_draft, method):
    spec = SpeculativeConfig(method, 3, draft=tiny_draft if method == "draft" else None)
    params = [SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=20) for i in range(4)]
    runs = [[c.token_ids for c in Engine.load(tiny_artifact, speculative=spec).generate(PROMPTS[:4], params)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 4  # different seeds, different tokens


def test_recipe_default_is_recorded_and_used(tmp_path, recipes, tiny_artifact):
    path = build_artifact(tmp_path / "a", recipes / "tiny.yaml", "runtime.speculative=ngram:3")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["runtime"]["speculative"] == "ngram:3"
    engine = Engine.load(path)
    assert engine.speculator.config == SpeculativeConfig("ngram", 3)
    assert Engine.load(tiny_artifact).speculator is None
    overridden = Engine.load(path, speculative=SpeculativeConfig("ngram", 2))
    assert overridden.speculator.config.num_speculative_tokens == 2


def test_draft_with_another_tokenizer_is_refused(tmp_path, tiny_artifact):
    draft = other_tokenizer(tiny_artifact, tmp_path / "other")
    with pytest.raises(InputError, match=f"draft {draft} .* target {tiny_artifact}"):
        Engine.load(tiny_artifact, speculative=SpeculativeConfig("draft", draft=draft))
    r = optc("run", tiny_artifact, "--prompt", "hi", "--speculative", f"draft:{draft}")
    assert r.exit_code == 2 and r.output.startswith("error: draft") and len(r.output.splitlines()) == 1, r.output


@pytest.mark.parametrize(
    "value, needle",
    [("ngram:0", "1..16, got 0"), ("ngram:17", "1..16, got 17"), ("medusa:3", "unknown speculative method 'medusa'"),
     ("draft:/nonexistent/x", "/nonexistent/x does not exist")],
)
def test_bad_speculative_option(tiny_artifact, value, needle):
    for command in (["run", tiny_artifact, "--prompt", "hi"], ["bench", tiny_artifact, "--num-requests", "1"]):
        r = optc(*command, "--speculative", value)
        assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output, r.output


def test_cli_run_and_bench(tmp_path, tiny_artifact, tiny_draft):
    plain = json.loads(optc("run", tiny_artifact, "--prompt", PROMPTS[2], "--max-tokens", "20", "--json").output)
    for value in ("ngram:3", f"draft:{tiny_draft}:2"):
        r = optc("run", tiny_artifact, "--prompt", PROMPTS[2], "--max-tokens", "20", "--json", "--speculative", value)
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["token_ids"] == plain["token_ids"]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps({"prompt": p, "output_len": 20 + i}) for i, p in enumerate(PROMPTS[:3])))
    r = optc("bench", tiny_artifact, "--num-requests", "3", "--dataset", dataset, "--speculative", "ngram", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["num_output_tokens"] == 20 + 21 + 22 and res["speculative"] == "ngram:4"
    assert res["num_draft_tokens"] >= res["num_accepted_tokens"] > 0 and res["num_drafts"] > 0
    assert sum(res["num_accepted_tokens_per_position"]) == res["num_accepted_tokens"]
    assert res["spec_acceptance_rate"] == res["num_accepted_tokens"] / res["num_draft_tokens"]
    assert res["spec_mean_acceptance_length"] == 1 + res["num_accepted_tokens"] / res["num_drafts"]
    dataset.write_text('{"prompt": "x", "output_len": 0}\n')
    r = optc("bench", tiny_artifact, "--num-requests", "1", "--dataset", dataset)
    assert r.exit_code == 2 and f"{dataset}:1: output_len must be an integer >= 1, got 0" in r.output, r.output
