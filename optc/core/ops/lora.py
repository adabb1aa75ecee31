"""Batched LoRA deltas (Punica's BGMV shape): each row of a step picks an adapter slot, -1 for none.

`lora_delta_ref` is the specification: row t's delta is b[s] @ (a[s] @ x[t]) for its slot s = slots[t] >= 0, and
0 where s = -1; every factor is float32 and so is the product, whatever x's dtype (the delta is computed in float
from the layer's input; the base linear keeps its own kernel, quantized or not). Two fast paths for the CPU:
`lora_delta_grouped`, the rows of one slot gathered, two small matmuls on its used rank, scattered back (the step's
rows under one adapter: a prefill); `lora_delta_masked`, every slot's A at once (one (T, S*R) product), each row's
other slots' columns zeroed by a mask, then every slot's B at once: two matmuls and a multiply whatever the number
of adapters, for decode steps whose few rows spread over several adapters (S-fold work on tiny ranks, but no
per-slot gather, scatter or Python loop). The groups and masks come once per step (`slot_groups`, `slot_mask`),
not once per linear. This is not a graph op: the runtime adds the delta to the linears
adapters target (runtime/lora.py), so an artifact is the same with or without adapters.
"""

from __future__ import annotations

import torch


def lora_delta_ref(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 deltas (T, N) of rows x (T, K) with `slots` (T,) int64 (-1: none), a (S, R, K), b (S, N, R)."""
    keep = (slots >= 0)[:, None]
    s = slots.clamp(min=0)
    h = torch.bmm(a[s], x.float()[:, :, None])  # (T, R, 1)
    return torch.bmm(b[s], h)[..., 0] * keep  # (T, N)


def slot_groups(slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, its rows (n,) int64) for every slot >= 0 that `slots` (T,) holds, in slot order."""
    out = []
    for slot in torch.unique(slots).tolist():
        if slot >= 0:
            out.append((slot, (slots == slot).nonzero().flatten()))
    return out


def slot_mask(slots: torch.Tensor, num_slots: int, rank: int) -> torch.Tensor:
    """(T, num_slots * rank) float32: row t's ones on its slot's `rank` columns, zeros elsewhere (-1: all zero)."""
    cols = torch.arange(num_slots * rank, device=slots.device) // rank  # (S * R,) the slot of each column
    return (cols[None, :] == slots[:, None]).float()


def lora_delta_masked(x: torch.Tensor, mask: torch.Tensor, a: torch.Tensor, b_cat: torch.Tensor) -> torch.Tensor:
    """`lora_delta_ref`'s deltas from every slot's factors at once: a (S, R, K), b_cat (N, S * R) (b's slots side by
    side) and the step's `slot_mask` for R."""
    h = x.float() @ a.view(-1, a.shape[-1]).T  # (T, S * R)
    return (h * mask) @ b_cat.T  # (T, N)


def lora_delta_grouped(x: torch.Tensor, groups: list[tuple[int, torch.Tensor]], a: torch.Tensor, b: torch.Tensor,
                       ranks: list[int]) -> torch.Tensor:
    """`lora_delta_ref`'s deltas from the step's `slot_groups`, slot s using its first `ranks[s]` rank columns
    (the rest are zero padding)."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)
    whole = len(groups) == 1 and groups[0][1].numel() == x.shape[0]
    for slot, rows in groups:
        r = ranks[slot]
        if r == 0:
            continue
        xs = x.float() if whole else x.index_select(0, rows).float()
        d = (xs @ a[slot, :r].T) @ b[slot, :, :r].T  # (n, r) then (n, N)
        if whole:
            out = d
        else:
            out.index_copy_(0, rows, d)
    return out
