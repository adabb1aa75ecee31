"""Output tokens/s of SmolLM2 (or any artifacts given with --artifact) as f32, bf16, int8, RTN int4, AWQ int4,
GPTQ int4 and kept-GGUF (`source_quantization: keep`) artifacts, as transformers bf16 and as llama.cpp on the GGUF
file the kept-GGUF recipe reads, at batch 1 and 8, on the same prompts, on the CPU; the table names the model and the
CPU capability torch runs (AVX2 or AVX512).

Artifacts come from the repository's recipes (`recipes/smollm2-*.yaml`; f32 is smollm2-bf16.yaml with
dtype=float32), built into `--work` unless already there (`--artifact NAME=PATH` uses another). Every
config is loaded once; then `--rounds` rounds each run every config in turn (A B C ... A B C ...), so
load on the shared machine falls on all of them alike; the table gives the median over rounds and the
ratio to the bf16 artifact's median. One run at batch B = B requests of `--input-len` prompt tokens
(consecutive slices of pydoc text, the same for every config), `--output-len` greedy tokens each, EOS
ignored, all added at once with max_num_seqs = B; tok/s = output tokens / wall time of the run (the
prefill included, as `optc bench`). transformers: a dense model of its family holding the bf16
artifact's weights, `generate` with a static cache (no compile on the CPU), left-padded batches. llama.cpp: the
`llama-cpp-python` package (optional: skipped, saying so, when it does not import; it builds llama.cpp from source,
about 20 minutes on 2 cores, so build its wheel once into a cache: `pip wheel --no-deps -w ~/.cache/optc/wheels
llama-cpp-python==0.3.36`, then `pip install ~/.cache/optc/wheels/llama_cpp_python-*.whl diskcache`) through its
low-level API: the B prompts decoded together as B sequences of one context (llama.cpp's batched decoding),
greedy argmax over the returned logits, the same token ids and thread count as optc.
Prints the load average (1 min) before and after each round. It measures; it asserts nothing.

Two rates per run: wall (output tokens / elapsed seconds) and CPU (output tokens / this process's CPU
seconds, `time.process_time`). On a machine that other jobs load, wall time counts the time the
process waited for a core and CPU time does not; with `--threads 1` the CPU rate is what an idle core
would give (minus cache sharing), with more threads it also counts the threads' spin-waits.

    python benchmarks/quant_speed.py --rounds 3 --json build/quant-speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import yaml

from optc.core.artifact import read_manifest
from optc.frontend.sources import package_file
from optc.runtime import Engine, SamplingParams
from optc.testing import build_artifact

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {  # name -> (recipe, overrides)
    "f32": ("smollm2-bf16.yaml", ("dtype=float32",)),
    "bf16": ("smollm2-bf16.yaml", ()),
    "int8": ("smollm2-int8.yaml", ()),
    "rtn-int4": ("smollm2-rtn.yaml", ()),
    "awq-int4": ("smollm2-awq.yaml", ()),
    "gptq-int4": ("smollm2-gptq.yaml", ()),
    "gguf-keep": ("smollm2-gguf.yaml", ()),  # the GGUF's own Q4_1 / Q8_0 blocks, not requantized
}
HF = "transformers-bf16"
LLAMA_CPP = "llama.cpp"


def prompts(tokenizer, num: int, length: int) -> list[list[int]]:
    """`num` prompts of `length` token ids: consecutive slices of the pydoc topics text."""
    import pydoc_data.topics

    text = " ".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)[:40])
    ids = tokenizer(text)["input_ids"]
    assert len(ids) >= num * length, f"{len(ids)} tokens of text for {num} x {length}"
    return [ids[i * length:(i + 1) * length] for i in range(num)]


def optc_run(engine: Engine, batch: list[list[int]], output_len: int) -> tuple[float, float]:
    """(wall, CPU) output tokens/s of one run of `batch` through the engine."""
    start, cpu = time.perf_counter(), time.process_time()
    out = engine.generate(batch, SamplingParams(max_tokens=output_len, ignore_eos=True))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert all(len(c.token_ids) == output_len for c in out)
    return len(batch) * output_len / elapsed, len(batch) * output_len / cpu


def hf_run(model, batch: list[list[int]], output_len: int) -> tuple[float, float]:
    """(wall, CPU) output tokens/s of one transformers `generate` over `batch` (left-padded, static cache)."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, cache_implementation="static",
                             pad_token_id=0)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    num = (out.shape[1] - width) * len(batch)
    return num / elapsed, num / cpu


