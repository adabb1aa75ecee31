"""Train an EAGLE draft head (optc/core/eagle.py) for the graph's model and store it in the artifact.

Data (`data`): `corpus`, the recipe's calibration text (its `calibration:` section: source, windows,
length, seed), the first `samples` windows; `self`, the target's own greedy answers (up to
`answer_tokens`, `generate_batch` prompts at a time) to the chat prompts of the `prompts` file (its
first `max_prompts`), under the tokenizer's chat template (EAGLE's authors found such self-distilled
data matters: the head learns what the target says, not what a corpus says); `both`, the corpus
windows then the answers. The last `validation_windows` sequences are held out. The target's feature
at every position (the lm_head's input) and its greedy next token come from the forwards that
generated the answers, or one forward over a corpus window (passes/_draft_data.py: on the cpu target
through its CPU kernels, the ones decoding drafts from). The head's reduced vocabulary: the
`vocab_size` tokens the target predicted most often on the training sequences (then the lowest ids).
Training and the validation proxy: passes/_draft_training.py (teacher-forced, each entry unrolled `unroll`
draft steps deep, under bf16 autocast; a prompt's positions are trained on unless `enable_prompt_loss` is
false: with them the head drafted answers slightly better, docs/PERF.md; the same options and data give the
same head). Validation: chain acceptance
on the held-out sequences, from every 8th position where decoding drafts (an answer's, not its
prompt's).

The stats and the manifest's `draft_head` section record the loss curve (every `steps / 20` steps), the
validation acceptance rate per position and the mean acceptance length. The head's tensors
(`eagle.*`) go into the tensor table as dense weights of the graph's dtype, beside the nodes (no
node reads them); the runtime reads them with `--speculative eagle`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field

import torch

from optc.core.eagle import PREFIX, EagleHead, EagleHeadConfig, init_weights
from optc.core.errors import InputError
from optc.core.execute import Executor
from optc.core.formats import DTYPES, Format
from optc.core.ir import Graph, TensorInfo
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.frontend.quant.blocks import tensor_entry
from optc.passes._draft_data import data_executor, generate, read_prompts, target_outputs
from optc.passes._draft_training import Optimizer, train, validate


class Data(enum.StrEnum):
    CORPUS = "corpus"  # the recipe's calibration windows
    SELF = "self"  # the target's own greedy answers to the `prompts` file's chat prompts
    BOTH = "both"  # corpus windows, then self-generated answers (validation: the last answers)


class TrainDraftHead(Pass):
    """Train an EAGLE draft head on the target's own features; store it beside the graph."""

    @dataclass(frozen=True)
    class Options:
        data: Data = field(default=Data.CORPUS, metadata={"help": "corpus, self or both (see the pass's doc)"})
        prompts: str | None = field(default=None, metadata={
            "help": "chat prompts the target answers for data self/both: a .txt (one per line) or .jsonl file"})
        max_prompts: int | None = field(default=None, metadata={"help": "answer only the file's first prompts"})
        answer_tokens: int = field(default=128, metadata={"min": 1, "help": "longest self-generated answer"})
        generate_batch: int = field(default=64, metadata={"min": 1, "help": "prompts the target answers at once"})
        steps: int = field(default=300, metadata={"min": 1, "help": "optimizer steps (one window each)"})
        lr: float = field(default=1e-3, metadata={"gt": 0.0, "help": "peak learning rate (cosine decay)"})
        optimizer: Optimizer = field(default=Optimizer.ADAMW, metadata={"help": "adamw or sgd (momentum 0.9)"})
        samples: int = field(default=16, metadata={"min": 2, "help": "calibration windows used (train + validation)"})
        validation_windows: int = field(default=2, metadata={"min": 1, "help": "windows held out for validation"})
        vocab_size: int = field(default=8192, metadata={"min": 1, "help": "the head's reduced vocabulary"})
        intermediate_size: int | None = field(default=None, metadata={"help": "head MLP width; default: the model's"})
        ce_weight: float = field(default=0.1, metadata={"min": 0.0, "help": "weight of the token loss"})
        noise: float = field(default=0.1, metadata={"min": 0.0, "help": "feature noise, times the features' std"})
        validation_k: int = field(default=4, metadata={"min": 1, "help": "draft length of the validation chains"})
        max_minutes: float = field(default=15.0, metadata={"gt": 0.0, "help": "stop training after this long"})
        crop: int = field(default=256, metadata={"min": 8, "help": "tokens of a window one step trains on"})
        unroll: int = field(default=2, metadata={"min": 1, "help": "draft steps deep each entry is trained"})
        enable_prompt_loss: bool = field(default=True, metadata={
            "help": "also train on a prompt's positions (its user text is language; false: answers only)"})
        enable_bf16: bool = field(default=True, metadata={
            "help": "train under bfloat16 autocast (float32 weights and optimizer state; ~1.7x a CPU step)"})
        seed: int = field(default=0, metadata={"min": 0, "help": "seed of the init, window order and noise"})

        def __post_init__(self) -> None:
            for key, kind in (("optimizer", Optimizer), ("data", Data)):
                try:
                    object.__setattr__(self, key, kind(getattr(self, key)))
                except ValueError:
                    raise InputError(f"train_draft_head {key} {getattr(self, key)!r}; allowed: "
                                     f"{', '.join(o.value for o in kind)}") from None
            if self.data is not Data.CORPUS and self.prompts is None:
                raise InputError(f"train_draft_head data {self.data.value} needs prompts: a .txt or .jsonl file")
            if self.data is Data.CORPUS and self.validation_windows >= self.samples:
                raise InputError(f"train_draft_head validation_windows ({self.validation_windows}) must be fewer "
                                 f"than samples ({self.samples})")

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        if f"{PREFIX}.fc.weight" in graph.tensors:
            return PassResult(graph, store, changed=False, stats={"trained": 0})
        o = self.options
        t0 = time.perf_counter()
        executor = data_executor(graph, store, ctx)
        tokens, features, greedy, starts = _data(executor, graph, o, ctx)
        embedding, lm_head = _target_tables(executor, graph)
        num_train = len(tokens) - o.validation_windows
        config = _head_config(graph, o, torch.cat(greedy[:num_train]))
        vocab_ids = torch.tensor(config.vocab_ids)
        index = torch.full((graph.config.vocab_size,), -100, dtype=torch.long)
        index[vocab_ids] = torch.arange(len(vocab_ids))
        weights = init_weights(config, torch.Generator().manual_seed(o.seed))
        head = EagleHead(config, weights, embedding, lm_head[vocab_ids])
        extract_seconds = time.perf_counter() - t0
        labels = [torch.where(g >= 0, index[g.clamp(min=0)], -100) for g in greedy[:num_train]]
        # the positions trained on: all, or only those decoding drafts from (greedy token known: an answer's)
        scored = [torch.ones_like(g, dtype=torch.bool) if o.enable_prompt_loss else g >= 0 for g in greedy[:num_train]]
        curve, seconds = train(head, weights, tokens[:num_train], features[:num_train], labels, scored, o,
                               ctx.show_progress_bars)
        with torch.no_grad():
            per_position = validate(head, tokens[num_train:], features[num_train:], greedy[num_train:],
                                    starts[num_train:], o.validation_k)
        length = 1 + sum(per_position)  # per_position[j] counts chains whose drafts 0..j all matched
        train_tokens = sum(len(t) for t in tokens[:num_train])
        record = {"loss_curve": curve, "validation_acceptance_per_position": [round(a, 4) for a in per_position],
                  "validation_mean_acceptance_length": round(length, 4), "train_tokens": train_tokens,
                  "validation_tokens": sum(len(t) for t in tokens[num_train:]),
                  "extract_seconds": round(extract_seconds, 1),
                  "train_seconds": round(seconds, 1)}
        dtype = graph.config.dtype
        new = graph.copy()
        entries = {}
        for name, w in weights.items():
            new.tensors[name] = TensorInfo(tuple(w.shape), Format(dtype=dtype))
            entries[name] = tensor_entry(w.detach().to(DTYPES[dtype]).contiguous())
        section = {"method": "eagle", "config": config.to_json(), "options": _options_json(o), "training": record}
        stats = {"trained": 1, "mean_acceptance_length": record["validation_mean_acceptance_length"],
                 "final_loss": curve[-1][1], "train_seconds": record["train_seconds"], **record}
        return PassResult(new, store.with_entries(entries), changed=True, stats=stats,
                          manifest={"draft_head": section})


