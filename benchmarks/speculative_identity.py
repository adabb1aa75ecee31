"""Greedy speculative output against plain decoding on a real artifact (SmolLM2 bfloat16 with an EAGLE head:
recipes/smollm2-eagle.yaml): tests/test_speculative_smollm2.py's 24 chat prompts plus benchmarks/speculative.py's
8 open prompts, 64 greedy tokens, adaptive off, speculating at batch 32 (batched against plain batched) and at
batch 1 on the open prompts (against plain at batch 1: plain batched and plain at batch 1 differ in bfloat16,
so each is compared with its own). Prints, per config, the identical count, the mean acceptance length and the
accepted tokens per position (per depth for a tree).

    OMP_NUM_THREADS=1 python benchmarks/speculative_identity.py --target build/smollm2-eagle eagle:4 eagle-tree:4:2:10
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from optc.core.settings import SpeculativeConfig
from optc.runtime import Engine, SamplingParams

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent / "tests")]
from speculative import OPEN  # noqa: E402
from test_speculative_smollm2 import PROMPTS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("configs", nargs="+", help="--speculative spellings, e.g. eagle:4 eagle-tree:4:2:10")
    args = parser.parse_args()
    params = SamplingParams(max_tokens=args.output_len)
    prompts = list(PROMPTS) + list(OPEN)
    load = {"verify": False, "max_num_seqs": 32, "kv_cache_memory": 512 << 20}
    base = Engine.load(args.target, **load)
    plain = [c.token_ids for c in base.generate(prompts, params, chat=True)]
    plain_ones = [base.generate([p], params, chat=True)[0].token_ids for p in OPEN]
    for spelling in args.configs:
        config = replace(SpeculativeConfig.parse(spelling), adaptive=False, disable_above_num_requests=32)
        engine = Engine.load(args.target, speculative=config, **load)
        start = time.perf_counter()
        batched = [c.token_ids for c in engine.generate(prompts, params, chat=True)]
        stats = engine.stats()
        same = sum(a == b for a, b in zip(batched, plain, strict=True))
        print(
            f"{spelling} batched: {same}/{len(prompts)} identical, mean length "
            f"{stats.spec_mean_acceptance_length:.2f}, per position {stats.num_accepted_tokens_per_position}, "
            f"{time.perf_counter() - start:.0f} s",
            flush=True,
        )
        ones = [engine.generate([p], params, chat=True)[0].token_ids for p in OPEN]
        same = sum(a == b for a, b in zip(ones, plain_ones, strict=True))
        print(f"{spelling} batch 1 ({len(OPEN)} open prompts): {same}/{len(OPEN)} identical", flush=True)


if __name__ == "__main__":
    main()
