"""Speculative decoding on SmolLM2: speculation off vs `ngram` vs `draft` (an int4 RTN build of the same
checkpoint) vs `eagle` (the target artifact's own draft head, recipes/smollm2-eagle.yaml) vs its draft trees
(`--eagle-trees D:TOPK:NODES,...`), in one
process, each batch of a workload run by every config in turn so that the ratios share the machine's load.

Workloads (greedy, chat template, EOS ends a request, at most --output-len tokens):
- grounded: batch 1, input-grounded: repeat / extract / summarize a passage of `pydoc_data.topics`;
- open: batch 1, open questions with no text to copy from;
- batch32: 32 requests at once, half grounded, half open.

First it measures what the adaptive defaults rest on: the time of one target forward with q query
tokens per request (q = 1, 5) at batch 1, 8, 32 (the cost of verifying k = q - 1 drafts), one
draft-model forward at batch 1 and one EAGLE head step (a one-entry head forward and its logits).
Prints tables and writes JSON (--out).

    python benchmarks/speculative.py --target build/smollm2-eagle --draft build/smollm2-rtn --eagle
"""

from __future__ import annotations

import argparse
import json
import os
import pydoc_data.topics
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from optc.runtime import Engine, SamplingParams
from optc.runtime.batch import ForwardBatch
from optc.runtime.speculative import SpeculativeConfig

TOPICS = ("assert", "for", "with", "import", "try", "while", "lambda", "pass")
TASKS = (
    "Repeat the first two sentences of this text word for word.",
    "Extract every Python keyword mentioned in this text, one per line, exactly as written.",
    "Summarize this text, quoting its key phrases.",
    "Copy the grammar rules from this text.",
)
OPEN = (
    "Write a short story about a robot who learns to paint.",
    "Why is the sky blue? Explain to a child.",
    "Give me three ideas for a birthday party.",
    "What are the benefits of learning a second language?",
    "Describe a walk through a forest in autumn.",
    "How do airplanes stay in the air?",
    "Write a poem about the sea.",
    "What should I cook for dinner tonight?",
)


def grounded_prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        text = pydoc_data.topics.topics[TOPICS[i % len(TOPICS)]][:900]
        out.append(f"{text}\n\n{TASKS[i % len(TASKS)]}")
    return out


def forward_ms(engine: Engine, model, caches, batch_size: int, query_len: int, context: int = 128,
               repeats: int = 3, tree: bool = False) -> float:
    """Fastest of `repeats` timings of one forward: `batch_size` requests, `query_len` new tokens each (`tree`:
    as a draft tree's rows, under the tree mask)."""
    size = engine.config.block_size
    num_blocks = -(-(context + query_len) // size)
    tables = [[1 + (b * num_blocks + j) % (caches[0].data.shape[0] - 1) for j in range(num_blocks)]
              for b in range(batch_size)]
    parents = [list(range(-1, query_len - 2))] * batch_size if tree else None  # a chain: the mask's cost is one
    batch = ForwardBatch.build([[5] * query_len] * batch_size, [context] * batch_size, tables, size,
                               [query_len] * batch_size, tree_parents=parents)
    model.forward(batch, caches)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.forward(batch, caches)
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)  # the least disturbed by other processes on a shared machine


def step_costs(engines: dict[str, Engine]) -> dict:
    """Forward times that the adaptive defaults rest on (token_cost, disable_above_num_requests)."""
    engine = engines["off"]
    caches = engine.model.allocate_kv_caches(32 * 9 + 1, engine.config.block_size)
    out = {"target_ms": {}, "draft_ms": None}
    for batch_size in (1, 8, 32):
        row = {q: forward_ms(engine, engine.model, caches, batch_size, q) for q in (1, 5)}
        out["target_ms"][batch_size] = row
        print(f"  B={batch_size:<3}" + "".join(f"  q={q}: {ms:8.1f} ({ms / row[1]:.2f}x)" for q, ms in row.items()),
              flush=True)
    if "draft" in engines:
        draft = engines["draft"].speculator.proposer.model
        out["draft_ms"] = forward_ms(engine, draft, draft.allocate_kv_caches(20, engine.config.block_size), 1, 1)
    for name in [n for n in engines if n.startswith("tree:")]:  # a verification of the tree's nodes at batch 1
        nodes = engines[name].speculator.config.tree_num_nodes
        out["target_ms"][1][nodes + 1] = forward_ms(engine, engine.model, caches, 1, nodes + 1, tree=True)
        print(f"  B=1    q={nodes + 1}: {out['target_ms'][1][nodes + 1]:8.1f}", flush=True)
    if "eagle" in engines:
        out["eagle_step_ms"] = eagle_step_ms(engines["eagle"].speculator.proposer.head)
    return out


