"""Host time per decode step: `Engine.step()` around a model that costs nothing.

The model stands in for a GPU that is never the bottleneck: its forward returns zero logits at
once, so a step's wall time is the engine's own work on the host (scheduling, building the batch
and moving it, the graph runner's buffers, sampling, detokenizing). Runs on the CPU; the batch
moves host -> "device" on the CPU too, so what is counted is the host's share, not DMA time.

Two paths: `eager` (the engine's eager steps) and `graph` (a CudaGraphRunner whose capture is
replaced by a no-op replay: the static buffers are written exactly as for a real replay). Every
request arrives at once (`--batch` requests of `--prompt` tokens), then `--steps` decode steps
are timed; the median of `--repeats` runs is reported.

    python benchmarks/host_step.py [--batches 1,8,64] [--prompt 1024] [--steps 64] [--json out.json]

The vocabulary is small (`--vocab`, default 256): on a GPU the sampler's argmax over the logits runs
on the device, and at Llama-3's 128,256 the CPU's argmax would be most of the number.

Uses only APIs that predate the one-copy batch (Engine, CudaGraphRunner, GraphConfig), so the same
script times a checkout before that change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from types import SimpleNamespace

import torch

from optc.runtime import Engine, SamplingParams
from optc.runtime.cuda_graphs import CudaGraphRunner, GraphConfig
from optc.runtime.engine import EngineConfig


class FreeModel:
    """What the engine reads of a model, with a forward that returns zero logits at once."""

    def __init__(self, vocab: int, max_len: int) -> None:
        self.device = torch.device("cpu")
        self.vocab_size, self.max_position_embeddings, self.eos_token_ids = vocab, max_len, [0]
        self.dtype = torch.bfloat16
        self.graph = SimpleNamespace(nodes=[])
        self._logits = torch.zeros(256, vocab)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return block_size

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        return [torch.zeros(1)]

    def forward(self, batch, kv_caches) -> torch.Tensor:
        return self._logits[: batch.logits_indices.shape[0]]


class NoCaptureRunner(CudaGraphRunner):
    """The graph runner with each replay a no-op: static buffers written as for a real replay."""

    def _capture(self, device) -> None:
        for bucket in self.config.batch_sizes:
            logits = torch.zeros(bucket, self.model.vocab_size)
            self._graphs[bucket] = (SimpleNamespace(replay=lambda: None), logits)


class Letters:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(97 + t % 26) for t in ids)


def time_steps(path: str, batch: int, prompt: int, steps: int, vocab: int) -> float:
    """Median host seconds per decode step over `steps` steps of `batch` requests."""
    max_len = prompt + steps + 16
    model = FreeModel(vocab, max_len)
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=batch * prompt, num_blocks=batch * (
        max_len // 16 + 2) + 1, max_seq_len=max_len)
    engine = Engine(model, Letters(), config)
    if path == "graph":
        sizes = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= batch)
        engine.runner.graph_runner = NoCaptureRunner(model, engine.runner.kv_caches, GraphConfig(sizes, max_len, 16))
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for b in range(batch):
        engine.add_request([(b * 31 + i) % (vocab - 1) + 1 for i in range(prompt)], params)
    engine.step()  # every prefill in one step
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64, help="requests decoding together (default 64)")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens per request (default 1024)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per run (default 64)")
    ap.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256: see the module doc)")
    ap.add_argument("--repeats", type=int, default=5, help="runs per path; the median is reported (default 5)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes to time (default: --batch)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for batch in [int(b) for b in (args.batches or str(args.batch)).split(",")]:
        for path in ("eager", "graph"):
            runs = [time_steps(path, batch, args.prompt, args.steps, args.vocab) for _ in range(args.repeats)]
            rows.append({"path": path, "batch": batch, "host_us_per_step": statistics.median(runs) * 1e6})
            print(f"{path:<6} batch {batch:>3}: {rows[-1]['host_us_per_step']:8.0f} us per decode step "
                  f"(runs: {', '.join(f'{r * 1e6:.0f}' for r in runs)})", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}, 1 thread")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "load": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