def _data(executor: Executor, graph: Graph, o: TrainDraftHead.Options, ctx: PassContext) -> tuple[list, ...]:
    """The sequences of `o.data` (corpus windows, then self-generated answers): token ids (L,), the
    target's features (L, H) and greedy next tokens (L,; -1 where unknown, inside a prompt), and the first
    position a validation chain starts at in each (an answer's: its prompt's last)."""
    tokens, features, greedy, starts = [], [], [], []
    if o.data is not Data.SELF:
        if ctx.calibration_tokens is None:
            raise InputError("train_draft_head data corpus needs calibration text (the recipe's calibration: section)")
        windows = ctx.calibration_tokens()[: o.samples]
        if windows.shape[0] < o.samples:
            raise InputError(f"train_draft_head samples {o.samples}: the calibration has {windows.shape[0]} windows; "
                             f"raise calibration.samples or lower samples")
        tokens += list(windows)
        window_features, window_greedy = target_outputs(
            executor, tokens, _progress(ctx, "train_draft_head: target features", "window"))
        features += window_features
        greedy += window_greedy
        starts += [0] * len(windows)
    if o.data is not Data.CORPUS:
        if ctx.tokenizer is None:
            raise InputError("train_draft_head data self needs the model's tokenizer (a build passes it)")
        tokenizer = ctx.tokenizer()
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
                   for p in read_prompts(o.prompts)[: o.max_prompts]]
        for answer in generate(executor, graph, prompts, o.answer_tokens, o.generate_batch,
                               _progress(ctx, "train_draft_head: self-generated answers", "batch")):
            tokens.append(answer.token_ids[:-1])  # the last token was never computed: no feature
            features.append(answer.features)
            greedy.append(answer.greedy)
            starts.append(answer.prompt_len - 1)
    if len(tokens) <= o.validation_windows:
        raise InputError(f"train_draft_head: {len(tokens)} sequences, not more than validation_windows "
                         f"({o.validation_windows}); give more samples or prompts")
    return tokens, features, greedy, starts


