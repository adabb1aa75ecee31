"""Quality of SmolLM2-135M-Instruct with a quantized KV cache, against its fp32 model (fp32 KV).

The model is fp32 (cast, fuse_qkv, fuse_gate_up) so that only the KV cache differs; each variant
adds `kv_layout {dtype}`. Measured, per variant and window length:

- KL(fp32 || variant) per token and top-1 agreement with fp32, with 95% bootstrap intervals over
  windows (optc.commands.eval.score_windows: consecutive windows of `builtin:pydoc-heldout` from token 0,
  each scored with no earlier context; optc.commands.compare's bootstrap);
- greedy agreement with the fp32-KV engine on the grounded chat prompts of benchmarks/speculative.py:
  the share of generated tokens before the first divergence, and of identical completions.

`fp8_e4m3-per-head` is the alternative scale policy for fp8: one scale per (layer, K|V, KV head),
calibrated at build time as the absmax of the K / V the model writes on the recipe's calibration
text (`builtin:pydoc`, 32 x 128 tokens, seed 0) / 448, then fixed. It is measured here by a cache
whose store uses that fixed scale (its reads are the per-token path's, with equal scales), to
decide which policy optc keeps; optc itself implements the per-(token, head) policy.

    python benchmarks/kv_quality.py [--max-tokens 100000] [--windows 512,2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from optc.commands.compare.verdicts import bootstrap_interval, quality_value
from optc.commands.eval import DEFAULT_DATA, Loaded, WindowScore, score_windows
from optc.core.execute import Executor, bind_params, dense_step, graph_kv_spec, run_dense
from optc.core.kv_cache import QMAX, KVCache, KVCacheSpec
from optc.frontend.calibration import calibration_batch, encode, load_text
from optc.frontend.passmanager import PassContext, PassManager
from optc.frontend.sources import load_source
from optc.runtime import Engine, EngineConfig, SamplingParams
from optc.runtime.model import Model
from optc.testing import smollm2_hf_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import grounded_prompts  # noqa: E402  the repository's grounded chat prompts

KV_DTYPES = ("bfloat16", "int8", "fp8_e4m3")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=100_000)
    ap.add_argument("--windows", default="512,2048", help="window lengths of the quality runs ('' for none)")
    ap.add_argument("--per-head-windows", default="512", help="window lengths that also score fp8_e4m3-per-head")
    ap.add_argument("--greedy-prompts", type=int, default=8, help="0: no greedy comparison")
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = smollm2_hf_checkpoint()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    source = load_source(str(path))
    ctx = PassContext(dtype="float32")
    base = [("cast", {"dtype": "float32"}), ("fuse_qkv", {}), ("fuse_gate_up", {})]
    ref_graph, ref_store, _, _ = PassManager(base).run(source.graph, source.store, ctx)
    reference = Loaded(ref_graph, ref_store, tokenizer)
    variants = {}
    for dtype in KV_DTYPES:
        graph, store, _, _ = PassManager([("kv_layout", {"dtype": dtype})]).run(ref_graph, ref_store, ctx)
        variants[dtype] = Loaded(graph, store, tokenizer)
    per_head_windows = {int(w) for w in args.per_head_windows.split(",") if w}
    if per_head_windows:
        calibration, _ = calibration_batch("builtin:pydoc", tokenizer, 32, 128, 0)
        per_head_amax = calibrate_per_head(ref_graph, ref_store, calibration)
    result = {"quality": [], "greedy": [], "per_head_calibration": "builtin:pydoc 32 x 128 seed 0"}
    for window in (int(w) for w in args.windows.split(",") if w):
        t0 = time.perf_counter()
        scores = score_windows(list(variants.values()), reference, max_tokens=args.max_tokens, window=window)
        names = list(variants)
        if window in per_head_windows:
            scores.append(score_per_head(variants["fp8_e4m3"], reference, per_head_amax, args.max_tokens, window))
            names.append("fp8_e4m3-per-head")
        for name, rows in zip(names, scores, strict=True):
            rows = [asdict(r) for r in rows]
            entry = {"kv": name, "window": window, "windows": len(rows), "tokens": sum(r["num_tokens"] for r in rows)}
            for key in ("kld", "top1_agreement", "ppl"):
                entry[key] = quality_value(rows, key)
                entry[f"{key}_ci95"] = bootstrap_interval(rows, key)
            result["quality"].append(entry)
            print(json.dumps(entry), flush=True)
        print(f"window {window}: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.greedy_prompts:
        result["greedy"] = greedy_agreement(ref_graph, ref_store, variants, tokenizer, args.greedy_prompts,
                                            args.greedy_tokens)
        print(json.dumps(result["greedy"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def calibrate_per_head(graph, store, tokens: torch.Tensor) -> torch.Tensor:
    """(num_layers, 2, H_kv) absmax of the K (after rope) and V each layer stores on `tokens`."""
    cfg = graph.config
    amax = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads)
    executor = Executor(graph, bind_params(graph, store), use_references=True)
    for row in tokens:
        step = dense_step(graph, 1, row.numel())
        step.new_transient_cache = _cache_factory(step, amax, record=True)
        executor.run(row, step)
    return amax


@dataclass(frozen=True)
class _StaticScaleCache(KVCache):
    """fp8 with a fixed scale per (K|V, KV head), `amax` / 448; with `record`, a float cache that
    raises `amax` to what is stored. kv_store_ref encodes K, then V."""

    amax: torch.Tensor | None = None  # (2, H_kv), this layer's
    record: bool = False
    calls: list = field(default_factory=list)

    def encode(self, x: torch.Tensor):
        i = len(self.calls) % 2
        self.calls.append(i)
        if self.record:
            self.amax[i] = torch.maximum(self.amax[i], x.abs().amax(dim=(0, 2)).float())
            return super().encode(x)
        scale = self.amax[i] / self.qmax  # (H_kv,)
        inv = torch.where(scale > 0, 1 / scale, 0.0)
        y = (x.float() * inv[:, None]).clamp(-self.qmax, self.qmax).to(self.data.dtype)
        return y, scale.expand(x.shape[0], -1)


def _cache_factory(step, amax: torch.Tensor, record: bool):
    """The Step's transient caches, one per layer in order: recording float ones, or fixed-scale fp8."""
    layers = iter(range(amax.shape[0]))
    template = step.new_transient_cache()
    fp8 = torch.float8_e4m3fn

    def make() -> KVCache:
        layer = next(layers)
        if record:
            return _StaticScaleCache(torch.zeros_like(template.data, dtype=torch.float32), amax=amax[layer],
                                     record=True)
        data = torch.zeros_like(template.data, dtype=fp8)
        return _StaticScaleCache(data, torch.zeros(data.shape[:4]), QMAX["fp8_e4m3"], amax=amax[layer])

    return make