@torch.inference_mode()
def eagle_step_ms(head, context: int = 128, repeats: int = 20) -> float:
    """Median time of one draft step of the head at batch 1: a one-entry forward over `context` cached
    entries, and its logits."""
    c = head.config
    dtype = head.lm_rows.dtype
    cache = (torch.randn(context, c.num_kv_heads, c.head_dim, dtype=dtype),) * 2
    token, feature, position = torch.tensor([5]), torch.randn(1, c.hidden_size, dtype=dtype), torch.tensor([context])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out, _ = head.forward(token, feature, position, cache)
        head.logits(out).argmax()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(engine: Engine, prompts: list[str], output_len: int) -> dict:
    before = engine.stats()
    params = SamplingParams(max_tokens=output_len)
    requests = [engine.add_request(p, params, chat=True) for p in prompts]
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - start
    after = engine.stats()
    num_output = sum(r.num_output_tokens for r in requests)
    tpot = [(r.finish_time - r.first_token_time) * 1e3 / (r.num_output_tokens - 1)
            for r in requests if r.num_output_tokens > 1]
    drafts = after.num_drafts - before.num_drafts
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {
        "elapsed_s": elapsed, "num_output_tokens": num_output, "output_tokens_per_s": num_output / elapsed,
        "tpot_ms": statistics.mean(tpot) if tpot else float("nan"),
        "num_steps": after.num_steps - before.num_steps, "num_drafts": drafts,
        "spec_acceptance_rate": accepted / drafted if drafted else None,
        "spec_mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "token_ids": [r.output_token_ids for r in requests],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="target artifact (SmolLM2 f32)")
    parser.add_argument("--draft", type=Path, help="draft artifact (int4 RTN SmolLM2); omit to skip `draft`")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=4, help="batch-1 prompts per workload")
    parser.add_argument("--workloads", default="grounded,open,batch32")
    parser.add_argument("--disable-above-num-requests", type=int, help="override the speculation cut-off")
    parser.add_argument("--draft-k", type=int, default=2, help="fixed k of the draft config (adaptive off)")
    parser.add_argument("--draft-workloads", default="grounded,open,batch32",
                        help="workloads the draft runs (on the first batch only; compared with off on the same)")
    parser.add_argument("--eagle", action="store_true", help="also run `eagle` (the target needs a draft head)")
    parser.add_argument("--eagle-k", type=int, default=4, help="k of the eagle config (adaptive on)")
    parser.add_argument("--eagle-trees", default="",
                        help="also run eagle draft trees, comma-separated D:TOPK:NODES (eagle-tree:D:TOPK:NODES)")
    parser.add_argument("--fixed-k", action="store_true", help="eagle and its trees at their full k / depth "
                        "(adaptive off)")
    parser.add_argument("--skip-costs", action="store_true", help="skip the forward-time table")
    parser.add_argument("--out", type=Path, default=Path("speculative.json"))
    args = parser.parse_args()

    extra = {"disable_above_num_requests": args.disable_above_num_requests} if args.disable_above_num_requests else {}
    configs = {"off": None, "ngram": SpeculativeConfig("ngram", **extra)}
    if args.draft:
        configs["draft"] = SpeculativeConfig("draft", args.draft_k, draft=args.draft, adaptive=False, **extra)
    if args.eagle:
        configs["eagle"] = SpeculativeConfig("eagle", args.eagle_k, adaptive=not args.fixed_k, **extra)
    for tree in filter(None, args.eagle_trees.split(",")):
        configs[f"tree:{tree}"] = replace(SpeculativeConfig.parse(f"eagle-tree:{tree}"), adaptive=not args.fixed_k,
                                          **extra)
    load = {"max_num_seqs": 32, "kv_cache_memory": 256 << 20}
    engines = {name: Engine.load(args.target, speculative=c, verify=False, **load) for name, c in configs.items()}
    for engine in engines.values():  # warm-up
        engine.generate(["Hello"], SamplingParams(max_tokens=4), chat=True)
    print("target forward ms (rows: batch; columns: query tokens per request):", flush=True)
    result = {"threads": torch.get_num_threads(), "load_before": os.getloadavg()[0], "workloads": {}}
    result["costs"] = None if args.skip_costs else step_costs(engines)
    if result["costs"] and result["costs"]["draft_ms"]:
        print(f"draft forward ms at B=1: {result['costs']['draft_ms']:.1f}", flush=True)
    if result["costs"] and result["costs"].get("eagle_step_ms"):
        print(f"eagle head step ms at B=1: {result['costs']['eagle_step_ms']:.2f}", flush=True)

    for workload in args.workloads.split(","):
        if workload == "batch32":
            batches = [grounded_prompts(16) + [OPEN[i % len(OPEN)] for i in range(16)]]
        else:
            prompts = grounded_prompts(args.num_prompts) if workload == "grounded" else list(OPEN[: args.num_prompts])
            batches = [[p] for p in prompts]
        runs = {name: [] for name in engines}
        for i, batch in enumerate(batches):  # configs interleaved per batch: they share the load's drift
            for name, engine in engines.items():
                if name != "draft" or (i == 0 and workload in args.draft_workloads.split(",")):
                    runs[name].append(run(engine, batch, args.output_len))
        rows = {}
        for name, config_runs in runs.items():
            if config_runs:
                rows[name] = summarize(config_runs, rows.get("off"))
        result["workloads"][workload] = _without_tokens(rows)
        print(f"\n{workload}: {len(batches)} run(s) of {len(batches[0])} request(s), <= {args.output_len} tokens "
              "(draft: the first run only, its ratio against off's first run)")
        print(f"  {'config':<13} {'tok/s':>7} {'ratio':>6} {'TPOT ms':>8} {'accept':>7} {'mean len':>8} same")
        for name, row in rows.items():
            rate, length = row["spec_acceptance_rate"], row["spec_mean_acceptance_length"]
            print(f"  {name:<13} {row['output_tokens_per_s']:7.2f} {row['ratio']:5.2f}x "
                  f"{row['tpot_ms']:8.1f} {'-' if rate is None else f'{rate:.0%}':>7} "
                  f"{'-' if length is None else f'{length:.2f}':>8} {row['same_tokens_as_off']}", flush=True)
        args.out.write_text(json.dumps(result, indent=1, default=lambda x: None))  # after every workload


