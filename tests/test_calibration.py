"""Calibration text sources and seeded token windows."""

import hashlib
import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from optc.core.errors import InputError
from optc.frontend.calibration import calibration_batch, encode, load_text, pydoc_text


def _word_tokenizer(text):
    vocab = {w: i for i, w in enumerate(sorted(set(text.split())) + ["[UNK]"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


class _CallableTokenizer:  # the transformers calling convention
    def __call__(self, text, add_special_tokens=False, verbose=False):
        return {"input_ids": [len(w) for w in text.split()]}


def test_pydoc_split_is_deterministic_and_at_a_paragraph():
    from pydoc_data.topics import topics

    full = "\n\n".join(topics[k] for k in sorted(topics))
    cal, held = pydoc_text("calibration"), pydoc_text("heldout")
    assert cal + "\n\n" + held == full
    assert 0.9 <= len(cal) / len(full) < 0.91
    assert load_text("builtin:pydoc") == cal and load_text("builtin:pydoc-heldout") == held
    with pytest.raises(ValueError, match="allowed: 'calibration', 'heldout'"):
        pydoc_text("train")


def test_windows_are_seeded_slices_of_the_token_stream(tmp_path):
    text = " ".join(f"w{i}" for i in range(1000))
    path = tmp_path / "a.txt"
    path.write_text(text)
    tok = _word_tokenizer(text)
    ids, digest = calibration_batch(str(path), tok, samples=4, seq_len=16, seed=3)
    assert ids.shape == (4, 16) and ids.dtype == torch.int64
    assert digest == hashlib.sha256(text.encode()).hexdigest()
    stream = torch.tensor(encode(tok, text))
    starts = torch.randint(0, 1000 - 16 + 1, (4,), generator=torch.Generator().manual_seed(3))
    for row, start in zip(ids, starts, strict=True):
        assert torch.equal(row, stream[start:start + 16])
    again, _ = calibration_batch(str(path), tok, samples=4, seq_len=16, seed=3)
    other, _ = calibration_batch(str(path), tok, samples=4, seq_len=16, seed=4)
    assert torch.equal(ids, again) and not torch.equal(ids, other)


def test_jsonl_and_transformers_style_tokenizer(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["ab cde", "f ghij"])) + "\n")
    assert load_text(str(path)) == "ab cde\n\nf ghij"
    ids, _ = calibration_batch(str(path), _CallableTokenizer(), samples=1, seq_len=4, seed=0)
    assert ids.tolist() == [[2, 3, 1, 4]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .* string 'text' field"):
        load_text(str(bad))


def test_errors_say_what_is_allowed(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(InputError, match=r"nope.txt' does not exist; allowed: builtin:pydoc"):
        load_text(str(missing))
    with pytest.raises(ValueError, match="is not recognized; allowed"):
        load_text("corpus.csv")
    with pytest.raises(ValueError, match="unknown builtin text source 'builtin:wiki'"):
        load_text("builtin:wiki")
    path = tmp_path / "short.txt"
    path.write_text("one two three four five")
    with pytest.raises(ValueError, match=r"has 5 tokens, fewer than samples × seq_len = 2 × 3 = 6"):
        calibration_batch(str(path), _word_tokenizer("one two three four five"), samples=2, seq_len=3, seed=0)


def test_hf_source_without_hub_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="needs the `datasets` package|could not load dataset"):
        load_text("hf:nonexistent-org/nonexistent-dataset")
    with pytest.raises(ValueError, match="expected hf:NAME"):
        load_text("hf:")
