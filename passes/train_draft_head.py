"""Train an EAGLE draft head (optc/core/eagle.py) for the graph's model and store it in the artifact.

Data (`data`): `corpus`, the recipe's calibration text (its `calibration:` section: source, windows,
length, seed), the first `samples` windows; `self`, the target's own greedy answers (up to
`answer_tokens`) to the chat prompts of the `prompts` file, under the tokenizer's chat template (EAGLE's
authors found such self-distilled data matters: the head learns what the target says, not what a corpus
says); `both`, the corpus windows then the answers. The last `validation_windows` sequences are held
out. The target runs once over the sequences (the graph as the passes before left it, on the op
references): its feature at every position (the lm_head's input) and its greedy next token. Training is
teacher-forced as EAGLE's: entry p gets (token p + 1, feature p, plus uniform noise of `noise` x the
features' std) and is scored by a smooth L1 loss to feature p + 1 plus `ce_weight` x the cross entropy
of its logits against the target's greedy token at p + 1, over the head's reduced vocabulary: the
`vocab_size` tokens the target predicted most often on the training windows (then the lowest ids). Each
entry is also trained `unroll` draft steps deep on its own predictions (EAGLE-3's training-time test,
`_window_loss`): without it the second draft, which reads a predicted feature, is rarely right. One
`crop`-token slice of one window per step, drawn by the seeded generator, AdamW (or SGD) with warm-up,
cosine decay and gradient clipping: the same options and data give the same head.

Validation: chain acceptance on the held-out windows, a greedy proxy of decoding: from each position
p (every 8th), the head drafts `validation_k` tokens from the real entries up to p, feeding back its
own predictions, and draft j counts while it equals the target's greedy token at p + j. The stats
and the manifest's `draft_head` section record the loss curve (every `steps / 20` steps), the
validation acceptance rate per position and the mean acceptance length. The head's tensors
(`eagle.*`) go into the tensor table as dense weights of the graph's dtype, beside the nodes (no
node reads them); the runtime reads them with `--speculative eagle`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from optc.core.eagle import PREFIX, EagleHead, EagleHeadConfig, init_weights
from optc.core.errors import InputError
from optc.core.execute import Executor, bind_params
from optc.core.formats import DTYPES, Format
from optc.core.ir import Graph, TensorInfo
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.frontend.quant.blocks import tensor_entry
from optc.passes._draft_data import generate, read_prompts, target_outputs

VALIDATION_STRIDE = 8  # validation drafts from every 8th position of a held-out window


class Optimizer(enum.StrEnum):
    ADAMW = "adamw"
    SGD = "sgd"


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
        answer_tokens: int = field(default=128, metadata={"min": 1, "help": "longest self-generated answer"})
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
        executor = Executor(graph, bind_params(graph, store), use_references=True)
        sequences = _sequences(executor, graph, o, ctx)
        bar = _progress(ctx, "train_draft_head: target features", "sequence")
        features, greedy = target_outputs(executor, sequences, bar)
        embedding, lm_head = _target_tables(executor, graph)
        num_train = len(sequences) - o.validation_windows
        config = _head_config(graph, o, torch.cat(greedy[:num_train]))
        vocab_ids = torch.tensor(config.vocab_ids)
        index = torch.full((graph.config.vocab_size,), -100, dtype=torch.long)
        index[vocab_ids] = torch.arange(len(vocab_ids))
        weights = init_weights(config, torch.Generator().manual_seed(o.seed))
        head = EagleHead(config, weights, embedding, lm_head[vocab_ids])
        extract_seconds = time.perf_counter() - t0
        labels = [index[g] for g in greedy[:num_train]]
        curve, seconds = _train(head, weights, sequences[:num_train], features[:num_train], labels, o, ctx)
        with torch.no_grad():
            per_position = _validate(head, sequences[num_train:], features[num_train:], greedy[num_train:],
                                     o.validation_k)
        length = 1 + sum(per_position)  # per_position[j] counts chains whose drafts 0..j all matched
        train_tokens = sum(len(t) for t in sequences[:num_train])
        record = {"loss_curve": curve, "validation_acceptance_per_position": [round(a, 4) for a in per_position],
                  "validation_mean_acceptance_length": round(length, 4), "train_tokens": train_tokens,
                  "validation_tokens": sum(len(t) for t in sequences[num_train:]),
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


def _sequences(executor: Executor, graph: Graph, o: TrainDraftHead.Options, ctx: PassContext) -> list[torch.Tensor]:
    """The token sequences of `o.data`: corpus windows, then self-generated answers."""
    sequences = []
    if o.data is not Data.SELF:
        if ctx.calibration_tokens is None:
            raise InputError("train_draft_head data corpus needs calibration text (the recipe's calibration: section)")
        tokens = ctx.calibration_tokens()[: o.samples]
        if tokens.shape[0] < o.samples:
            raise InputError(f"train_draft_head samples {o.samples}: the calibration has {tokens.shape[0]} windows; "
                             f"raise calibration.samples or lower samples")
        sequences += list(tokens)
    if o.data is not Data.CORPUS:
        if ctx.tokenizer is None:
            raise InputError("train_draft_head data self needs the model's tokenizer (a build passes it)")
        tokenizer = ctx.tokenizer()
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
                   for p in read_prompts(o.prompts)]
        sequences += generate(executor, graph, prompts, o.answer_tokens,
                              _progress(ctx, "train_draft_head: self-generated answers", "token"))
    if len(sequences) <= o.validation_windows:
        raise InputError(f"train_draft_head: {len(sequences)} sequences, not more than validation_windows "
                         f"({o.validation_windows}); give more samples or prompts")
    return sequences


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
    counts = torch.bincount(greedy.flatten(), minlength=c.vocab_size)
    # frequency first, lower id first among equals (a stable sort of ids by count)
    order = torch.sort(counts, descending=True, stable=True).indices[:size]
    return EagleHeadConfig(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                           o.intermediate_size or c.intermediate_size, c.rms_norm_eps, c.rope_theta,
                           tuple(sorted(order.tolist())))


def _train(head: EagleHead, weights: dict[str, torch.Tensor], tokens: list[torch.Tensor],
           features: list[torch.Tensor], labels: list[torch.Tensor], o: TrainDraftHead.Options,
           ctx: PassContext) -> tuple[list, float]:
    """Teacher-forced training; the loss curve [(step, loss)] and the seconds it took."""
    generator = torch.Generator().manual_seed(o.seed)
    for w in weights.values():
        w.requires_grad_(True)
    params = list(weights.values())
    opt = (torch.optim.AdamW(params, lr=o.lr, weight_decay=0.0) if o.optimizer is Optimizer.ADAMW
           else torch.optim.SGD(params, lr=o.lr, momentum=0.9))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * s / o.steps)).item()))
    std = torch.cat(features).std().item()
    num = len(tokens)
    every = max(1, o.steps // 20)
    curve, running, t0 = [], 0.0, time.perf_counter()
    steps = range(o.steps)
    if ctx.show_progress_bars:
        from tqdm import tqdm

        steps = tqdm(steps, desc="train_draft_head", unit="step", leave=False)
    for step in steps:
        s = int(torch.randint(num, (1,), generator=generator))
        crop = min(o.crop, len(tokens[s]))
        a = int(torch.randint(len(tokens[s]) - crop + 1, (1,), generator=generator))
        f = features[s][a : a + crop]
        noisy = f + (torch.rand(f.shape, generator=generator) * 2 - 1) * (o.noise * std) if o.noise else f
        loss = _window_loss(head, tokens[s][a : a + crop], noisy, f, labels[s][a : a + crop], o)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        schedule.step()
        running += loss.item()
        if (step + 1) % every == 0 or step + 1 == o.steps:
            curve.append((step + 1, round(running / ((step % every) + 1), 5)))
            running = 0.0
        if time.perf_counter() - t0 > 60 * o.max_minutes:
            curve.append((step + 1, round(loss.item(), 5)))
            break
    for w in weights.values():
        w.requires_grad_(False)
    return curve, time.perf_counter() - t0


def _window_loss(head: EagleHead, tokens: torch.Tensor, noisy: torch.Tensor, features: torch.Tensor,
                 labels: torch.Tensor, o: TrainDraftHead.Options) -> torch.Tensor:
    """The loss of one window (L tokens), unrolled `o.unroll` draft steps deep (EAGLE-3's training-time
    test): level d's entry p is the d-th draft after the real entries 0..p: it reads level d - 1's predicted
    feature with token p + d at position p + d - 1, sees real entries <= p and its own level-l entry p of
    every level l < d, and is scored against feature p + d and the target's greedy token there."""
    length = tokens.shape[0]
    count = length - 1  # level 1: entries 0 .. L - 2
    inputs, positions = noisy[:count], torch.arange(count)
    keys, values, total = [], [], torch.zeros((), dtype=torch.float32)
    for d in range(1, min(o.unroll, length - 1) + 1):
        if d == 1:
            mask = None
        else:  # real entries <= p, then the diagonal of every earlier level and of this one
            eyes = [torch.eye(count, length - level, dtype=torch.bool) for level in range(2, d + 1)]
            mask = torch.cat([torch.ones(count, length - 1, dtype=torch.bool).tril(), *eyes], dim=1)
        cache = None if d == 1 else (torch.cat(keys), torch.cat(values))
        predicted, (k, v) = head.forward(tokens[d : d + count], inputs, positions, cache, mask)
        keys.append(k)
        values.append(v)
        loss = F.smooth_l1_loss(predicted, features[d : d + count])
        if o.ce_weight:
            ce = F.cross_entropy(head.logits(predicted), labels[d : d + count], ignore_index=-100)
            loss = loss + o.ce_weight * ce
        total = total + loss
        count -= 1  # the next level drafts from every entry whose target exists
        inputs, positions = predicted[:count], positions[:count] + 1
    return total / min(o.unroll, length - 1)