def summarize(runs: list[dict], off: dict | None) -> dict:
    """One config's row over its runs; the ratio is against off over the same runs."""
    elapsed = sum(r["elapsed_s"] for r in runs)
    num_output = sum(r["num_output_tokens"] for r in runs)
    drafted = [r for r in runs if r["num_drafts"]]
    row = {
        "output_tokens_per_s": num_output / elapsed, "num_output_tokens": num_output, "elapsed_s": elapsed,
        "tpot_ms": statistics.mean(r["tpot_ms"] for r in runs), "num_drafts": sum(r["num_drafts"] for r in runs),
        "spec_acceptance_rate": statistics.mean(r["spec_acceptance_rate"] for r in drafted) if drafted else None,
        "spec_mean_acceptance_length":
            statistics.mean(r["spec_mean_acceptance_length"] for r in drafted) if drafted else None,
        "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs],
        "token_ids": [r["token_ids"] for r in runs],
    }
    if off is None:
        return {**row, "ratio": 1.0, "same_tokens_as_off": True}
    same = off["runs"][: len(runs)]
    base = sum(r["num_output_tokens"] for r in same) / sum(r["elapsed_s"] for r in same)
    return {**row, "ratio": row["output_tokens_per_s"] / base,
            "same_tokens_as_off": row["token_ids"] == off["token_ids"][: len(runs)]}


def _without_tokens(rows: dict) -> dict:
    return {name: {k: v for k, v in row.items() if k != "token_ids"} for name, row in rows.items()}


if __name__ == "__main__":
    main()
