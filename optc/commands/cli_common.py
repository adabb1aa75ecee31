"""What the command-line entries share (optc.cli and the commands that declare their own options,
`run` and `serve`): the `--speculative` help, reading the text file an option names, and the
user-error exit: a `optc.core.errors.UserError` prints one line and exits 2 (with its traceback when
OPTC_TRACEBACK=1, which `--traceback` sets); any other exception propagates as a bug.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from optc.core.errors import UserError

SPECULATIVE_HELP = (
    "Speculative decoding: ngram[:K] (prompt lookup), draft:PATH[:K] (a draft artifact with the same "
    "tokenizer, e.g. an int4 build of the model), eagle[:K] (the artifact's own draft head, trained at build "
    "time by the train_draft_head pass or imported from an EAGLE-1 checkpoint by import_draft_head) or "
    "eagle-tree:D:TOPK:NODES (that head drafting a tree: each depth's TOPK most probable nodes get their TOPK "
    "most probable children, down to depth D, and the NODES (1..63) most probable nodes are verified in one "
    "target forward); K, D = draft tokens per step, 1..16, default 4. A step where a tree cannot run (a "
    "tensor-parallel or CUDA-graph target, sliding-window or MLA attention, a kernel without the tree mask) "
    "drafts a chain of D. Default: the artifact's runtime.speculative, else off."
)


def read_text(path: Path, option: str) -> str:
    """A text file an option names; a UserError naming the option when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{option} {path}: cannot read it ({type(e).__name__}: {e})") from None


@contextmanager
def user_errors() -> Iterator[None]:
    """One line and exit 2 for a UserError (with its traceback under --traceback); bugs propagate."""
    try:
        yield
    except UserError as e:
        if os.environ.get("OPTC_TRACEBACK") == "1":
            traceback.print_exc()
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        typer.echo(f"error: {msg}", err=True)
        raise typer.Exit(2) from None