def _validate(head: EagleHead, tokens: list[torch.Tensor], features: list[torch.Tensor],
              greedy: list[torch.Tensor], k: int) -> list[float]:
    """Per draft position j: the fraction of chains whose first j + 1 drafts all match the target's greedy
    tokens (position 0: the first draft's accuracy)."""
    vocab_ids = torch.tensor(head.config.vocab_ids)
    matched, tried = [0] * k, 0
    for s in range(len(tokens)):
        length = len(tokens[s])
        out, (keys, values) = head.forward(tokens[s][1:], features[s][:-1], torch.arange(length - 1))
        for p in range(0, length - 1 - k, VALIDATION_STRIDE):
            # real entries 0..p predict the feature of p + 1, whose token the target's greedy[p + 1] is
            feature, cache = out[p], (keys[: p + 1], values[: p + 1])
            tried += 1
            for j in range(k):
                token = vocab_ids[head.logits(feature[None])[0].argmax()]
                if token != greedy[s][p + 1 + j]:
                    break
                matched[j] += 1
                nxt, (k_new, v_new) = head.forward(token[None], feature[None], torch.tensor([p + 1 + j]), cache)
                cache = (torch.cat([cache[0], k_new]), torch.cat([cache[1], v_new]))
                feature = nxt[0]
    return [m / max(1, tried) for m in matched]


def _options_json(o: TrainDraftHead.Options) -> dict:
    return {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in asdict(o).items()}
