"""`optc bench --url`: a load tester for an OpenAI-compatible server (`optc serve` or any other).

It sends `num_requests` streaming /v1/completions requests, greedy, `output_len` tokens each with EOS
ignored (the `ignore_eos` extension), arriving as a Poisson process of `request_rate` requests per
second (inf = all at once) with at most `max_concurrency` in flight. The synthetic prompts are the
same seeded random token ids as in-process `optc bench` (vocabulary size from /v1/models), so the
two measure the same workload. Reported: throughput over the whole run, and mean / p50 / p99 of
TTFT (first text), TPOT ((e2e - TTFT) / (tokens - 1)), ITL (time between streamed chunks) and
end-to-end latency, plus errors (non-200 answers, broken streams, short outputs). It measures; it
asserts nothing.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from optc.commands.dataset import read_dataset
from optc.core.errors import InputError, UserError

PERCENTILES = (50, 99)


@dataclass(frozen=True)
class LoadOptions:
    url: str  # the server's base URL, e.g. http://127.0.0.1:8000
    num_requests: int = 64
    input_len: int = 128  # synthetic prompts only
    output_len: int = 128
    request_rate: float = math.inf  # requests per second (Poisson arrivals); inf = all at once
    max_concurrency: int | None = None  # None = no limit
    dataset: Path | None = None  # prompts, as in-process bench reads them (optc/commands/dataset.py)
    seed: int = 0
    api_key: str | None = None  # None = env OPTC_API_KEY, if set
    model: str | None = None  # None = the server's first model
    show_progress: bool = True

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise InputError(f"--url must start with http:// or https://, got {self.url!r}")
        for name in ("num_requests", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.request_rate > 0:
            raise InputError(f"--request-rate must be > 0 (inf = all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InputError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True)
class LoadResult:
    url: str
    model: str
    num_requests: int
    num_errors: int
    errors: list[str]  # the first few error messages
    request_rate: float
    max_concurrency: int | None
    duration_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float
    ttft_ms: dict[str, float] = field(default_factory=dict)
    tpot_ms: dict[str, float] = field(default_factory=dict)
    itl_ms: dict[str, float] = field(default_factory=dict)
    e2e_ms: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["request_rate"] = None if math.isinf(self.request_rate) else self.request_rate
        return out


@dataclass
class _Measured:
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    e2e: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None


def run_load(options: LoadOptions) -> LoadResult:
    return asyncio.run(_run(options))


def format_load(result: LoadResult) -> str:
    """A few human-readable lines of a `run_load` result."""
    rate = "inf" if math.isinf(result.request_rate) else f"{result.request_rate:g}"
    lines = [
        f"{result.num_requests} requests to {result.url} ({result.model}), rate {rate}/s, max concurrency "
        f"{result.max_concurrency or 'unlimited'}, {result.duration_s:.2f} s, {result.num_errors} errors",
        f"throughput  output {result.output_tokens_per_s:.1f} tok/s   total {result.total_tokens_per_s:.1f} tok/s   "
        f"{result.requests_per_s:.2f} req/s",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        d = getattr(result, f"{name}_ms")
        lines.append(f"{name.upper():<5} ms    mean {d['mean']:.1f}   p50 {d['p50']:.1f}   p99 {d['p99']:.1f}")
    lines += [f"error: {e}" for e in result.errors]
    return "\n".join(lines)


async def _run(options: LoadOptions) -> LoadResult:
    import httpx
    from tqdm import tqdm

    key = options.api_key or os.environ.get("OPTC_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limit = options.max_concurrency or options.num_requests
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(base_url=options.url.rstrip("/"), headers=headers, timeout=timeout,
                                 limits=httpx.Limits(max_connections=limit + 1)) as client:
        try:
            models = (await client.get("/v1/models")).raise_for_status().json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as e:
            raise UserError(f"--url {options.url}: GET /v1/models failed ({e})") from None
        names = [m["id"] for m in models]
        if options.model is not None and options.model not in names:
            raise UserError(f"model {options.model!r} is not served at {options.url}; it serves {names}")
        card = models[names.index(options.model or names[0])]
        prompts = _prompts(options, card)
        semaphore = asyncio.Semaphore(limit)
        arrivals = random.Random(options.seed)
        bar = tqdm(total=len(prompts), unit="req", desc="optc bench --url", disable=not options.show_progress)
        tasks = []
        start = time.perf_counter()
        for i, (prompt, output_len) in enumerate(prompts):
            if i and not math.isinf(options.request_rate):
                await asyncio.sleep(arrivals.expovariate(options.request_rate))
            await semaphore.acquire()
            tasks.append(asyncio.create_task(_request(client, card["id"], prompt, output_len, semaphore, bar)))
        measured = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return _result(options, card["id"], measured, duration)


def _prompts(options: LoadOptions, card: dict[str, Any]) -> list[tuple[str | list[int], int]]:
    """(prompt, output length) of each request: the dataset's (optc/commands/dataset.py), or random token ids."""
    if options.dataset is not None:
        return read_dataset(options.dataset, options.num_requests, options.output_len)
    import torch

    if "vocab_size" not in card:
        raise UserError(f"{options.url} does not give its vocab_size in /v1/models; pass --dataset")
    g = torch.Generator().manual_seed(options.seed)  # the same prompts as in-process `optc bench`
    ids = torch.randint(0, card["vocab_size"], (options.num_requests, options.input_len), generator=g).tolist()
    return [(prompt, options.output_len) for prompt in ids]


