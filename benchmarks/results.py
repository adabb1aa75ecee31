"""Benchmark rows as JSON lines, written the moment they exist; tables are rebuilt from the lines.

A GPU stage runs under a hard time limit (benchmarks/gpu_session.sh). A script that keeps its rows in
memory and writes them at the end loses all of them when it is killed; one that appends each row as a
line, flushed and synced, loses only the row it was measuring. `read` skips a last line cut off
mid-write. The table of a run is printed from the lines, so a stage that was killed still prints the
table of what it finished:

    python benchmarks/results.py table build/gpu-session/bf16-b1.jsonl [more.jsonl ...]
    python benchmarks/results.py fake --jsonl rows.jsonl --rows 100 --interval 0.5   # gpu_session.sh's self-test

Every row names the table it belongs to (`"table": "serving" | "kernels" | "fake"`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


class Rows:
    """Appends rows to a JSON-lines file: one line per row, flushed and fsynced before `append` returns."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, row: dict[str, Any]) -> None:
        if self.path is None:
            return
        line = json.dumps(row, default=str)
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


def read(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file; a line cut off by a kill mid-write (not valid JSON) is skipped."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The tables of `rows`, one per kind, in the order the kinds first appear."""
    kinds = list(dict.fromkeys(r.get("table", "fake") for r in rows))
    parts = []
    for kind in kinds:
        these = [r for r in rows if r.get("table", "fake") == kind]
        if kind == "serving":
            from serving import serving_table

            parts.append(serving_table(these))
        elif kind == "kernels":
            from kernels import kernels_table

            parts.append(kernels_table(these))
        else:
            parts.append("\n".join(f"{r.get('label', '?')}: {r.get('value')}" for r in these))
    return "\n\n".join(parts)


def _fake(path: Path, num_rows: int, interval: float) -> None:
    """A stand-in measurement loop (the plan's self-test): one row per `interval` seconds."""
    out = Rows(path)
    for i in range(num_rows):
        time.sleep(interval)
        out.append({"table": "fake", "label": f"row {i}", "value": i})
        print(f"row {i}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("table", help="print the tables rebuilt from JSON-lines files")
    t.add_argument("files", nargs="+", type=Path)
    f = sub.add_parser("fake", help="write a row every --interval seconds (gpu_session.sh's self-test stage)")
    f.add_argument("--jsonl", type=Path, required=True, help="append the rows here")
    f.add_argument("--rows", type=int, default=100, help="how many rows (default 100)")
    f.add_argument("--interval", type=float, default=0.5, help="seconds before each row (default 0.5)")
    args = ap.parse_args(argv)
    if args.command == "fake":
        _fake(args.jsonl, args.rows, args.interval)
        return 0
    rows = [r for path in args.files if path.is_file() for r in read(path)]
    missing = [str(p) for p in args.files if not p.is_file()]
    print(table(rows) if rows else "no rows")
    if missing:
        print(f"(no file: {', '.join(missing)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
