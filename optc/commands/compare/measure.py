"""What `optc compare` measures of each built variant: quality, speed, size, memory, and where.

Quality goes through `optc.commands.eval.score_windows`: every variant against one reference on the same
windows, each window's reference run shared, kept per window so the verdicts can bootstrap over
windows. Speed goes through `optc.commands.bench.run_bench` once per batch size (`max_num_seqs` = the batch
size, `max(num_requests, batch size)` requests), repeated `repeats` times; each repeat runs in a
fresh process (spawned), so a repeat's peak memory is its own (RSS high-water mark of that process
on the CPU; `torch.cuda.max_memory_allocated` on CUDA) and not that of the builds and evaluations
before it. A variant whose artifact says `runtime.tensor_parallel_size: N` is scored and benchmarked
split over N ranks, as an engine loads it; one that says `runtime.pipeline_parallel_size: P` is benchmarked
in P stages, and scored in them only when N > 1 too (one rank scores the same math). Size comes from the
artifact's manifest (`files`: bytes).
Not here: verdicts.
"""

from __future__ import annotations

import multiprocessing
import platform
import resource
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import optc
from optc.commands.eval import score_windows
from optc.core.artifact import read


@dataclass(frozen=True)
class SpeedSettings:
    batch_sizes: tuple[int, ...] = (1, 4)
    num_requests: int = 4
    input_len: int = 64
    output_len: int = 16
    repeats: int = 3
    device: str = "cpu"
    is_isolated: bool = True  # a fresh process per repeat (honest peak memory); False: in this process


def measure_quality(artifacts: dict[str, Path], reference: Any, data: str, max_tokens: int, window: int,
                    show_progress: bool = True) -> dict[str, list[dict]]:
    """name -> per-window sums (WindowScore as dicts), every variant on the same windows."""
    names = list(artifacts)
    with tqdm(desc="quality (eval windows)", unit="window", disable=not show_progress) as bar:
        def progress(msg: str) -> None:
            done, total = (int(x) for x in msg.rsplit(" ", 1)[1].split("/"))
            bar.total = total
            bar.n = done
            bar.refresh()

        scores = score_windows([artifacts[n] for n in names], reference, data, max_tokens, window, progress)
    return {n: [asdict(s) for s in per] for n, per in zip(names, scores, strict=True)}


def measure_speed(artifact: Path, settings: SpeedSettings, desc: str = "", show_progress: bool = True) -> list[dict]:
    """One dict per repeat: {batch size: bench result (the run_bench dict)}, peak_memory_bytes."""
    out = []
    context = multiprocessing.get_context("spawn")
    for _ in tqdm(range(settings.repeats), desc=f"speed {desc}", unit="repeat", disable=not show_progress):
        if settings.is_isolated:
            with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
                out.append(pool.submit(bench_repeat, str(artifact), settings).result())
        else:
            out.append(bench_repeat(str(artifact), settings))
    return out


def bench_repeat(artifact: str, settings: SpeedSettings) -> dict:
    """Every batch size once; runs in a child process when the settings say isolated."""
    from optc.commands.bench import BenchOptions, run_bench

    runs = {}
    for b in settings.batch_sizes:
        options = BenchOptions(Path(artifact), num_requests=max(settings.num_requests, b),
                               input_len=settings.input_len, output_len=settings.output_len, max_num_seqs=b,
                               device=settings.device, show_progress=False)
        r = _bench_dict(run_bench(options))
        runs[str(b)] = {k: r[k] for k in ("output_tokens_per_s", "total_tokens_per_s", "ttft_ms", "tpot_ms",
                                          "elapsed_s", "num_output_tokens", "peak_memory_bytes", "device")}
    if settings.device == "cuda":
        peak = max(r["peak_memory_bytes"] for r in runs.values())
    else:
        peak = _peak_rss_bytes()
    return {"batch_sizes": runs, "peak_memory_bytes": int(peak)}


def _peak_rss_bytes() -> int:
    """This process's RSS high-water mark. VmHWM, not ru_maxrss: Linux carries ru_maxrss across the
    fork + exec of a spawned child, so a child would report its parent's peak (the loaded eval models)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def artifact_sizes(artifact: Path) -> dict[str, int]:
    """Weight bytes (the safetensors shards) and artifact bytes (every file the manifest lists, plus it)."""
    files = read(artifact, verify=False).manifest.files
    weights = sum(int(f["bytes"]) for name, f in files.items() if name.endswith(".safetensors"))
    total = sum(int(f["bytes"]) for f in files.values()) + (Path(artifact) / "manifest.json").stat().st_size
    return {"weight_bytes": weights, "artifact_bytes": total}


def environment(device: str) -> dict[str, Any]:
    """Where the numbers were measured: host, CPU count, device, software versions."""
    import os

    import transformers

    env: dict[str, Any] = {
        "host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "optc": optc.__version__, "torch": torch.__version__,
        "transformers": transformers.__version__, "device": device,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def _bench_dict(result: Any) -> dict:
    """run_bench's result as the dict its JSON output has (a BenchResult or, before it, the dict)."""
    return result.to_json() if hasattr(result, "to_json") else result
