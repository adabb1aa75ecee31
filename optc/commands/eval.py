"""Quality of a built model against a reference: perplexity, KL divergence and top-1 agreement on
fixed windows of held-out text.

Windows (stated in the result): the text is tokenized once, the first `max_tokens` tokens are cut
into consecutive, non-overlapping windows of `window` tokens starting at token 0 (a final partial
window is dropped); every window is scored from position 0 with no context before it. Over the
window-1 predicted positions of every window: ppl = exp(mean NLL of the next token), kld = mean
KL(reference ‖ model) of the next-token distributions, top1_agreement = share of positions whose
argmax agrees. Everything runs through the ops' torch references on the CPU (whatever kernels the nodes are
bound to), in the graph's dtype.

A model is an artifact directory, a model source string (anything `optc build` accepts as
`model:`), or a (Graph, TensorStore, tokenizer) triple. Not here: building or serving.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from optc.core.errors import InputError
from optc.core.execute import Executor, bind_params, run_dense
from optc.core.ir import Graph
from optc.core.store import TensorStore
from optc.frontend.calibration import encode, load_text

DEFAULT_DATA = "builtin:pydoc-heldout"


@dataclass(frozen=True)
class Loaded:
    graph: Graph
    store: TensorStore
    tokenizer: object


def evaluate(model, reference=None, data: str = DEFAULT_DATA, max_tokens: int = 8192, window: int = 512,
             progress: Callable[[str], None] = lambda m: None, tensor_parallel_size: int | None = None,
             distributed_backend: str | None = None, pipeline_parallel_size: int | None = None) -> dict:
    """-> {ppl, reference_ppl, kld, top1_agreement, tokens, windows, window, data}; the reference
    keys are None without a reference. The tokenizer is the model's. `tensor_parallel_size` (None:
    the artifact's runtime.tensor_parallel_size) > 1 scores the model split over that many ranks, and
    `pipeline_parallel_size` (None: the artifact's) > 1 cut into that many stages."""
    (scores,) = score_windows([model], reference, data, max_tokens, window, progress, tensor_parallel_size,
                              distributed_backend, pipeline_parallel_size)
    return summarize_windows(scores, has_reference=reference is not None) | {
        "windows": len(scores), "window": window, "data": data}


@dataclass(frozen=True)
class WindowScore:
    """Sums over the window-1 predicted positions of one window; the reference sums are 0 without one."""

    nll: float
    reference_nll: float
    kld: float
    num_agree: int
    num_tokens: int


def score_windows(models: list, reference=None, data: str = DEFAULT_DATA, max_tokens: int = 8192,
                  window: int = 512, progress: Callable[[str], None] = lambda m: None,
                  tensor_parallel_size: int | None = None, distributed_backend: str | None = None,
                  pipeline_parallel_size: int | None = None) -> list[list[WindowScore]]:
    """Per-window sums of every model in `models` (the windows of the module doc, tokenized with the
    first model's tokenizer), each window's reference run shared by the models scored together. ->
    one list of WindowScore per model, in window order (what a bootstrap over windows resamples).

    A model split over N > 1 ranks (`tensor_parallel_size`, else its manifest's) or cut into P > 1
    stages (`pipeline_parallel_size`, likewise) is scored through such an engine's forward, still with
    the ops' references, in a pass of its own: a process belongs to one group at a time, so the
    reference runs again for it."""
    loaded = [load_model(m) for m in models]
    ids = torch.tensor(encode(loaded[0].tokenizer, load_text(data))[:max_tokens], dtype=torch.int64)
    num_windows = ids.numel() // window
    if num_windows == 0:
        raise InputError(f"{data} has {ids.numel()} tokens (max_tokens={max_tokens}), fewer than one window "
                         f"of {window}")
    windows = ids[: num_windows * window].view(num_windows, window)
    sizes = [(_parallel_size(m, tensor_parallel_size, "tensor"), _parallel_size(m, pipeline_parallel_size, "pipeline"))
             for m in models]
    split = [tp * pp > 1 for tp, pp in sizes]
    passes = [p for p in [[i for i, s in enumerate(split) if not s]] + [[i] for i, s in enumerate(split) if s] if p]
    run_ref = _runner(load_model(reference)) if reference is not None else None
    scores: list[list[WindowScore]] = [[] for _ in loaded]
    done = 0
    for indices in passes:
        with contextlib.ExitStack() as stack:
            runs = {i: stack.enter_context(_parallel_runner(models[i], *sizes[i], distributed_backend, window))
                    if split[i] else _runner(loaded[i]) for i in indices}
            for i in range(num_windows):
                done += 1
                progress(f"eval window {done}/{num_windows * len(passes)}")
                _score_window(windows[i:i + 1], run_ref, {j: (runs[j], scores[j]) for j in indices})
    return scores


def _score_window(w: torch.Tensor, run_ref, runs: dict) -> None:
    """Append one window's WindowScore to each model's list; the reference runs once."""
    target = w[0, 1:]
    ref_logp = run_ref(w)[0, :-1].float().log_softmax(-1) if run_ref is not None else None
    for run, out in runs.values():
        logp = run(w)[0, :-1].float().log_softmax(-1)  # (window-1, V)
        nll = float(-logp.gather(-1, target[:, None]).sum())
        ref_nll = kld = 0.0
        agree = 0
        if ref_logp is not None:
            ref_nll = float(-ref_logp.gather(-1, target[:, None]).sum())
            kld = float((ref_logp.exp() * (ref_logp - logp)).sum())
            agree = int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
        out.append(WindowScore(nll, ref_nll, kld, agree, target.numel()))


def summarize_windows(scores: list[WindowScore], has_reference: bool = True) -> dict:
    """{ppl, reference_ppl, kld, top1_agreement, tokens} over the given windows (token-weighted)."""
    count = sum(s.num_tokens for s in scores)
    return {
        "ppl": math.exp(sum(s.nll for s in scores) / count),
        "reference_ppl": math.exp(sum(s.reference_nll for s in scores) / count) if has_reference else None,
        "kld": sum(s.kld for s in scores) / count if has_reference else None,
        "top1_agreement": sum(s.num_agree for s in scores) / count if has_reference else None,
        "tokens": count,
    }


def evaluate_build(graph: Graph, store: TensorStore, source, data: str = DEFAULT_DATA,
                   max_tokens: int = 4096, window: int = 512) -> dict:
    """What `optc build` records as `quality` when the recipe says `eval: true`: the built graph
    against the unoptimized source."""
    with tempfile.TemporaryDirectory(prefix="optc-eval-tok-") as tmp:
        source.save_tokenizer(Path(tmp))
        tokenizer = _tokenizer(Path(tmp))
    return evaluate(Loaded(graph, store, tokenizer), Loaded(source.graph, source.store, tokenizer),
                    data, max_tokens, window)


def load_model(model) -> Loaded:
    """An artifact directory, a model source string, a (graph, store, tokenizer) triple or a Loaded."""
    if isinstance(model, Loaded):
        return model
    if isinstance(model, tuple):
        return Loaded(*model)
    path = Path(str(model))
    if (path / "manifest.json").is_file():
        from optc.core.artifact import read

        artifact = read(path)  # sizes and sha256, graph against weights, as the runtime loads it
        return Loaded(artifact.graph, artifact.store, _tokenizer(artifact.tokenizer_dir))
    from optc.frontend.sources import load_source

    source = load_source(str(model))
    with tempfile.TemporaryDirectory(prefix="optc-eval-tok-") as tmp:
        source.save_tokenizer(Path(tmp))
        tokenizer = _tokenizer(Path(tmp))
    return Loaded(source.graph, source.store, tokenizer)


def _runner(m: Loaded):
    executor = Executor(m.graph, bind_params(m.graph, m.store), use_references=True)  # any graph: Triton-bound too
    return lambda ids: run_dense(executor, ids)


def _parallel_size(model, size: int | None, kind: str) -> int:
    """The given size, else an artifact's runtime.{kind}_parallel_size; 1 for sources and graphs."""
    path = Path(str(model)) if isinstance(model, (str, Path)) else None
    is_artifact = path is not None and (path / "manifest.json").is_file()
    if size is not None:
        if size > 1 and not is_artifact:
            raise InputError(f"--{kind}-parallel-size {size} needs an artifact folder to split, got {str(model)!r}")
        return size
    if not is_artifact:
        return 1
    from optc.core.artifact import read

    return getattr(read(path, verify=False).manifest.runtime, f"{kind}_parallel_size")


@contextlib.contextmanager
def _parallel_runner(path, size: int, stages: int, backend: str | None, window: int) -> Iterator[Callable]:
    """(1, S) ids -> (1, S, V) logits of the artifact split over `size` ranks in each of `stages` stages: one
    prefill of the whole window into a KV pool that holds just it, every row's logits, the ops' references
    on every rank."""
    from optc.core.artifact import read
    from optc.runtime import Engine

    block_size = read(path, verify=False).manifest.kv_layout.block_size
    num_blocks = -(-window // block_size)
    engine = Engine.load(path, tensor_parallel_size=size, pipeline_parallel_size=stages,
                         distributed_backend=backend, use_references=True,
                         num_blocks=num_blocks + 1, enable_prefix_caching=False)  # block 0: the null block
    block_ids = list(range(1, num_blocks + 1))
    try:
        yield lambda ids: engine.runner.forward([ids[0].tolist()], [0], [block_ids], [ids.shape[1]])[None]
    finally:
        engine.close()


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
