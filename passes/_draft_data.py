"""The data a draft head trains on (passes/train_draft_head.py): the target's own answers to chat
prompts (greedy, batched, through a paged KV cache), with the features the target computed while it
generated them, and the target's features and greedy tokens over any token sequence.

The target runs on `data_executor`: on the cpu target its nodes bound to the first CPU kernel that
takes each (select_kernels' binding without measuring), the kernels the runtime drafts from, at a
fraction of the op references' time; on another target, the references (a build for cuda may run
where the kernels cannot). Not here: what the head is or how it trains.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from optc.core.errors import InputError
from optc.core.execute import Executor, Step, bind_params, graph_kv_spec, run_dense
from optc.core.ir import REFERENCE_KERNEL, Graph
from optc.core.kv_cache import KVCacheSpec
from optc.core.rope import cos_sin_tables
from optc.core.store import TensorStore
from optc.frontend.passmanager import PassContext


@dataclass
class _Batch:
    """The batch fields the attention ops read (the runtime's ForwardBatch, without the runtime)."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int


@dataclass
class Answer:
    """A prompt and the target's greedy answer: `token_ids` (L,) the prompt's then the answer's; `features`
    (L - 1, H) float32 the lm_head's input at every position but the last (the target never computed the
    last token); `greedy` (L - 1,) the target's greedy next token at each of them, -1 inside the prompt
    (only the prompt's last position got logits)."""

    token_ids: torch.Tensor
    features: torch.Tensor
    greedy: torch.Tensor
    prompt_len: int


def data_executor(graph: Graph, store: TensorStore, ctx: PassContext) -> Executor:
    """The executor the data is computed on (see the module's doc)."""
    params = bind_params(graph, store)
    if ctx.target != "cpu":
        return Executor(graph, params, use_references=True)
    from optc.frontend.passmanager import make_pass  # by name: a pass never imports another pass
    from optc.kernels.registry import impls

    bound = make_pass("select_kernels", {"measure": False}).run(graph, store, ctx).graph
    names = {n.kernel for n in bound.nodes} - {REFERENCE_KERNEL}
    return Executor(bound, params, impls(names) if names else {})


def read_prompts(path: str) -> list[str]:
    """Prompts of a .txt file (one per non-empty line) or a .jsonl file (the `prompt` field of every line)."""
    file = Path(path)
    if not file.is_file():
        raise InputError(f"train_draft_head prompts {path!r}: no such file (a .txt with a prompt per line or a "
                         f".jsonl with a 'prompt' field)")
    lines = [line for line in file.read_text().splitlines() if line.strip()]
    if file.suffix == ".jsonl":
        try:
            return [json.loads(line)["prompt"] for line in lines]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InputError(f"train_draft_head prompts {path}: every line must be JSON with a 'prompt' field "
                             f"({type(e).__name__}: {e})") from None
    if file.suffix != ".txt":
        raise InputError(f"train_draft_head prompts {path}: expected a .txt or .jsonl file")
    return lines


@torch.no_grad()
def generate(executor: Executor, graph: Graph, prompts: list[list[int]], max_new_tokens: int,
             batch_size: int = 64, progress: Any = None) -> list[Answer]:
    """Each prompt's greedy answer (up to `max_new_tokens`, ending at an EOS token), `batch_size` prompts
    at a time: one prefill forward, then one forward per token; the features come from those forwards."""
    answers = []
    batches = range(0, len(prompts), batch_size)
    for first in (progress(batches) if progress is not None else batches):
        answers += _generate_batch(executor, graph, prompts[first : first + batch_size], max_new_tokens)
    return answers


def _generate_batch(executor: Executor, graph: Graph, prompts: list[list[int]],
                    max_new_tokens: int) -> list[Answer]:
    c = graph.config
    spec = graph_kv_spec(graph) or KVCacheSpec(dtype=c.dtype)
    size = spec.block_size
    total = max(len(p) for p in prompts) + max_new_tokens
    per_request = -(-total // size)
    caches = spec.allocate(c, 1 + len(prompts) * per_request, "cpu")
    tables = torch.arange(1, 1 + len(prompts) * per_request, dtype=torch.int32).view(len(prompts), per_request)
    cos_sin = cos_sin_tables(c, total)
    eos = set(c.eos_token_ids)
    sequences = [list(p) for p in prompts]
    features: list[list[torch.Tensor]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    new = [list(p) for p in prompts]  # each active request's tokens not yet computed
    captured = {}

    def hook(i, node, inputs, outputs) -> None:
        if node.op == "lm_head":
            captured["feature"] = inputs[0].float()

    for _ in range(max_new_tokens):
        starts = [len(sequences[b]) - len(new[b]) for b in active]
        logits = executor.run(*_step(new, active, starts, tables, size, cos_sin, caches), hook)["logits"]
        rows = captured.pop("feature").split([len(new[b]) for b in active])
        still = []
        for row, b in enumerate(active):
            features[b].append(rows[row])
            token = int(logits[row].argmax())
            sequences[b].append(token)
            if token not in eos:
                still.append(b)
        new = [[sequences[b][-1]] if b in still else [] for b in range(len(prompts))]
        active = still
        if not active:
            break
    answers = []
    for prompt, tokens, rows in zip(prompts, sequences, features, strict=True):
        greedy = torch.tensor([-1] * (len(prompt) - 1) + tokens[len(prompt):])
        answers.append(Answer(torch.tensor(tokens), torch.cat(rows), greedy, len(prompt)))
    return answers


def target_outputs(executor: Executor, sequences: list[torch.Tensor],
                   progress: Any = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """float32 features (L, H) (the lm_head's input) and greedy next tokens (L,) of each sequence."""
    features, greedy = [], []
    captured = {}

    def hook(i, node, inputs, outputs) -> None:
        if node.op == "lm_head":
            captured["feature"] = inputs[0].float()

    with torch.no_grad():
        for tokens in (progress(sequences) if progress is not None else sequences):
            logits = run_dense(executor, tokens[None], hook)  # (1, L, V)
            features.append(captured.pop("feature").reshape(len(tokens), -1))
            greedy.append(logits[0].argmax(-1))
    return features, greedy


def _step(new: list[list[int]], active: list[int], starts: list[int], tables: torch.Tensor, size: int,
          cos_sin: dict, caches: list) -> tuple[torch.Tensor, Step]:
    """The executor's arguments for the active requests' new tokens, request b in blocks tables[b]."""
    ids, positions, slots, ends = [], [], [], [0]
    for b, start in zip(active, starts, strict=True):
        pos = torch.arange(start, start + len(new[b]))
        ids.append(torch.tensor(new[b]))
        positions.append(pos)
        slots.append(tables[b].long()[pos // size] * size + pos % size)
        ends.append(ends[-1] + len(new[b]))
    query_start_loc = torch.tensor(ends, dtype=torch.int32)
    seq_lens = torch.tensor([s + len(new[b]) for b, s in zip(active, starts, strict=True)], dtype=torch.int32)
    batch = _Batch(tables[active], seq_lens, query_start_loc, torch.cat(slots),
                   max(len(new[b]) for b in active), int(seq_lens.max()))
    step = Step(torch.cat(positions), batch, cos_sin, query_start_loc[1:].long() - 1, caches)
    return torch.cat(ids), step
