"""Tensor parallelism on the CPU (gloo): the per-step cost of N ranks against one, on an artifact
(default: SmolLM2 in float32, built once under --work), and the time its collectives take.

Per N and batch size B: B requests of --prompt-len distinct tokens are prefilled, then --steps decode
steps are timed one by one (`Engine.step`: schedule, broadcast the step, forward, sample). Inside
each step, rank 0 times its `all_reduce` and `all_gather` nodes (the op references, wrapped before
the engine loads): that time is the transport plus the wait for the slowest rank. Separately, N
processes with no model run the same collectives on the same shapes back to back: the transport
alone. Medians over the steps (the machine may be shared: the load average is printed). Last, the
same bytes over NCCL on NVLink by a ring model: an all-reduce of S bytes over N ranks takes
2 (N - 1) (alpha + S / (N * bandwidth)), an all-gather of S-byte shards (N - 1) (alpha + S / bandwidth).

`--model-only` prints, without measuring, the expected batch-1 decode of Llama-3-8B and 70B (bf16) on
H100 SXM at N = 1, 2, 4, 8: each rank reads its share of the weights (all but the embedding table, of
which a token reads one row) and of the KV cache at --context tokens at HBM bandwidth, then the step's
collectives run on the ring model above (bf16 all-reduces of the hidden state, the float32 logits
gathered), nothing overlapped.

    python benchmarks/tensor_parallel_step.py [--sizes 1,3] [--batch-sizes 1,8] [--json out.json]
    python benchmarks/tensor_parallel_step.py --model-only [--context 1024]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from optc.core import ops
from optc.core.ops.collective import all_gather_ref, all_reduce_ref
from optc.runtime import Engine, SamplingParams
from optc.testing import build_artifact

REPO = Path(__file__).resolve().parents[1]
NVLINK_BYTES_PER_S = 450e9  # H100 SXM NVLink 4, per direction
NVLINK_ALPHA_S = 1e-6  # assumed latency per ring step (NCCL LL protocol, one NVSwitch hop)
HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3
LLAMA3 = {  # name -> (parameters, layers, hidden, KV heads, head dim, vocab)
    "Llama-3-8B": (8.03e9, 32, 4096, 8, 128, 128256),
    "Llama-3-70B": (70.55e9, 80, 8192, 8, 128, 128256),
}


class CollectiveTimer:
    """Wraps the collectives' references in OPS so that an executor built afterwards times them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.bytes = 0
        self._saved = {}

    def install(self) -> None:
        for name, fn in (("all_reduce", all_reduce_ref), ("all_gather", all_gather_ref)):
            self._saved[name] = ops.OPS[name]
            ops.OPS[name] = dataclasses.replace(ops.OPS[name], reference=self._timed(fn))

    def uninstall(self) -> None:
        ops.OPS.update(self._saved)

    def _timed(self, fn):
        def timed(x, *args):
            t0 = time.perf_counter()
            out = fn(x, *args)
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            self.bytes += x.numel() * x.element_size()
            return out
        return timed


def decode_steps(engine: Engine, batch: int, prompt_len: int, steps: int, timer: CollectiveTimer) -> dict:
    vocab = engine.vocab_size
    requests = [engine.add_request([(1000 + 7 * i + j) % vocab for j in range(prompt_len)],
                                   SamplingParams(max_tokens=steps + 2, ignore_eos=True)) for i in range(batch)]
    while any(r.num_output_tokens == 0 for r in requests):  # prefill
        engine.step()
    step_s, comm_s = [], []
    for _ in range(steps):
        timer.seconds = timer.calls = timer.bytes = 0
        t0 = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t0)
        comm_s.append(timer.seconds)
    calls, sent = timer.calls, timer.bytes
    while engine.has_unfinished():
        engine.step()
    return {"step_ms": 1e3 * statistics.median(step_s), "comm_ms": 1e3 * statistics.median(comm_s),
            "collectives": calls, "bytes_per_rank": sent}


def transport_only(size: int, batch: int, hidden: int, vocab: int, num_layers: int, repeats: int) -> float:
    """ms per step of the step's collectives alone (2 per layer + the embedding's all_reduce, the
    logits' all_gather) over `size` gloo processes, float32, the median of `repeats`."""
    out = mp.get_context("spawn").Queue()
    mp.start_processes(_transport_rank, (size, batch, hidden, vocab, num_layers, repeats, out, _free_port()),
                       nprocs=size, start_method="spawn")
    return out.get()


