"""Serving throughput: continuous batching against one request at a time, and against transformers.

CPU (`--device cpu`): SmolLM2-135M-Instruct from the packaged GGUF (recipes/smollm2-bf16.yaml with
`dtype` set by `--cpu-dtype`), 32 requests x 128 prompt / 64 output tokens (greedy, EOS ignored),
served with `max_num_seqs=32` (continuous batching) and with `max_num_seqs=1`; transformers
`generate` on the same GGUF and the same token ids in batches of 32 (`--compare-hf`). Issue 5's
acceptance: continuous batching gives >= 4x the output tokens/s of one request at a time.

CUDA (`--device cuda`): `random:llama-3-8b` built for target cuda in bf16 and in int4 (RTN, group
128; `int4tg`: the same with torch's tinygemm bound instead of the Triton w4a16 kernel), or in fp8
(`fp8`: weight-only, the Triton fp8 W8A16 kernel; `fp8w8a8`: dynamic per-token activations, torch._scaled_mm), with
select_kernels and cuda_graphs; batch 1 (4 requests, max_num_seqs 1) and batch 64 (64
requests); bf16 also with `--eager` (no CUDA graphs), and transformers (`torch.compile`,
static cache) on a LlamaForCausalLM rebuilt from the bf16 artifact's weights at both batch sizes.
The int4 rows are compared with that bf16 transformers run (the same weights before quantization)
when both run in one process. `--configs`, `--batch-sizes` and `--no-eager` pick a subset, so the
runs fit in device calls of 10 minutes (benchmarks/gpu_session.sh).

Artifacts are built once under `--work` and reused; `--skip-verify-built` loads an artifact this run
has just built without re-hashing its files (15 GB of sha256 for the 8B bf16 build; every other load
is verified). Each row is appended to `--jsonl` the moment it is measured (benchmarks/results.py), so
a run killed at a time limit keeps what it finished; the table is printed from the rows, and
`python benchmarks/results.py table FILE.jsonl ...` rebuilds it from any number of runs (int4 and
eager rows then get their optc/HF ratio from a bf16 transformers row of the same batch size, whichever
run measured it). `--json` writes every row with the environment (load average, threads, versions)
at the end. Measures only; asserts nothing.

    python benchmarks/serving.py --device cpu --threads 1 --json build/serving-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import torch
from results import Rows

from optc.commands.bench import BenchOptions, run_bench

REPO = Path(__file__).resolve().parents[1]
# bfloat16 measured 2.0x faster than float32 on the dev CPU (Xeon with AMX-BF16 and AVX512-BF16: the
# matmuls, most of the time, take oneDNN's bf16 kernels and move half the bytes; 8 requests x 128/16
# tokens, 1 thread: 65.1 against 32.9 output tok/s). On a CPU without bf16 units pass float32.
DEFAULT_CPU_DTYPE = "bfloat16"
CUDA_PASSES = "fuse_qkv, fuse_gate_up, {quant}kv_layout, fuse_add_rmsnorm, fuse_rope_kv, {select}, cuda_graphs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--work", type=Path, default=REPO / "build" / "bench-serving", help="artifacts are built here")
    p.add_argument("--json", type=Path, default=None, help="write the results here (at the end)")
    p.add_argument("--jsonl", type=Path, default=None,
                   help="append each row here as one JSON line the moment it is measured (survives a kill)")
    p.add_argument("--skip-verify-built", action="store_true",
                   help="load an artifact this run has just built without re-hashing its files (default: "
                        "every load verifies sha256)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--cpu-dtype", choices=("float32", "bfloat16"), default=DEFAULT_CPU_DTYPE)
    p.add_argument("--no-compare-hf", action="store_true", help="skip transformers")
    p.add_argument("--configs", default="bf16,int4",
                   help="cuda: which builds, comma-separated, of bf16, int4, int4tg, fp8, fp8w8a8 (default bf16,int4)")
    p.add_argument("--batch-sizes", default="1,64", help="cuda: max_num_seqs values, comma-separated (default 1,64)")
    p.add_argument("--no-eager", action="store_true", help="cuda: skip the --eager (no CUDA graphs) bf16 rows")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    env = {"host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"), "device": _device_name(args.device),
           "threads": torch.get_num_threads(), "load_before": os.getloadavg(), "torch": torch.__version__}
    rows = Rows(args.jsonl)
    runs = _cpu(args, rows) if args.device == "cpu" else _cuda(args, rows)
    env["load_after"] = os.getloadavg()
    print(serving_table(runs))
    load = f"load {env['load_before'][0]:.2f} -> {env['load_after'][0]:.2f}"
    print(f"\n{env['device']}, {env['threads']} threads, {load}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"env": env, "runs": runs}, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")


def _cpu(args, rows: Rows) -> list[dict]:
    artifact, built = _artifact(args.work / f"smollm2-{args.cpu_dtype}", REPO / "recipes" / "smollm2-bf16.yaml",
                                f"dtype={args.cpu_dtype}")
    base = BenchOptions(artifact, num_requests=32, input_len=128, output_len=64, device="cpu",
                        compare_hf=not args.no_compare_hf, show_progress=not args.quiet,
                        verify=not (built and args.skip_verify_built))
    batched = _run(f"smollm2 {args.cpu_dtype}, continuous batching", replace(base, max_num_seqs=32))
    serial = _run(f"smollm2 {args.cpu_dtype}, one at a time", replace(base, max_num_seqs=1, compare_hf=False))
    if "error" not in batched and "error" not in serial:
        batched["speedup_over_serial"] = batched["output_tokens_per_s"] / serial["output_tokens_per_s"]
    for run in (batched, serial):
        rows.append(run)
    return [batched, serial]


INT4 = "{quantize_rtn: {bits: 4, group_size: 128, zero_point: true}}, "
CUDA_QUANT = {"bf16": "", "int4": INT4, "int4tg": INT4, "fp8": "quantize_fp8, ",
              "fp8w8a8": "{quantize_fp8: {activations: dynamic}}, "}
# int4tg: the int4 build with torch's tinygemm (the opt-in torch.int4pack kernel) instead of triton.w4a16
CUDA_SELECT = {"int4tg": "{select_kernels: {enable: [torch.int4pack]}}"}


def cuda_artifact(work: Path, name: str) -> tuple[Path, bool]:
    """The 8B artifact of configuration `name` (CUDA_QUANT) under `work`, built unless it is there;
    and whether this call built it."""
    return _artifact(work / f"llama-3-8b-{name}", cuda_recipe(work, name))


def cuda_recipe(work: Path, name: str) -> Path:
    """The recipe of configuration `name` (CUDA_QUANT), written under `work`."""
    recipe = work / f"llama-3-8b-{name}.yaml"
    recipe.parent.mkdir(parents=True, exist_ok=True)
    passes = CUDA_PASSES.format(quant=CUDA_QUANT[name], select=CUDA_SELECT.get(name, "select_kernels"))
    recipe.write_text(f"model: random:llama-3-8b\ndtype: bfloat16\ntarget: cuda\n"
                      f"passes: [{passes}]\n"
                      "runtime: {max_num_seqs: 64, max_seq_len: 2048, gpu_memory_utilization: 0.85}\n")
    return recipe


def _cuda(args, rows: Rows) -> list[dict]:
    names = args.configs.split(",")
    unknown = sorted(set(names) - set(CUDA_QUANT))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; allowed: {', '.join(CUDA_QUANT)}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    runs = []
    for name in names:
        artifact, built = cuda_artifact(args.work, name)
        for batch in batch_sizes:
            base = BenchOptions(artifact, num_requests=4 if batch == 1 else batch, input_len=128, output_len=128,
                                max_num_seqs=batch, device="cuda", show_progress=not args.quiet,
                                verify=not (built and args.skip_verify_built))
            compare = name == "bf16" and not args.no_compare_hf
            runs.append(_run(f"llama-3-8b {name}, batch {batch}", replace(base, compare_hf=compare)))
            rows.append(runs[-1])
            if name == "bf16" and not args.no_eager:
                runs.append(_run(f"llama-3-8b {name}, batch {batch}, eager", replace(base, eager=True)))
                rows.append(runs[-1])
    return runs


def _artifact(out: Path, recipe: Path, *overrides: str) -> tuple[Path, bool]:
    """The artifact at `out`, built from `recipe` unless one is there; and whether this call built it."""
    if (out / "manifest.json").is_file():
        return out, False
    from optc.testing import build_artifact

    print(f"building {out} ...", flush=True)
    start = time.perf_counter()
    build_artifact(out, recipe, *overrides)
    print(f"built {out} in {time.perf_counter() - start:.0f} s", flush=True)
    return out, True


def _run(label: str, options: BenchOptions) -> dict:
    """One bench run. A failure costs only its own row (and a failing transformers comparison only
    the comparison): a first-contact bug on a new GPU must not lose the other measurements."""
    print(f"== {label}", flush=True)
    try:
        result = run_bench(options).to_json()
    except Exception as exc:
        traceback.print_exc()
        result = {"table": "serving", "label": label, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    if "error" in result:  # outside the except block, whose traceback holds the failed run's memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if not options.compare_hf:
            return result
        print(f"== {label}, again without transformers", flush=True)
        retry = _run(label, replace(options, compare_hf=False))
        return {**retry, "hf_error": result["error"]}
    result["table"] = "serving"
    result["label"] = label
    result["options"] = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()}
    return result


def serving_table(runs: list[dict]) -> str:
    """The table of `runs` (rows of one or several runs). A row without its own transformers run takes
    the optc/HF ratio from a bf16 row's transformers run of the same batch size (the same weights
    before quantization), marked `*`."""
    hf = {r["max_num_seqs"]: r["hf"] for r in runs if "error" not in r and r.get("hf")}
    head = (f"{'run':<44} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'peak MiB':>9} "
            f"{'graphs':>7} {'HF tok/s':>9} {'optc/HF':>8}")
    lines = [head, "-" * len(head)]
    nan = float("nan")
    for r in runs:
        if "error" in r:
            lines.append(f"{r['label']:<44} FAILED {r['error'][:120]}")
            continue
        own = r.get("hf")
        other = hf.get(r["max_num_seqs"])
        ratio = (own["optc_over_hf"] if own else r["output_tokens_per_s"] / other["output_tokens_per_s"] if other
                 else nan)
        hf_tps = (own or other or {"output_tokens_per_s": nan})["output_tokens_per_s"]
        lines.append(
            f"{r['label']:<44} {r['output_tokens_per_s']:>10.1f} {r['ttft_ms']['p50']:>12.1f} "
            f"{r['tpot_ms']['p50']:>12.2f} {r['peak_memory_bytes'] / 2**20:>9.0f} "
            f"{'yes' if r.get('cuda_graphs') else 'no':>7} "
            f"{hf_tps:>9.1f} {ratio:>8.2f}{'' if own or not other else '*'}"
        )
    for r in runs:
        if "speedup_over_serial" in r:
            lines.append(f"\ncontinuous batching / one at a time: {r['speedup_over_serial']:.2f}x output tokens/s "
                         "(acceptance: >= 4x)")
    return "\n".join(lines)


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    return platform.processor() or "cpu"


if __name__ == "__main__":
    main()
