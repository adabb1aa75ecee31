"""`optc bench`: offline serving throughput and latency of an artifact. The library function the
CLI calls; the CLI only parses options into `BenchOptions` and prints the result.

Every request arrives at once (an offline batch), runs greedy for exactly `output_len` tokens (EOS
ignored) and is served by the engine's scheduler. Reported: output and total tokens/s, TTFT and
TPOT percentiles, peak memory (RSS on CPU, `torch.cuda.max_memory_allocated` on CUDA) and KV-pool
usage. With `compare_hf` the same token ids also run through transformers `generate` (static cache;
`torch.compile` on CUDA) in batches of `max_num_seqs`, after the engine is freed, and the throughput
ratio is reported. The engine is read through its public API and `EngineStats` only. The
transformers model is the artifact's source (manifest `source`): the HF
folder or hub id, the GGUF file (dequantized by transformers), or for `random:` sources a
transformers model of its family rebuilt from the artifact's own weights (fused linears split back; dense artifacts
only). `hf_model_dir` names another checkpoint instead. This measures; it asserts nothing.
"""

from __future__ import annotations

import dataclasses
import gc
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from optc.commands.dataset import read_dataset
from optc.core.errors import InputError
from optc.core.lora import adapter_rank
from optc.runtime import Engine, SamplingParams
from optc.runtime.config import PARALLEL_OPTIONS
from optc.runtime.speculative import SpeculativeConfig

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class BenchOptions:
    artifact: Path
    num_requests: int = 64
    input_len: int = 128  # synthetic prompts only
    output_len: int = 128
    dataset: Path | None = None  # one prompt per non-empty line (cycled); *.jsonl: {"prompt", "output_len"}
    max_num_seqs: int | None = None  # None = the artifact's runtime.max_num_seqs
    device: str = "cpu"  # cpu | cuda
    eager: bool = False  # no CUDA graphs
    compare_hf: bool = False  # also run transformers on the artifact's source (see the module doc)
    hf_model_dir: Path | None = None  # compare with this HF checkpoint instead of the source (implies compare_hf)
    seed: int = 0
    show_progress: bool = True
    verify: bool = True  # sha256 of the artifact's files at load; False for one this process just built
    # ngram[:K] | draft:PATH[:K] | eagle[:K] | eagle-tree:D:TOPK:NODES; None = the artifact's runtime.speculative
    speculative: str | None = None
    tensor_parallel_size: int | None = None  # ranks the model is split over; None = the artifact's default
    distributed_backend: str | None = None  # nccl | gloo; None = nccl on cuda, gloo on cpu
    pipeline_parallel_size: int | None = None  # stages of tensor_parallel_size ranks; None = the artifact's default
    nnodes: int | None = None  # machines optc starts the ranks on (optc/commands/parallel.py); None = 1
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    loras: tuple[tuple[str, Path], ...] = ()  # (name, peft adapter folder): request i runs under loras[i % len]

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise InputError(f"device must be cpu or cuda, got {self.device!r}")
        for name in ("num_requests", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class BenchResult:
    """One `run_bench`: throughput, latency percentiles (ms; p50, p90, p99, mean), memory, KV use."""

    artifact: str
    device: str
    num_requests: int
    mean_input_len: float
    output_len: int
    max_num_seqs: int
    eager: bool
    tensor_parallel_size: int  # ranks each stage ran split over
    cuda_graphs: list[int] | None  # decode batch sizes replayed as CUDA graphs; None: eager
    elapsed_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    peak_memory_bytes: int
    kv_cache: dict[str, Any]  # num_blocks, block_size, bytes_per_token, peak_blocks_used, peak_usage,
    # num_preemptions, prefix_cache_hit_rate
    num_steps: int
    speculative: str | None = None  # ngram:K | draft:PATH:K | eagle:K; None: off
    num_drafts: int = 0  # verifications of a request that had draft tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_position: list[int] = dataclasses.field(default_factory=list)
    spec_acceptance_rate: float = 0.0  # accepted / drafted tokens
    spec_mean_acceptance_length: float = 0.0  # 1 + accepted / drafts
    hf: dict[str, Any] | None = None  # the transformers run, with optc_over_hf
    pipeline_parallel_size: int = 1  # stages the model ran cut into (tensor_parallel_size ranks each)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def run_bench(options: BenchOptions) -> BenchResult:
    result, prompts, dtype = _run_optc(options)  # the engine and its KV pool are freed on return
    if options.compare_hf or options.hf_model_dir is not None:
        gc.collect()
        if result.device.startswith("cuda"):
            torch.cuda.empty_cache()
        hf = _run_hf(options, prompts, torch.device(result.device), dtype, result.max_num_seqs)
        hf["optc_over_hf"] = result.output_tokens_per_s / hf["output_tokens_per_s"]
        result = dataclasses.replace(result, hf=hf)
    return result


def _run_optc(options: BenchOptions) -> tuple[BenchResult, list[list[int]], torch.dtype]:
    overrides: dict[str, Any] = {"enforce_eager": options.eager}
    for name in ("max_num_seqs", *PARALLEL_OPTIONS):
        if getattr(options, name) is not None:
            overrides[name] = getattr(options, name)
    speculative = SpeculativeConfig.parse(options.speculative) if options.speculative else None
    if options.loras:
        overrides |= {"max_loras": len(options.loras),
                      "max_lora_rank": max(adapter_rank(folder) for _, folder in options.loras)}
    engine = Engine.load(options.artifact, device=options.device, verify=options.verify, speculative=speculative,
                         **overrides)
    try:
        for name, folder in options.loras:
            engine.load_lora(name, folder)
        return _measure(options, engine)
    finally:
        engine.close()  # tensor parallelism: stops the other ranks


def _measure(options: BenchOptions, engine: Engine) -> tuple[BenchResult, list[list[int]], torch.dtype]:
    prompts, output_lens = _prompts(options, engine)
    longest = max(len(p) + n for p, n in zip(prompts, output_lens, strict=True))
    if longest > engine.max_model_len:
        raise InputError(f"prompt + output_len = {longest} tokens exceeds the context ({engine.max_model_len})")
    # warm-up at the run's prefill length, then decode steps of 2 rows and of 1 (the quantized
    # GEMMs autotune per bucket of M, the token count, and per linear shape), so Triton's compiles
    # and autotuning happen before the clock starts; on CUDA also the run's batch (its chunked
    # prefills and decode rows reach the same M buckets as the run's); prompts of one repeated token
    # share no cached block with the workload; counters are taken as differences
    length = min(len(p) for p in prompts)
    warm = min(2, engine.config.max_num_seqs)
    engine.generate([[1] * length, [2] * length][:warm],
                    [SamplingParams(max_tokens=3), SamplingParams(max_tokens=2)][:warm])
    if engine.device.type == "cuda" and len(prompts) > warm:
        batch = min(len(prompts), engine.config.max_num_seqs)
        warm_prompts = [[3 + i % (engine.vocab_size - 3)] * length for i in range(batch)]
        engine.generate(warm_prompts, SamplingParams(max_tokens=2))
    before = engine.stats()
    is_cuda = engine.device.type == "cuda"
    if is_cuda:
        torch.cuda.reset_peak_memory_stats(engine.device)

    names = [name for name, _ in options.loras] or [None]
    requests = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True), lora=names[i % len(names)])
                for i, (p, n) in enumerate(zip(prompts, output_lens, strict=True))]
    start = time.perf_counter()
    peak_blocks = 0
    total = sum(r.params.max_tokens for r in requests)
    with tqdm(total=total, unit="tok", desc="optc bench", disable=not options.show_progress) as bar:
        while engine.has_unfinished():
            engine.step()
            bar.update(engine.stats().num_generated_tokens - bar.n - before.num_generated_tokens)
            peak_blocks = max(peak_blocks, engine.stats().num_kv_blocks_used)
    elapsed = time.perf_counter() - start

    num_prompt = sum(r.num_prompt_tokens for r in requests)
    num_output = sum(r.num_output_tokens for r in requests)
    ttft = [(r.first_token_time - r.arrival_time) * 1e3 for r in requests]
    tpot = [
        (r.finish_time - r.first_token_time) * 1e3 / (r.num_output_tokens - 1)
        for r in requests if r.num_output_tokens > 1
    ]
    stats = engine.stats()
    result = BenchResult(
        artifact=str(options.artifact),
        device=str(engine.device),
        num_requests=len(requests),
        mean_input_len=num_prompt / len(requests),
        output_len=options.output_len,
        max_num_seqs=engine.config.max_num_seqs,
        eager=options.eager,
        tensor_parallel_size=engine.config.tensor_parallel_size,
        pipeline_parallel_size=engine.config.pipeline_parallel_size,
        cuda_graphs=list(engine.cuda_graph_batch_sizes) if engine.cuda_graph_batch_sizes else None,
        elapsed_s=elapsed,
        num_prompt_tokens=num_prompt,
        num_output_tokens=num_output,
        output_tokens_per_s=num_output / elapsed,
        total_tokens_per_s=(num_prompt + num_output) / elapsed,
        ttft_ms=_percentiles(ttft),
        tpot_ms=_percentiles(tpot),
        peak_memory_bytes=_peak_memory(engine.device),
        kv_cache={
            "num_blocks": stats.num_kv_blocks,
            "block_size": engine.config.block_size,
            "bytes_per_token": stats.kv_bytes_per_token,
            "peak_blocks_used": peak_blocks,
            "peak_usage": peak_blocks / stats.num_kv_blocks,
            "num_preemptions": stats.num_preemptions - before.num_preemptions,
            "prefix_cache_hit_rate": (stats.num_prefix_cache_hit_tokens - before.num_prefix_cache_hit_tokens)
            / max(1, stats.num_prefix_cache_query_tokens - before.num_prefix_cache_query_tokens),
        },
        num_steps=stats.num_steps - before.num_steps,
        speculative=engine.speculator.config.describe() if engine.speculator else None,
        **_speculative_counters(before, stats),
    )
    return result, prompts, engine.dtype