def score_per_head(loaded: Loaded, reference: Loaded, amax: torch.Tensor, max_tokens: int,
                   window: int) -> list[WindowScore]:
    """optc.commands.eval.score_windows's sums for the fixed-scale fp8 cache (same windows, same math)."""
    ids = torch.tensor(encode(loaded.tokenizer, load_text(DEFAULT_DATA))[:max_tokens], dtype=torch.int64)
    num_windows = ids.numel() // window
    windows = ids[: num_windows * window].view(num_windows, window)
    ref = Executor(reference.graph, bind_params(reference.graph, reference.store), use_references=True)
    model = Executor(loaded.graph, bind_params(loaded.graph, loaded.store), use_references=True)
    out = []
    for w in windows:
        target = w[1:]
        ref_logp = run_dense(ref, w[None])[0, :-1].float().log_softmax(-1)
        step = dense_step(loaded.graph, 1, window)
        step.new_transient_cache = _cache_factory(step, amax, record=False)
        logp = model.run(w, step)["logits"][:-1].float().log_softmax(-1)
        out.append(WindowScore(float(-logp.gather(-1, target[:, None]).sum()),
                               float(-ref_logp.gather(-1, target[:, None]).sum()),
                               float((ref_logp.exp() * (ref_logp - logp)).sum()),
                               int((ref_logp.argmax(-1) == logp.argmax(-1)).sum()), target.numel()))
    return out


def greedy_agreement(ref_graph, ref_store, variants: dict, tokenizer, num_prompts: int, max_tokens: int) -> list:
    """Per KV variant: greedy completions of the grounded chat prompts against the fp32-KV engine's."""
    prompts = grounded_prompts(num_prompts)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def run(graph, store, spec):
        engine = Engine(Model(graph, store, "cpu", kv_spec=spec), tokenizer, EngineConfig(max_seq_len=2048))
        return [c.token_ids for c in engine.generate(prompts, params, chat=True)]

    base = run(ref_graph, ref_store, KVCacheSpec(dtype="float32"))
    rows = []
    for name, loaded in variants.items():
        got = run(loaded.graph, loaded.store, graph_kv_spec(loaded.graph))
        prefix = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                  for x, y in zip(base, got, strict=True)]
        rows.append({"kv": name, "prompts": len(prompts), "tokens_per_prompt": max_tokens,
                     "tokens_before_divergence": sum(prefix) / (len(prompts) * max_tokens),
                     "identical_completions": sum(p == max_tokens for p in prefix) / len(prompts),
                     "token_match": sum(a == b for x, y in zip(base, got, strict=True)
                                        for a, b in zip(x, y, strict=True)) / (len(prompts) * max_tokens)})
    return rows


if __name__ == "__main__":
    main()