async def _request(client, model: str, prompt: str | list[int], output_len: int, semaphore: asyncio.Semaphore,
                   bar) -> _Measured:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    out = _Measured()
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                out.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return out
            is_done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    is_done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = f"stream error: {chunk['error'].get('message')}"
                    return out
                if chunk.get("usage"):
                    out.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
                    out.num_output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    out.ttft = now - start if out.ttft is None else out.ttft
                    out.chunk_times.append(now)
            out.e2e = time.perf_counter() - start
            if not is_done:
                out.error = "the stream ended without [DONE]"
            elif out.num_output_tokens != output_len:
                out.error = f"got {out.num_output_tokens} tokens, asked for {output_len}"
    except (httpx.HTTPError, ValueError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        semaphore.release()
        bar.update(1)
    return out


def _result(options: LoadOptions, model: str, measured: list[_Measured], duration: float) -> LoadResult:
    ok = [m for m in measured if m.error is None]
    num_prompt = sum(m.num_prompt_tokens for m in ok)
    num_output = sum(m.num_output_tokens for m in ok)
    itl = [(b - a) * 1e3 for m in ok for a, b in zip(m.chunk_times, m.chunk_times[1:], strict=False)]
    tpot = [(m.e2e - m.ttft) * 1e3 / (m.num_output_tokens - 1) for m in ok
            if m.ttft is not None and m.num_output_tokens > 1]
    return LoadResult(
        url=options.url, model=model, num_requests=len(measured), num_errors=len(measured) - len(ok),
        errors=[m.error for m in measured if m.error is not None][:5], request_rate=options.request_rate,
        max_concurrency=options.max_concurrency, duration_s=duration, num_prompt_tokens=num_prompt,
        num_output_tokens=num_output, output_tokens_per_s=num_output / duration,
        total_tokens_per_s=(num_prompt + num_output) / duration, requests_per_s=len(ok) / duration,
        ttft_ms=_summary([m.ttft * 1e3 for m in ok if m.ttft is not None]), tpot_ms=_summary(tpot),
        itl_ms=_summary(itl), e2e_ms=_summary([m.e2e * 1e3 for m in ok]),
    )


def _summary(values: list[float]) -> dict[str, float]:
    """mean and percentiles (linear interpolation between closest ranks); nan when empty."""
    if not values:
        return {"mean": math.nan} | {f"p{q}": math.nan for q in PERCENTILES}
    ordered = sorted(values)
    out = {"mean": sum(ordered) / len(ordered)}
    for q in PERCENTILES:
        x = (len(ordered) - 1) * q / 100
        lo = int(x)
        hi = min(lo + 1, len(ordered) - 1)
        out[f"p{q}"] = ordered[lo] + (ordered[hi] - ordered[lo]) * (x - lo)
    return out
