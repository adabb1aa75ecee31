"""`optc export` on SmolLM2-135M-Instruct: export time and file sizes per weight format and flavor, and
batch-1 decode speed on the CPU in ONNX Runtime next to the optc runtime (`optc run`'s Engine) on the
same artifact.

Artifacts (built once under --work, from the GGUF converted once by optc.testing): fp32
(recipes/smollm2-bf16.yaml with dtype=float32), int8
(recipes/smollm2-int8.yaml), int4 with zero points (recipes/smollm2-rtn.yaml, ort flavor) and symmetric
int4 (recipes/smollm2-rtn-sym.yaml, both flavors). Decode tok/s = new tokens / (time to generate
1 + N tokens - time to generate 1 token) after a --prompt-len token prompt, greedy, EOS ignored, the
best of --repeats; both runtimes get the same thread count. ONNX Runtime runs twice: with
session.qdq_matmulnbits_accuracy_level=1 (float32 activations, what the parity tests pin) and with
its defaults (int8 activations where it fuses DequantizeLinear + MatMul into MatMulNBits).

    python benchmarks/export_onnx.py [--threads 1] [--new-tokens 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from optc.commands.export import ExportOptions, Flavor, export
from optc.commands.export.onnxrt import greedy_generate, session
from optc.runtime import Engine, SamplingParams
from optc.testing import build_artifact, smollm2_hf_checkpoint

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = {  # name -> (recipe, overrides, flavors)
    "fp32": ("smollm2-bf16.yaml", ("dtype=float32",), (Flavor.ORT, Flavor.PORTABLE)),
    "int8": ("smollm2-int8.yaml", ("dtype=float32",), (Flavor.ORT, Flavor.PORTABLE)),
    "int4-zp-g64": ("smollm2-rtn.yaml", ("dtype=float32",), (Flavor.ORT,)),
    "int4-sym-g64": ("smollm2-rtn-sym.yaml", (), (Flavor.ORT, Flavor.PORTABLE)),
}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_tok_s(generate, new_tokens: int, repeats: int) -> float:
    """new_tokens / (t(1 + new_tokens) - t(1)), best of `repeats`."""
    best = float("inf")
    for _ in range(repeats):
        best = min(best, timed(lambda: generate(1 + new_tokens)) - timed(lambda: generate(1)))
    return new_tokens / best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=REPO / "build" / "bench-export")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=list(ARTIFACTS))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    rows = []
    for name in args.only:
        recipe, overrides, flavors = ARTIFACTS[name]
        artifact = args.work / name
        if not artifact.is_dir():
            build_artifact(artifact, REPO / "recipes" / recipe, *overrides, model=str(smollm2_hf_checkpoint()))
        engine = Engine.load(artifact)
        prompt = list(torch.randint(0, engine.model.vocab_size, (args.prompt_len,),
                                    generator=torch.Generator().manual_seed(0)).tolist())
        optc_tok_s = decode_tok_s(
            lambda n, e=engine, p=prompt: e.generate([p], SamplingParams(max_tokens=n, ignore_eos=True)),
            args.new_tokens, args.repeats)
        artifact_bytes = sum(f.stat().st_size for f in artifact.glob("weights-*.safetensors"))
        for flavor in flavors:
            out = args.work / f"{name}-{flavor}"
            result = export(ExportOptions(artifact, out, flavor=flavor, force=True, quiet=True))
            sess = session(out, num_threads=args.threads)
            cfg = engine.model.graph.config
            ort_tok_s = decode_tok_s(lambda n, s=sess, c=cfg, p=prompt: greedy_generate(s, c, p, n), args.new_tokens,
                                     args.repeats)
            # ONNX Runtime's own default: int8 activations in the MatMulNBits it fuses from DequantizeLinear + MatMul
            default = session(out, num_threads=args.threads, config={})
            ort_default_tok_s = decode_tok_s(lambda n, s=default, c=cfg, p=prompt: greedy_generate(s, c, p, n),
                                             args.new_tokens, args.repeats)
            rows.append({
                "weights": name, "flavor": flavor.value, "export_s": round(result.seconds, 1),
                "onnx_mib": round((result.files["model.onnx"] + result.files["model.onnx.data"]) / 2**20, 1),
                "artifact_weights_mib": round(artifact_bytes / 2**20, 1),
                "ort_decode_tok_s": round(ort_tok_s, 1), "ort_default_decode_tok_s": round(ort_default_tok_s, 1),
                "optc_decode_tok_s": round(optc_tok_s, 1),
            })
            print(rows[-1], flush=True)
    load_after = os.getloadavg()[0]
    print(f"\nthreads {args.threads}, load average {load_before:.2f} before, {load_after:.2f} after")
    print("| weights | flavor | export s | ONNX MiB | artifact weights MiB | ORT decode tok/s (fp32 act.) | "
          "ORT decode tok/s (ORT default) | optc decode tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['weights']} | {r['flavor']} | {r['export_s']} | {r['onnx_mib']} | {r['artifact_weights_mib']} | "
              f"{r['ort_decode_tok_s']} | {r['ort_default_decode_tok_s']} | {r['optc_decode_tok_s']} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "threads": args.threads, "load_before": load_before,
                                         "load_after": load_after}, indent=1) + "\n")


if __name__ == "__main__":
    main()
