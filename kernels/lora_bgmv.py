"""Batched LoRA deltas for CUDA (Punica's BGMV shape): a Triton kernel for optc/core/ops/lora.py's `lora_delta_ref`,
added in place to a linear's outputs, as kernels/cpu_ext/lora.cpp's lora_add does on the CPU.

Two launches a linear: the shrink, one program per (row, block of rank columns), h[t] = A[s] x[t] over K in blocks;
the expand, one program per (row, block of output features), out[t] += B[s] h[t] over the slot's R columns (bt,
(S, R, N): B transposed, runtime/lora.py's layout), the sum rounded once to out's dtype. The slot of each row is
read from the `slots` tensor inside the kernel (-1: the program stores nothing), so the launch's grid and
arguments do not depend on which adapters a step uses and a captured CUDA graph stays valid across steps.
Unlike lora.cpp it reads every one of a slot's R columns (the unused ones are zeros): the GPU's rows per program
are one, the bytes per row the slot's whole factors.

Tested under TRITON_INTERPRET=1 against the reference (tests/test_lora.py) and compiled for sm_90 without a GPU
(tests/test_kernels_compile.py: every rank block and both factor dtypes, no spills).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink(x_ptr, a_ptr, h_ptr, slots_ptr, K, R, stride_x, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * stride_x + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + (slot * R + offs_r[:, None]) * K + offs_k[None, :],
                        mask=(offs_r[:, None] < R) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(h_ptr + t * R + offs_r, acc, mask=offs_r < R)


@triton.jit
def _expand(h_ptr, bt_ptr, out_ptr, slots_ptr, R, N, offset, n, stride_out, BLOCK_N: tl.constexpr,
            BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            h = tl.load(h_ptr + t * R + offs_r, mask=offs_r < R, other=0.0)
            b = tl.load(bt_ptr + (slot * R + offs_r[:, None]) * N + offset + offs_n[None, :],
                        mask=(offs_r[:, None] < R) & (offs_n[None, :] < n), other=0.0).to(tl.float32)
            acc += tl.sum(b * h[:, None], axis=0)
        ptr = out_ptr + t * stride_out + offs_n
        y = tl.load(ptr, mask=offs_n < n, other=0.0).to(tl.float32)
        tl.store(ptr, (y + acc).to(out_ptr.dtype.element_ty), mask=offs_n < n)


def lora_add(x: torch.Tensor, outs: list[torch.Tensor], slots: torch.Tensor, a: torch.Tensor,
             bt: torch.Tensor) -> list[torch.Tensor]:
    """outs (the linear's split outputs, each (T, n_p) with unit column stride, n_p summing to N) += the deltas of
    x (T, K) under `slots` (T,) int64 (-1: none), a (S, R, K), bt (S, R, N) contiguous; in place, returned."""
    t, k = x.shape
    r, n_all = a.shape[1], bt.shape[2]
    if sum(o.shape[1] for o in outs) != n_all or any(o.stride(1) != 1 for o in outs):
        raise ValueError(f"lora_add: outputs of {[tuple(o.shape) for o in outs]} for bt of {n_all} features")
    x = x.contiguous()
    h = torch.empty(t, r, dtype=torch.float32, device=x.device)
    block_r = min(64, triton.next_power_of_2(r))
    _shrink[(t, triton.cdiv(r, block_r))](x, a, h, slots, k, r, x.stride(0), BLOCK_R=block_r, BLOCK_K=64)
    offset = 0
    for out in outs:
        n = out.shape[1]
        _expand[(t, triton.cdiv(n, 64))](h, bt, out, slots, r, n_all, offset, n, out.stride(0), BLOCK_N=64,
                                         BLOCK_R=block_r)
        offset += n
    return outs