def nvlink_ms(size: int, batch: int, hidden: int, vocab: int, num_layers: int, itemsize: int,
              logits_itemsize: int = 4) -> float:
    """ms per step of the step's collectives over NVLink on the ring model (module doc): 2 all-reduces
    per layer and the embedding's of (batch, hidden) `itemsize` values, one all-gather of the logits."""
    if size == 1:
        return 0.0
    reduce_bytes = batch * hidden * itemsize
    shard_bytes = batch * -(-vocab // size) * logits_itemsize
    all_reduce = 2 * (size - 1) * (NVLINK_ALPHA_S + reduce_bytes / (size * NVLINK_BYTES_PER_S))
    all_gather = (size - 1) * (NVLINK_ALPHA_S + shard_bytes / NVLINK_BYTES_PER_S)
    return 1e3 * ((2 * num_layers + 1) * all_reduce + all_gather)


def expected_decode(context: int) -> list[dict]:
    """Batch-1 decode per token of the LLAMA3 models at N = 1, 2, 4, 8 (see the module doc)."""
    rows = []
    for name, (params, layers, hidden, kv_heads, head_dim, vocab) in LLAMA3.items():
        weight_bytes = (params - vocab * hidden) * 2  # bf16; the embedding table: one row per token
        kv_bytes = 2 * layers * kv_heads * head_dim * 2 * context  # K and V, bf16
        for size in (1, 2, 4, 8):
            per_rank = (weight_bytes + kv_bytes) / size  # 8 KV heads split evenly up to N = 8
            read_ms = 1e3 * per_rank / HBM_BYTES_PER_S
            comm_ms = nvlink_ms(size, 1, hidden, vocab, layers, 2)
            rows.append({"model": name, "size": size, "rank_gb": params * 2 / size / 1e9,
                         "read_gb": per_rank / 1e9, "read_ms": read_ms, "comm_ms": comm_ms,
                         "token_ms": read_ms + comm_ms, "tokens_per_s": 1e3 / (read_ms + comm_ms)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, help="artifact folder (default: SmolLM2 float32, built once)")
    parser.add_argument("--work", type=Path, default=REPO / "build" / "bench-tp")
    parser.add_argument("--sizes", default="1,3")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--model-only", action="store_true", help="print the expected Llama-3 decode and exit")
    parser.add_argument("--context", type=int, default=1024, help="--model-only: tokens in the KV cache")
    args = parser.parse_args()
    if args.model_only:
        print("model         N  weights GB/rank  read GB/token/rank  read ms  collectives ms  ms/token  tok/s")
        for r in expected_decode(args.context):
            print(f"{r['model']:<12} {r['size']:>2}  {r['rank_gb']:15.1f}  {r['read_gb']:18.2f}  {r['read_ms']:7.2f}"
                  f"  {r['comm_ms']:14.3f}  {r['token_ms']:8.2f}  {r['tokens_per_s']:5.0f}")
        return
    artifact = args.artifact or args.work / "smollm2-f32"
    if not artifact.exists():
        build_artifact(artifact, REPO / "recipes" / "smollm2-bf16.yaml", "dtype=float32")
    sizes = [int(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows, load_start = [], os.getloadavg()
    for size in sizes:
        timer = CollectiveTimer()
        timer.install()
        engine = Engine.load(artifact, tensor_parallel_size=size)
        try:
            c = engine.model.graph.config
            for batch in batches:
                row = {"size": size, "batch": batch, **decode_steps(engine, batch, args.prompt_len, args.steps, timer)}
                row["transport_ms"] = (transport_only(size, batch, c.hidden_size, c.vocab_size, c.num_layers,
                                                      args.steps) if size > 1 else 0.0)
                row["nvlink_ms"] = nvlink_ms(size, batch, c.hidden_size, c.vocab_size, c.num_layers, 4)
                rows.append(row)
        finally:
            engine.close()
            timer.uninstall()
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
              "load_average": {"start": load_start, "end": os.getloadavg()}, "cpu_count": os.cpu_count(),
              "torch_threads": torch.get_num_threads(),
              "artifact": str(artifact), "prompt_len": args.prompt_len, "steps": args.steps, "rows": rows}
    print(f"{report['date']}  load average (1, 5, 15 min) at start {load_start}, at end {os.getloadavg()}, "
          f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads on rank 0")
    print("N  batch  step ms  collectives ms (calls, KiB/rank)  transport-only ms  NVLink ms (same bytes)")
    for r in rows:
        print(f"{r['size']}  {r['batch']:>5}  {r['step_ms']:7.1f}  {r['comm_ms']:7.1f} ({r['collectives']}, "
              f"{r['bytes_per_rank'] / 1024:.0f})  {r['transport_ms']:8.2f}  {r['nvlink_ms']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


def _transport_rank(rank: int, size: int, batch: int, hidden: int, vocab: int, num_layers: int, repeats: int,
                    out, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    group = dist.group.WORLD
    x = torch.randn(batch, hidden)
    logits = torch.randn(batch, -(-vocab // size))
    times = []
    for _ in range(repeats + 2):  # 2 warm-up steps
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(2 * num_layers + 1):
            all_reduce_ref(x.clone(), group)
        all_gather_ref(logits, group, vocab)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(1e3 * statistics.median(times[2:]))
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