def _speculative_counters(before: Any, after: Any) -> dict[str, Any]:
    """The run's speculative-decoding counters (differences of EngineStats, so the warm-up is excluded)."""
    drafts = after.num_drafts - before.num_drafts
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    per_position = [a - b for a, b in zip(after.num_accepted_tokens_per_position,
                                          before.num_accepted_tokens_per_position or
                                          [0] * len(after.num_accepted_tokens_per_position), strict=True)]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_position": per_position,
        "spec_acceptance_rate": accepted / max(1, drafted),
        "spec_mean_acceptance_length": 1 + accepted / max(1, drafts),
    }


def format_bench(result: BenchResult) -> str:
    """A few human-readable lines of a `run_bench` result."""
    kv, ttft, tpot = result.kv_cache, result.ttft_ms, result.tpot_ms
    lines = [
        f"{result.num_requests} requests, {result.mean_input_len:.0f} in / {result.output_len} out "
        f"tokens, max_num_seqs {result.max_num_seqs}, {result.device}"
        + (f" x {result.tensor_parallel_size} ranks" if result.tensor_parallel_size > 1 else "")
        + (f" x {result.pipeline_parallel_size} stages" if result.pipeline_parallel_size > 1 else "")
        + f", {result.elapsed_s:.2f} s",
        f"throughput  output {result.output_tokens_per_s:.1f} tok/s   "
        f"total {result.total_tokens_per_s:.1f} tok/s",
        f"TTFT ms     p50 {ttft['p50']:.1f}   p90 {ttft['p90']:.1f}   p99 {ttft['p99']:.1f}",
        f"TPOT ms     p50 {tpot['p50']:.2f}   p90 {tpot['p90']:.2f}   p99 {tpot['p99']:.2f}",
        f"memory      peak {result.peak_memory_bytes / 2**20:.0f} MiB   KV peak {kv['peak_usage']:.0%} of "
        f"{kv['num_blocks']} blocks ({kv['bytes_per_token']:.0f} B/token), {kv['num_preemptions']} preemptions",
    ]
    if result.speculative:
        lines.append(
            f"speculative {result.speculative}: acceptance {result.spec_acceptance_rate:.0%}, "
            f"mean acceptance length {result.spec_mean_acceptance_length:.2f} over {result.num_drafts} drafts"
        )
    if result.hf:
        hf = result.hf
        lines.append(
            f"transformers output {hf['output_tokens_per_s']:.1f} tok/s   optc / hf = {hf['optc_over_hf']:.2f}x"
            f"   ({hf['model']})"
        )
    return "\n".join(lines)