def _progress(ctx: PassContext, desc: str, unit: str):
    """A tqdm wrapper when the build shows progress bars, else None."""
    if not ctx.show_progress_bars:
        return None
    from tqdm import tqdm

    return lambda items: tqdm(items, desc=desc, unit=unit, leave=False)


def _target_tables(executor: Executor, graph: Graph) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and lm_head weights, float32 (frozen in training)."""
    nodes = {n.op: n for n in graph.nodes if n.op in ("embedding", "lm_head")}
    return tuple(executor.params[nodes[op].params["weight"]].dense(torch.float32) for op in ("embedding", "lm_head"))


def _head_config(graph: Graph, o: TrainDraftHead.Options, greedy: torch.Tensor) -> EagleHeadConfig:
    """The head's shape from the model's layer; its vocabulary: the most frequent greedy tokens first."""
    c = graph.config
    size = min(o.vocab_size, c.vocab_size)
    counts = torch.bincount(greedy[greedy >= 0], minlength=c.vocab_size)
    # frequency first, lower id first among equals (a stable sort of ids by count)
    order = torch.sort(counts, descending=True, stable=True).indices[:size]
    return EagleHeadConfig(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                           o.intermediate_size or c.intermediate_size, c.rms_norm_eps, c.rope_theta,
                           tuple(sorted(order.tolist())))


def _options_json(o: TrainDraftHead.Options) -> dict:
    return {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in asdict(o).items()}