def llama_cpp_runner(gguf: Path, threads: int, max_batch: int, max_len: int):
    """A function batch -> (wall, CPU) output tokens/s of llama.cpp greedy-decoding `batch` (lists of token ids)
    from `gguf`, every prompt a sequence of one context; None (printing why) when llama-cpp-python is absent."""
    try:
        import llama_cpp as ll
        import numpy as np
    except ImportError as e:
        print(f"{LLAMA_CPP}: skipped ({e}); see this script's docstring for the cached build", flush=True)
        return None
    quiet = ll.llama_log_callback(lambda level, text, data: None)  # llama.cpp logs every load and graph
    ll.llama_log_set(quiet, None)
    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(str(gguf).encode(), ll.llama_model_default_params())
    params = ll.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = max_batch * max_len
    params.n_seq_max, params.n_threads, params.n_threads_batch = max_batch, threads, threads
    ctx = ll.llama_init_from_model(model, params)
    vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    work = ll.llama_batch_init(max_batch * max_len, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants logits) entries: the argmax of each wanted row."""
        for i, (token, pos, seq, logits) in enumerate(entries):
            work.token[i], work.pos[i], work.n_seq_id[i], work.logits[i] = token, pos, 1, logits
            work.seq_id[i][0] = seq
        work.n_tokens = len(entries)
        if ll.llama_decode(ctx, work) != 0:
            raise RuntimeError(f"llama_decode failed on {len(entries)} tokens")
        return [int(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(vocab,)).argmax())
                for i, e in enumerate(entries) if e[3]]

    def run(batch: list[list[int]], output_len: int, _keep=quiet) -> tuple[float, float]:
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
        start, cpu = time.perf_counter(), time.process_time()
        last = decode([(t, j, s, j == len(p) - 1) for s, p in enumerate(batch) for j, t in enumerate(p)])
        for step in range(output_len - 1):
            last = decode([(t, len(p) + step, s, True) for s, (t, p) in enumerate(zip(last, batch, strict=True))])
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        return len(batch) * output_len / elapsed, len(batch) * output_len / cpu

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=REPO / "build" / "quant-speed", help="where artifacts are built")
    p.add_argument("--artifact", action="append", default=[], metavar="NAME=PATH",
                   help=f"use this artifact for NAME ({', '.join(CONFIGS)} or a new name) instead of a build")
    p.add_argument("--configs", default=",".join([*CONFIGS, HF, LLAMA_CPP]),
                   help="which configs to run, comma-separated")
    p.add_argument("--batches", default="1,8", help="batch sizes (default 1,8)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, the core count)")
    p.add_argument("--node-by-node", action="append", default=[], metavar="NAME=CONFIG",
                   help="also run CONFIG's artifact as NAME with its decoder layers node by node, not as one C++ "
                   "call (kernels/cpu_ext/step.py): the fused step's ablation, in the same rounds")
    p.add_argument("--gguf", default=None, help="llama.cpp's file (a path or package:<pkg>/<file>; default: the "
                   "gguf-keep recipe's model)")
    p.add_argument("--baseline", default="bf16", help="the config the ratio columns divide by (default bf16)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.configs.split(",")
    given = dict(a.split("=", 1) for a in args.artifact)
    unknown = [n for n in names if n not in CONFIGS and n not in given and n not in (HF, LLAMA_CPP)]
    if unknown:
        p.error(f"--configs: unknown {', '.join(unknown)}; known: {', '.join([*CONFIGS, HF, LLAMA_CPP])}, or a NAME "
                "given by "
                "--artifact NAME=PATH")
    paths = {}
    for name in [n for n in names if n in CONFIGS or n in given]:
        if name in given:
            paths[name] = Path(given[name])
            continue
        recipe, overrides = CONFIGS[name]
        paths[name] = args.work / name
        if not (paths[name] / "manifest.json").exists():
            print(f"building {name} from {recipe}", flush=True)
            build_artifact(paths[name], REPO / "recipes" / recipe, *overrides)
    batches = [int(b) for b in args.batches.split(",")]
    engines = {n: Engine.load(paths[n], max_num_seqs=max(batches), enable_prefix_caching=False) for n in paths}
    for name, config in (a.split("=", 1) for a in args.node_by_node):
        engines[name] = Engine.load(paths[config], max_num_seqs=max(batches), enable_prefix_caching=False)
        engines[name].model.executor.unfuse()
    tokenizer = next(iter(engines.values())).tokenizer
    runs = {}
    if HF in names:
        from optc.frontend.models import hf_model_from_artifact

        bf16 = paths.get("bf16") or Path(given["bf16"])
        model = hf_model_from_artifact(bf16, torch.device("cpu"), torch.bfloat16)
        model.generation_config.disable_compile = True
        runs[HF] = lambda batch: hf_run(model, batch, args.output_len)
    for n, engine in engines.items():
        runs[n] = lambda batch, e=engine: optc_run(e, batch, args.output_len)
    if LLAMA_CPP in names:
        spec = args.gguf or yaml.safe_load((REPO / "recipes" / CONFIGS["gguf-keep"][0]).read_text())["model"]
        gguf = package_file(spec) if spec.startswith("package:") else Path(spec)
        run = llama_cpp_runner(gguf, torch.get_num_threads(), max(batches), args.input_len + args.output_len)
        if run is not None:
            runs[LLAMA_CPP] = lambda batch, r=run: r(batch, args.output_len)
    work = {b: prompts(tokenizer, b, args.input_len) for b in batches}
    for b in batches:  # warm-up: first calls, prepared layouts
        for run in runs.values():
            run(work[b][:1] if b == batches[0] else work[b])
    results: dict[int, dict[str, list[tuple[float, float]]]] = {b: {n: [] for n in runs} for b in batches}
    loads = []
    for r in range(args.rounds):
        for b in batches:
            before = os.getloadavg()[0]
            for n, run in runs.items():
                results[b][n].append(run(work[b]))
            loads.append((before, os.getloadavg()[0]))
            print(f"round {r + 1} batch {b}: load {before:.2f} -> {loads[-1][1]:.2f}; "
                  + ", ".join(f"{n} {v[-1][0]:.1f} ({v[-1][1]:.1f} cpu)" for n, v in results[b].items()), flush=True)
    source = read_manifest(next(iter(paths.values()))).source
    model = source.get("id") or Path(source.get("path", "?")).name
    print(f"\n{model}, CPU ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, "
          f"{args.input_len} prompt + {args.output_len} output tokens per request, {args.rounds} rounds, "
          f"load average {min(x for x, _ in loads):.2f}-{max(y for _, y in loads):.2f}")
    vs = f"vs {args.baseline}"
    print("| config | " + " | ".join(f"batch {b} tok/s | {vs} | CPU tok/s | {vs}" for b in batches) + " |")
    print("|---|" + "---:|---:|---:|---:|" * len(batches))
    summary = {}
    for n in runs:
        cells = []
        for b in batches:
            entry = summary.setdefault(n, {}).setdefault(b, {"runs": results[b][n]})
            for i, what in enumerate(("wall", "cpu")):
                med = statistics.median(r[i] for r in results[b][n])
                base = (statistics.median(r[i] for r in results[b][args.baseline]) if args.baseline in runs
                        else float("nan"))
                cells += [f"{med:.1f}", f"{med / base:.2f}x"]
                entry[what] = {"median": med, f"vs_{args.baseline}": med / base}
        print(f"| {n} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**_machine(), "threads": torch.get_num_threads(), "input_len": args.input_len,
                                         "output_len": args.output_len, "loads": loads, "results": summary,
                                         "artifacts": {n: str(p) for n, p in paths.items()}}, indent=1))


def _machine() -> dict:
    """Where and when the run was: the CPU's model name, torch's ISA, the repository's commit, the UTC time."""
    import platform
    import subprocess

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else "?"
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {"cpu": cpu, "isa": torch.backends.cpu.get_cpu_capability(), "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count()}


if __name__ == "__main__":
    main()