def _prompts(options: BenchOptions, engine: Engine) -> tuple[list[list[int]], list[int]]:
    """Token ids of each request's prompt, and its output length."""
    n = options.num_requests
    if options.dataset is None:
        g = torch.Generator().manual_seed(options.seed)
        ids = torch.randint(0, engine.vocab_size, (n, options.input_len), generator=g)
        return ids.tolist(), [options.output_len] * n
    chosen = read_dataset(options.dataset, n, options.output_len)
    return [list(engine.tokenizer(text)["input_ids"]) for text, _ in chosen], [length for _, length in chosen]


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {f"p{q}": float("nan") for q in PERCENTILES} | {"mean": float("nan")}
    ordered = sorted(values)
    out = {}
    for q in PERCENTILES:  # linear interpolation between closest ranks
        x = (len(ordered) - 1) * q / 100
        lo = int(x)
        hi = min(lo + 1, len(ordered) - 1)
        out[f"p{q}"] = ordered[lo] + (ordered[hi] - ordered[lo]) * (x - lo)
    out["mean"] = sum(ordered) / len(ordered)
    return out


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _run_hf(options: BenchOptions, prompts: list[list[int]], device: torch.device, dtype: torch.dtype,
            batch_size: int) -> dict[str, Any]:
    """The same token ids through transformers `generate`, batches of max_num_seqs, left-padded."""
    model, what = _hf_model(options, device, dtype)
    # On CUDA, transformers compiles the decode step itself (inductor, reduce-overhead: CUDA graphs) when
    # the cache is static, and runs the prefill eagerly, which allocates the static cache outside the
    # graphs. Compiling `forward` here as well captured that allocation in a graph whose next replay
    # overwrote the cache (transformers 5.17, H100: "accessing tensor output of CUDAGraphs that has
    # been overwritten").
    model.generation_config.disable_compile = device.type != "cuda"
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]

    def run(batch: list[list[int]], num_new: int) -> int:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=num_new, min_new_tokens=num_new,
                do_sample=False, cache_implementation="static", pad_token_id=0,
            )
        return (out.shape[1] - width) * len(batch)

    # warm-up; on CUDA it compiles, and the static cache's length (prompt + new tokens) is part of the
    # compiled shapes, so it generates as many tokens as the timed run
    run(batches[0], options.output_len if device.type == "cuda" else 2)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    num_output = 0
    for batch in tqdm(batches, desc="transformers", disable=not options.show_progress):
        num_output += run(batch, options.output_len)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    return {"model": what, "elapsed_s": elapsed, "num_output_tokens": num_output,
            "output_tokens_per_s": num_output / elapsed, "peak_memory_bytes": _peak_memory(device)}


