"""The training loop of an EAGLE draft head (passes/train_draft_head.py) and its validation proxy.

`train`: teacher-forced, as EAGLE's: entry p gets (token p + 1, feature p, plus uniform noise of `noise` x
the features' std) and is scored by a smooth L1 loss to feature p + 1 plus `ce_weight` x the cross entropy
of its logits against the target's greedy token at p + 1 over the head's reduced vocabulary, each entry
also trained `unroll` draft steps deep on its own predictions (`_window_loss`), where `scored` says (every
position, or an answer's only: where decoding drafts). One `crop`-token slice of
one sequence per step, drawn by the seeded generator; AdamW (or SGD) with warm-up, cosine decay and
gradient clipping; the forward and backward under bfloat16 autocast (`enable_bf16`; float32 weights,
gradients and optimizer state): the same options and data give the same head. `o` is the pass's options
(TrainDraftHead.Options: a helper does not import its pass).

`validate`: chain acceptance, a greedy proxy of decoding, from positions where decoding drafts (a
self-generated sequence's answer, not its prompt: the chat template's fixed text is easy to predict
and no draft ever starts there). Not here: the data, the head's shape, the artifact.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import torch
import torch.nn.functional as F

from optc.core.eagle import EagleHead

VALIDATION_STRIDE = 8  # validation drafts from every 8th position of a held-out sequence


class Optimizer(enum.StrEnum):
    ADAMW = "adamw"
    SGD = "sgd"


def train(head: EagleHead, weights: dict[str, torch.Tensor], tokens: list[torch.Tensor],
          features: list[torch.Tensor], labels: list[torch.Tensor], scored: list[torch.Tensor], o: Any,
          show_progress: bool = False) -> tuple[list, float]:
    """Teacher-forced training; the loss curve [(step, loss)] and the seconds it took. `labels` (L,): the
    target's greedy next token at each position as an index into the head's vocabulary (-100: unknown or
    outside it); `scored` (L,) bool: the positions whose next feature and token are trained on."""
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
    if show_progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc="train_draft_head", unit="step", leave=False)
    for step in steps:
        s = int(torch.randint(num, (1,), generator=generator))
        crop = min(o.crop, len(tokens[s]))
        a = int(torch.randint(len(tokens[s]) - crop + 1, (1,), generator=generator))
        f = features[s][a : a + crop]
        noisy = f + (torch.rand(f.shape, generator=generator) * 2 - 1) * (o.noise * std) if o.noise else f
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=o.enable_bf16):
            loss = _window_loss(head, tokens[s][a : a + crop], noisy, f, labels[s][a : a + crop],
                                scored[s][a : a + crop], o)
        if loss.requires_grad:  # else the window lies inside a prompt (a short `crop`): nothing to score
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
                 labels: torch.Tensor, scored: torch.Tensor, o: Any) -> torch.Tensor:
    """The loss of one window (L tokens), unrolled `o.unroll` draft steps deep (EAGLE-3's training-time
    test): level d's entry p is the d-th draft after the real entries 0..p: it reads level d - 1's predicted
    feature with token p + d at position p + d - 1, sees real entries <= p and its own level-l entry p of
    every level l < d, and is scored against feature p + d and the target's greedy token there where
    `scored[p + d]`."""
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
        keep = scored[d : d + count]
        if keep.any():
            loss = F.smooth_l1_loss(predicted[keep], features[d : d + count][keep])
            if o.ce_weight and (labels[d : d + count][keep] >= 0).any():
                ce = F.cross_entropy(head.logits(predicted[keep]), labels[d : d + count][keep], ignore_index=-100)
                loss = loss + o.ce_weight * ce
            total = total + loss
        count -= 1  # the next level drafts from every entry whose target exists
        inputs, positions = predicted[:count], positions[:count] + 1
    return total / min(o.unroll, length - 1)


def validate(head: EagleHead, tokens: list[torch.Tensor], features: list[torch.Tensor],
             greedy: list[torch.Tensor], starts: list[int], k: int, stride: int = VALIDATION_STRIDE) -> list[float]:
    """Per draft position j: the fraction of chains whose first j + 1 drafts all match the target's greedy
    tokens (position 0: the first draft's accuracy). Sequence s's chains start at positions starts[s],
    starts[s] + stride, ...: position p drafts tokens p + 2 .. p + k + 1 (decoding's first
    draft after a prompt of P tokens is from p = P - 1)."""
    matched, tried = [0] * k, 0
    for s in range(len(tokens)):
        length = len(tokens[s])
        out, (keys, values) = head.forward(tokens[s][1:], features[s][:-1], torch.arange(length - 1))
        for p in range(starts[s], length - 1 - k, stride):
            tried += 1
            # draft j is the target's token p + 2 + j, its greedy prediction at p + 1 + j
            for j, token in enumerate(_chain(head, out[p], (keys[: p + 1], values[: p + 1]), p, k)):
                if token != greedy[s][p + 1 + j]:
                    break
                matched[j] += 1
    return [m / max(1, tried) for m in matched]


def chain_drafts(head: EagleHead, tokens: torch.Tensor, features: torch.Tensor, p: int, k: int) -> list[int]:
    """The k tokens the head drafts after real entries 0..p of a sequence (tokens (L,), features (L, H)),
    each fed back with its predicted feature: what decoding drafts once the target computed 0..p."""
    out, cache = head.forward(tokens[1 : p + 2], features[: p + 1], torch.arange(p + 1))
    return _chain(head, out[p], cache, p, k)


def _chain(head: EagleHead, feature: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], p: int,
           k: int) -> list[int]:
    """k greedy drafts from `feature` (the head's prediction for position p + 1) over real entries 0..p."""
    vocab_ids = torch.tensor(head.config.vocab_ids)
    drafts = []
    for j in range(k):
        token = vocab_ids[head.logits(feature[None])[0].argmax()]
        drafts.append(int(token))
        if j + 1 < k:  # entry p + 1 + j: the predicted feature with the token just drafted
            nxt, (k_new, v_new) = head.forward(token[None], feature[None], torch.tensor([p + 1 + j]), cache)
            cache = (torch.cat([cache[0], k_new]), torch.cat([cache[1], v_new]))
            feature = nxt[0]
    return drafts
