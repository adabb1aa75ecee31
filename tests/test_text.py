"""Incremental detokenization: streamed deltas add up to exactly the one-shot decode, at a cost
linear in the output length; stop strings are found in the new text only."""

import pytest
from transformers import AutoTokenizer

from optc.runtime.text import IncrementalDetokenizer, find_stop, held_back

TEXT = ("Grüße, 世界! Déjà vu 🙂🚀 — naïve café, 東京タワー and 👩‍👩‍👧 emoji; "
        "code: def f(x): return x ** 2  # ∑ ∫ √\n") * 40


def stream(tokenizer, token_ids: list[int]) -> tuple[list[str], IncrementalDetokenizer]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.step(token_ids[:n], final=n == len(token_ids)) for n in range(1, len(token_ids) + 1)]
    return deltas, detokenizer


def check_stream(tokenizer) -> None:
    ids = tokenizer(TEXT)["input_ids"][:2000]
    assert len(ids) == 2000
    deltas, detokenizer = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas[:-1])  # never half a character
    assert detokenizer.num_decoded_tokens <= 8 * len(ids)  # O(output), not O(output²)


def test_byte_tokenizer_splits_characters_and_the_stream_still_matches(tiny_artifact):
    check_stream(AutoTokenizer.from_pretrained(tiny_artifact / "tokenizer"))


@pytest.mark.slow
def test_smollm2_tokenizer_stream_matches_one_shot_decode(smollm2_hf_dir):
    check_stream(AutoTokenizer.from_pretrained(smollm2_hf_dir))


def test_special_tokens_are_skipped_like_a_one_shot_decode(smollm2_hf_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    ids = tokenizer("Hello there")["input_ids"] + [tokenizer.eos_token_id] + tokenizer(" again")["input_ids"]
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == "Hello there again"


def test_find_stop_looks_only_at_the_new_text_and_its_overlap():
    assert find_stop("abcSTOPxyz", 3, ["STOP"]) is None  # ended before the new text: found earlier
    assert find_stop("abcSTO", 2, ["STOP"]) is None
    assert find_stop("abcSTOP", 1, ["STOP"]) == 3  # straddles the boundary
    assert find_stop("a,b;c", 3, [";", ","]) == 3  # the earliest among those in the new text
    assert find_stop("anything", 8, []) is None


def test_held_back_keeps_only_a_possible_stop_prefix():
    assert held_back("hello wor", ["world", "x"]) == 3
    assert held_back("hello w", ["world"]) == 1
    assert held_back("hello", ["world"]) == 0
    assert held_back("ab", ["abc", "bcd"]) == 2
    assert held_back("text", []) == 0
