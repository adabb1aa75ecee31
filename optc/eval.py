"""Quality of a built model against a reference: perplexity, KL divergence and top-1 agreement on
fixed windows of held-out text.

Windows (stated in the result): the text is tokenized once, the first `max_tokens` tokens are cut
into consecutive, non-overlapping windows of `window` tokens starting at token 0 (a final partial
window is dropped); every window is scored from position 0 with no context before it. Over the
window-1 predicted positions of every window: ppl = exp(mean NLL of the next token), kld = mean
KL(reference ‖ model) of the next-token distributions, top1_agreement = share of positions whose
argmax agrees. Everything is computed on the CPU reference kernels, in the graph's dtype.

A model is an artifact directory, a model source string (anything `optc build` accepts as
`model:`), or a (Graph, TensorStore, tokenizer) triple. Not here: building or serving.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from optc.calibration import encode, load_text
from optc.errors import InputError
from optc.execute import Executor, bind_params, run_dense
from optc.ir import Graph
from optc.store import TensorStore

DEFAULT_DATA = "builtin:pydoc-heldout"


@dataclass(frozen=True)
class Loaded:
    graph: Graph
    store: TensorStore
    tokenizer: object


def evaluate(model, reference=None, data: str = DEFAULT_DATA, max_tokens: int = 8192, window: int = 512,
             progress: Callable[[str], None] = lambda m: None) -> dict:
    """-> {ppl, reference_ppl, kld, top1_agreement, tokens, windows, window, data}; the reference
    keys are None without a reference. The tokenizer is the model's."""
    m = load_model(model)
    ids = torch.tensor(encode(m.tokenizer, load_text(data))[:max_tokens], dtype=torch.int64)
    num_windows = ids.numel() // window
    if num_windows == 0:
        raise InputError(f"{data} has {ids.numel()} tokens (max_tokens={max_tokens}), fewer than one window "
                         f"of {window}")
    windows = ids[: num_windows * window].view(num_windows, window)
    ref = load_model(reference) if reference is not None else None
    run = _runner(m)
    run_ref = _runner(ref) if ref is not None else None
    nll = ref_nll = kld = agree = 0.0
    count = 0
    for i in range(num_windows):
        progress(f"eval window {i + 1}/{num_windows}")
        w = windows[i:i + 1]
        logp = run(w)[0, :-1].float().log_softmax(-1)  # (window-1, V)
        target = w[0, 1:]
        nll += float(-logp.gather(-1, target[:, None]).sum())
        if run_ref is not None:
            ref_logp = run_ref(w)[0, :-1].float().log_softmax(-1)
            ref_nll += float(-ref_logp.gather(-1, target[:, None]).sum())
            kld += float((ref_logp.exp() * (ref_logp - logp)).sum())
            agree += float((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
        count += target.numel()
    has_ref = run_ref is not None
    return {
        "ppl": math.exp(nll / count),
        "reference_ppl": math.exp(ref_nll / count) if has_ref else None,
        "kld": kld / count if has_ref else None,
        "top1_agreement": agree / count if has_ref else None,
        "tokens": count,
        "windows": num_windows,
        "window": window,
        "data": data,
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
        from optc.artifact import read

        artifact = read(path)  # sizes and sha256, graph against weights, as the runtime loads it
        return Loaded(artifact.graph, artifact.store, _tokenizer(artifact.tokenizer_dir))
    from optc.sources import load_source

    source = load_source(str(model))
    with tempfile.TemporaryDirectory(prefix="optc-eval-tok-") as tmp:
        source.save_tokenizer(Path(tmp))
        tokenizer = _tokenizer(Path(tmp))
    return Loaded(source.graph, source.store, tokenizer)


def _runner(m: Loaded):
    executor = Executor(m.graph, bind_params(m.graph, m.store))
    return lambda ids: run_dense(executor, ids)


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
