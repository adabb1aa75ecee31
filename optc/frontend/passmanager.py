"""The pass contract and the PassManager.

A pass is one class in one file of `passes/`, a subclass of `Pass`: its `name` is the file stem, it
may declare an `Options` frozen dataclass (its recipe options) and override `requires(graph)` and
`ensures(graph)`, and it implements `run(graph, store, ctx) -> PassResult`. Passes return new
objects rather than mutating their inputs, and a second run of the same pass reports `changed=False`.

The manager runs the recipe's ordered list, times each pass, verifies after each on request, dumps
the IR after each (`dump_ir`), prints a progress line per pass, and on failure names the failing
pass and the ones before it: a user error (`UserError`, e.g. a group size that does not divide a
weight) becomes a PassError (a UserError too) whose message says where; any other exception is a
bug and propagates as it is, with the same words added as a note to its traceback.
"""

from __future__ import annotations

import importlib
import pkgutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from optc.core.artifact import peak_rss_bytes
from optc.core.errors import UserError
from optc.core.ir import Graph
from optc.core.ops import verify
from optc.core.store import TensorStore


class PassError(UserError):
    """A user error raised inside a pass, with the pass named."""


@dataclass
class PassResult:
    graph: Graph
    store: TensorStore
    changed: bool
    stats: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)  # sections for manifest.json (e.g. quantization)


@dataclass
class PassContext:
    """What passes may need, and nothing else."""

    target: str = "cpu"
    dtype: str = "float32"
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))
    progress: Callable[[str], None] = lambda msg: None
    show_progress_bars: bool = False
    calibration_tokens: Callable[[], torch.Tensor] | None = None  # (samples, seq_len) int64, computed once
    calibration_record: dict[str, Any] = field(default_factory=dict)
    tokenizer: Callable[[], Any] | None = None  # the model's transformers tokenizer, loaded once (train_draft_head)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where calibration passes compute


class Pass:
    """The base of every pass: what a pass file does not have to say.

    `name` is the stem of the pass's file (passes/cast.py -> "cast"); `Options` (the recipe options)
    is empty unless the pass declares its own frozen dataclass; `requires` and `ensures` check nothing
    unless the pass overrides them. A pass implements `run`.
    """

    name: ClassVar[str] = ""

    @dataclass(frozen=True)
    class Options:
        pass

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = cls.__module__.rsplit(".", 1)[-1]

    def __init__(self, options: Any = None):
        self.options = options if options is not None else self.Options()

    def requires(self, graph: Graph) -> None:
        """Raise when the input graph is not one this pass can run on."""

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        raise NotImplementedError(f"{type(self).__name__} does not implement run")

    def ensures(self, graph: Graph) -> None:
        """Raise when the output graph breaks what this pass promises."""


@dataclass
class PassRecord:
    name: str
    options: dict[str, Any]
    changed: bool
    stats: dict[str, Any]
    seconds: float
    peak_rss_bytes: int | None


def registry() -> dict[str, type]:
    """Pass name -> class, discovered from the modules of optc.passes (files starting with _ are helpers)."""
    import optc.passes as pkg

    found = {}
    for m in pkgutil.iter_modules(pkg.__path__):
        if m.name.startswith("_"):
            continue
        module = importlib.import_module(f"optc.passes.{m.name}")
        cls = next((c for c in vars(module).values()
                    if isinstance(c, type) and issubclass(c, Pass) and c.__module__ == module.__name__), None)
        if cls is None:
            raise ImportError(f"passes/{m.name}.py defines no subclass of optc.frontend.passmanager.Pass")
        found[m.name] = cls
    return found


def make_pass(name: str, options: dict[str, Any] | None = None):
    cls = registry()[name]
    return cls(cls.Options(**(options or {})))


class PassManager:
    def __init__(self, passes: list[tuple[str, dict]], verify_each: bool = False, dump_ir: Path | None = None):
        self.passes = [make_pass(n, o) for n, o in passes]
        self.specs = passes
        self.verify_each = verify_each
        self.dump_ir = Path(dump_ir) if dump_ir else None

    def run(
        self, graph: Graph, store: TensorStore, ctx: PassContext
    ) -> tuple[Graph, TensorStore, list[PassRecord], dict]:
        records: list[PassRecord] = []
        manifest: dict[str, Any] = {}
        if self.dump_ir:
            self.dump_ir.mkdir(parents=True, exist_ok=True)
            (self.dump_ir / "00-input.txt").write_text(graph.text())
        total = len(self.passes)
        for i, (p, (name, options)) in enumerate(zip(self.passes, self.specs, strict=True)):
            ctx.progress(f"[{i + 1}/{total}] {name} ...")
            t0 = time.perf_counter()
            try:
                p.requires(graph)
                result = p.run(graph, store, ctx)
                p.ensures(result.graph)
                if self.verify_each:
                    verify(result.graph, result.store)
            except Exception as e:
                before = ", ".join(n for n, _ in self.specs[:i]) or "none"
                where = f"pass {name!r} (#{i + 1} of {total}; passes before it: {before}) failed"
                if isinstance(e, UserError):
                    raise PassError(f"{where}: {e}") from e
                e.add_note(where)
                raise
            seconds = time.perf_counter() - t0
            graph, store = result.graph, result.store
            manifest.update(result.manifest)
            records.append(PassRecord(name, options, result.changed, result.stats, seconds, peak_rss_bytes()))
            ctx.progress(
                f"[{i + 1}/{total}] {name}: {'changed' if result.changed else 'no change'} "
                f"{_short(result.stats)} ({seconds:.2f}s)"
            )
            if self.dump_ir:
                (self.dump_ir / f"{i + 1:02d}-{name}.txt").write_text(graph.text())
        return graph, store, records, manifest


def _short(stats: dict) -> str:
    items = [f"{k}={v}" for k, v in stats.items() if isinstance(v, int | float | str | bool)]
    return ", ".join(items[:4])