def _hf_model(options: BenchOptions, device: torch.device, dtype: torch.dtype) -> tuple[Any, str]:
    """The transformers model to compare with, and a few words saying what it is."""
    from transformers import AutoModelForCausalLM

    from optc.core.artifact import read_manifest

    if options.hf_model_dir is not None:
        path, kwargs = str(options.hf_model_dir), {}
    else:
        source = read_manifest(Path(options.artifact)).source
        kind = source.get("kind")
        # transformers keeps a GGUF's weights packed (its own quantized path); a dense artifact of one is
        # compared with a dense transformers model of its family holding the same weights, as random: sources are
        if kind == "random" or (kind == "gguf" and _is_dense(Path(options.artifact))):
            what = source.get("id") or Path(source["path"]).name
            from optc.frontend.models import hf_model_from_artifact

            return hf_model_from_artifact(Path(options.artifact), device, dtype), f"dense, rebuilt from {what}"
        if kind == "hf_dir":
            path, kwargs = source["path"], {}
        elif kind == "hub":
            path, kwargs = source["id"], {"revision": source.get("revision")}
        elif kind == "gguf":
            path, kwargs = str(Path(source["path"]).parent), {"gguf_file": Path(source["path"]).name}
        else:
            raise InputError(f"--compare-hf: the artifact's source kind {kind!r} has no transformers "
                             "model; pass --hf-model-dir DIR")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    return model.to(device).eval(), f"{path}{' / ' + kwargs['gguf_file'] if 'gguf_file' in kwargs else ''}"


def _is_dense(path: Path) -> bool:
    from optc.core.artifact import read

    graph = read(path, verify=False).graph
    return not any(graph.tensors[t].format.is_quantized for t in graph.used_tensors())

