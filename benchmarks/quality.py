"""Quality of SmolLM2-135M-Instruct under each weight quantization, on held-out pydoc text.

For fp32, int8 (RTN per channel), and int4 group 64 with RTN, AWQ and GPTQ (zero points): perplexity,
KL divergence from fp32 and top-1 agreement with fp32 (optc.commands.eval: consecutive 512-token windows of
`builtin:pydoc-heldout`), and the quantization pass's wall time. Calibration: 32 windows × 128 tokens
of `builtin:pydoc` (seed 0). Everything runs in float32 on the CPU reference kernels.

    python benchmarks/quality.py [--max-tokens 100000] [--json out.json] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from optc.commands.eval import Loaded, evaluate
from optc.frontend.calibration import calibration_batch
from optc.frontend.passmanager import PassContext, PassManager
from optc.frontend.sources import load_source
from optc.testing import smollm2_hf_checkpoint

CONFIGS = {
    "fp32": [],
    "int8": [("quantize_rtn", {"bits": 8})],
    "rtn-int4-g64": [("quantize_rtn", {"bits": 4, "group_size": 64})],
    "awq-int4-g64": [("quantize_awq", {"bits": 4, "group_size": 64})],
    "gptq-int4-g64": [("quantize_gptq", {"bits": 4, "group_size": 64})],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=100_000)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--only", nargs="*", default=list(CONFIGS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = smollm2_hf_checkpoint()
    source = load_source(str(path))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokens, sha = calibration_batch("builtin:pydoc", tokenizer, 32, 128, 0)
    base = [("cast", {"dtype": "float32"}), ("fuse_qkv", {}), ("fuse_gate_up", {})]
    ctx = PassContext(dtype="float32", calibration_tokens=lambda: tokens)
    ref_graph, ref_store, _, _ = PassManager(base).run(source.graph, source.store, ctx)
    reference = Loaded(ref_graph, ref_store, tokenizer)
    rows = []
    for name in args.only:
        t0 = time.perf_counter()
        graph, store, records, _ = PassManager(CONFIGS[name]).run(ref_graph, ref_store, ctx)
        seconds = time.perf_counter() - t0
        q = evaluate(Loaded(graph, store, tokenizer), reference, max_tokens=args.max_tokens)
        rows.append({"config": name, "ppl": q["ppl"], "kld": q["kld"], "top1": q["top1_agreement"],
                     "pass_seconds": round(seconds, 2), "tokens": q["tokens"], "reference_ppl": q["reference_ppl"]})
        r = rows[-1]
        print(f"{name:>14}  ppl {r['ppl']:8.3f} ({100 * (r['ppl'] / r['reference_ppl'] - 1):+6.2f}%)  "
              f"KL {r['kld']:.4f}  top-1 {100 * r['top1']:5.1f}%  pass {seconds:6.1f}s", flush=True)
    print(f"tokens scored: {rows[0]['tokens']} (512-token windows), calibration sha256 {sha[:12]}, "
          f"threads {torch.get_num_threads()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "calibration_sha256": sha, "threads": torch.get_num_threads()}, f, indent=1)


if __name__ == "__main__":
    main()
