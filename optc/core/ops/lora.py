"""Batched LoRA deltas (Punica's BGMV shape): each row of a step picks an adapter slot, -1 for none.

`lora_delta_ref` is the specification: row t's delta is b[s] @ (a[s] @ x[t]) for its slot s = slots[t] >= 0, and
0 where s = -1; products and sums are float32, whatever the dtype of x and of the factors (float32, or bfloat16
beside bfloat16 activations: runtime/lora.py), and so is the delta (computed in float from the layer's input; the
base linear keeps its own kernel, quantized or not). `lora_delta_grouped` is the path where no kernel runs the
deltas: the rows of one slot gathered, two small matmuls on its used rank, scattered back, the groups
(`slot_groups`) once per step, not once per linear. On the CPU kernels/cpu_ext/lora.cpp's lora_add runs them
(every slot's few rows against only its factors' used columns, in one call), and the fused CPU step calls the same
function. This is not a graph op: the runtime adds the delta to the linears adapters target (runtime/lora.py), so
an artifact is the same with or without adapters.
"""

from __future__ import annotations

import torch


def lora_delta_ref(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 deltas (T, N) of rows x (T, K) with `slots` (T,) int64 (-1: none), a (S, R, K), b (S, N, R)."""
    keep = (slots >= 0)[:, None]
    s = slots.clamp(min=0)
    h = torch.bmm(a[s].float(), x.float()[:, :, None])  # (T, R, 1)
    return torch.bmm(b[s].float(), h)[..., 0] * keep  # (T, N)


def slot_groups(slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, its rows (n,) int64) for every slot >= 0 that `slots` (T,) holds, in slot order."""
    out = []
    for slot in torch.unique(slots).tolist():
        if slot >= 0:
            out.append((slot, (slots == slot).nonzero().flatten()))
    return out


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
        d = (xs @ a[slot, :r].T.float()) @ b[slot, :, :r].T.float()  # (n, r) then (n, N)
        if whole:
            out = d
        else:
            out.index_copy_(0, rows, d)
    return out
