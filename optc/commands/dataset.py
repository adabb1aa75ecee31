"""A benchmark's prompt file, as `optc bench` reads it in-process and with --url alike: a text file holds one
prompt per non-empty line (each request gets the command's --output-len); a `.jsonl` file holds one
`{"prompt": TEXT, "output_len": N}` object per line (`output_len` optional, default --output-len). Lines are
cycled to `num_requests`."""

from __future__ import annotations

import json
from pathlib import Path

from optc.core.errors import InputError


def read_dataset(path: str | Path, num_requests: int, output_len: int) -> list[tuple[str, int]]:
    """(prompt text, output length) of each of `num_requests` requests."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--dataset {path} does not exist")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise InputError(f"--dataset {path} has no non-empty lines")
    if path.suffix != ".jsonl":
        records = [(line, output_len) for line in lines]
    else:
        records = [_record(path, number, line, output_len) for number, line in enumerate(lines, 1)]
    return [records[i % len(records)] for i in range(num_requests)]


def _record(path: Path, number: int, line: str, output_len: int) -> tuple[str, int]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}:{number}: not JSON ({e.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise InputError(f"{path}:{number}: expected an object with a string \"prompt\" (and an \"output_len\")")
    length = record.get("output_len", output_len)
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise InputError(f"{path}:{number}: output_len must be an integer >= 1, got {length!r}")
    return record["prompt"], length
