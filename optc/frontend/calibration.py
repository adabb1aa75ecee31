"""Text sources for calibration and evaluation, and seeded token windows drawn from them.

Sources (the `source` string of a recipe's `calibration:` or of `optc eval --data`):
- `builtin:pydoc` / `builtin:pydoc-heldout`: the Python standard library's `pydoc_data.topics`
  (its values joined by a blank line in sorted-key order), split at the first paragraph boundary
  at or after 90% of the characters: the first part calibrates, the rest is held out.
- a path ending in `.txt` (the whole file) or `.jsonl` (the `text` field of every line, joined by
  a blank line).
- `hf:NAME[:CONFIG][:SPLIT]`: a Hugging Face dataset's `text` column (needs `datasets` and a
  reachable hub; split defaults to `train`).

Not here: how the windows are run through a model (that is the passes' and optc.commands.eval's job).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from optc.core.errors import InputError

HELDOUT_FRACTION = 0.1
SOURCES_HELP = ("builtin:pydoc, builtin:pydoc-heldout, a .txt file, a .jsonl file with a 'text' field, "
                "or hf:NAME[:CONFIG][:SPLIT]")


def pydoc_text(part: str = "calibration") -> str:
    """`calibration` (the first ~90%) or `heldout` (the rest) of the pydoc topics text."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    cut = text.find("\n\n", int(len(text) * (1 - HELDOUT_FRACTION)))
    if cut < 0:
        cut = len(text)
    if part == "calibration":
        return text[:cut]
    if part == "heldout":
        return text[cut + 2:]
    raise InputError(f"unknown pydoc part {part!r}; allowed: 'calibration', 'heldout'")


def load_text(source: str) -> str:
    """The text of a source (see the module docstring); errors name the source and what is allowed."""
    if source == "builtin:pydoc":
        return pydoc_text("calibration")
    if source == "builtin:pydoc-heldout":
        return pydoc_text("heldout")
    if source.startswith("builtin:"):
        raise InputError(f"unknown builtin text source {source!r}; allowed: {SOURCES_HELP}")
    if source.startswith("hf:"):
        return _hf_text(source)
    path = Path(source)
    if path.suffix not in (".txt", ".jsonl"):
        raise InputError(f"text source {source!r} is not recognized; allowed: {SOURCES_HELP}")
    if not path.is_file():
        raise InputError(f"text source {str(path)!r} does not exist; allowed: {SOURCES_HELP}")
    if path.suffix == ".txt":
        return path.read_text(encoding="utf-8")
    texts = []
    for num, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise InputError(f"{path}:{num}: every .jsonl line must be an object with a string 'text' field")
        texts.append(record["text"])
    return "\n\n".join(texts)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` without special tokens: a transformers tokenizer or a `tokenizers.Tokenizer`."""
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
        return tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def calibration_batch(source: str, tokenizer, samples: int, seq_len: int,
                      seed: int) -> tuple[torch.Tensor, str]:
    """-> (input_ids (samples, seq_len) int64, sha256 hex of the source text).

    The whole text is tokenized once; window i starts at a uniform random offset in
    [0, num_tokens - seq_len] drawn from torch.Generator seeded with `seed` (windows may overlap).
    """
    if samples < 1 or seq_len < 1:
        raise InputError(f"samples and seq_len must be positive, got {samples} and {seq_len}")
    text = load_text(source)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    ids = torch.tensor(encode(tokenizer, text), dtype=torch.int64)
    if ids.numel() < samples * seq_len:
        raise InputError(f"text source {source!r} has {ids.numel()} tokens, fewer than samples × seq_len = "
                         f"{samples} × {seq_len} = {samples * seq_len}; use fewer samples, shorter windows "
                         "or more text")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len + 1, (samples,), generator=gen)
    return ids[starts[:, None] + torch.arange(seq_len)], digest


def _hf_text(source: str) -> str:
    fields = source[len("hf:"):].split(":")
    if not fields[0] or len(fields) > 3:
        raise InputError(f"bad dataset source {source!r}; expected hf:NAME[:CONFIG][:SPLIT]")
    name, config, split = (fields + [None, None])[:3]
    try:
        import datasets
    except ImportError:
        raise InputError(f"text source {source!r} needs the `datasets` package (pip install datasets); "
                         f"or use one of: {SOURCES_HELP}") from None
    try:
        ds = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as e:  # the hub raises many types: connection, offline mode, missing dataset
        raise InputError(f"could not load dataset {name!r} from the Hugging Face hub "
                         f"({type(e).__name__}: {e}); is the hub reachable? "
                         f"Otherwise use one of: {SOURCES_HELP}") from None
    if "text" not in ds.column_names:
        raise InputError(f"dataset {name!r} has no 'text' column; columns: {ds.column_names}")
    return "\n\n".join(t for t in ds["text"] if t)
