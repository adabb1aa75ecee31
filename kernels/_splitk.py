"""What the weight-only quantized linears (w4a16, w8a16) share: launch shapes, autotuning, the store
epilogue and the launcher's tail. Each kernel file keeps its weight-tile load and dequantization,
its asserts and its split heuristic; the reference of both is optc.core.formats.linear_ref.

A kernel served by `launch` takes these arguments by name (see w8a16's kernel): pointers x_ptr,
bias_ptr, out_ptr; sizes M, M_BUCKET, N, K, k_per_split; strides stride_xm, stride_om, stride_os;
constexprs HAS_BIAS, IS_SPLIT, FP32_DOT and BLOCK_M, BLOCK_N, BLOCK_K (from the config); its program
ids are (M tile, N tile, split). M_BUCKET is never read by the kernel (declare it in
`do_not_specialize`): it is in the autotune key, so each bucket of M (`m_bucket`) is tuned apart and
a tile picked for a 2,048-token prefill is never reused for a 64-row decode. Launch shapes, chosen by
M: a split-K GEMV for M <= GEMV_MAX_M (decode; K split across programs so a small N still fills the
GPU; the fp32 partials summed by `_reduce_kernel`, with the bias and the cast, in one launch),
autotuned apart at M == 1, where dot-free configs (BLOCK_M = 1, each kernel's own FMA path) compete with the
tl.dot ones, and a tiled GEMM for larger M (prefill). Autotuning times each config with short runs
(AUTOTUNE_WARMUP_MS, AUTOTUNE_REP_MS), after `prune` drops the configs a shape cannot use (tiles past
the problem, pipelining past the K loop): every config Triton times it must first compile (~1.5-2 s
each for sm_90), which on a cold cache is most of a first call's time at small shapes.
`first_call_compiles` counts what first calls at given shapes compile, without a GPU. Tests check it
through the kernels that use it, on the CPU under TRITON_INTERPRET=1, and compile every config for sm_90
(benchmarks/kernels.py --compile-only).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from optc.kernels._dot import fp32_dot, interpreting

GEMV_MAX_M = 16
MIN_DOT_M = 16  # tl.dot's least M tile
TARGET_PROGRAMS = 264  # about two waves on an H100's 132 SMs
MAX_M_BUCKET = 256  # larger M share one autotune choice (prefill is compute-bound at any M past it)
# Triton's default timing (25 ms warm-up, 100 ms of repetitions per config) makes ~400 tunings take a
# minute on a cold GPU; a decode GEMV runs in microseconds, so these still time hundreds of launches
AUTOTUNE_WARMUP_MS, AUTOTUNE_REP_MS = 5, 25


def m_bucket(m: int) -> int:
    """The autotune bucket of M rows: the next power of two, capped at MAX_M_BUCKET."""
    return min(triton.next_power_of_2(m), MAX_M_BUCKET)


def config(m: int, n: int, k: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)


class Kernels(NamedTuple):
    """A kernel's autotuners, one per launch shape; each caches its choice per shape key."""

    m1: triton.runtime.Autotuner  # M == 1: the GEMV's configs and dot-free ones (BLOCK_M = 1)
    gemv: triton.runtime.Autotuner  # 2 <= M <= GEMV_MAX_M
    gemm: triton.runtime.Autotuner  # M > GEMV_MAX_M

    def for_rows(self, m: int) -> triton.runtime.Autotuner:
        return self.m1 if m == 1 else self.gemv if m <= GEMV_MAX_M else self.gemm


def prune(configs: list[triton.Config], args: dict, k_multiples: tuple[str, ...]) -> list[triton.Config]:
    """The configs worth compiling and timing for one launch's arguments `args` (by name), in their order:
    1. BLOCK_K divides each size argument named in `k_multiples` (no K tile straddles a split or a
       quantization group);
    2. no tile past the problem where a smaller config exists: BLOCK_N <= max(next_pow2(N), the smallest
       BLOCK_N), likewise BLOCK_K with the K one split sums and BLOCK_M with M, but never under 16, tl.dot's
       least M tile (at M = 1 the dot configs compete with the dot-free ones): a tile twice the problem
       computes masked zeros and times like the one that fits;
    3. no pipelining deeper than the K loop: of the configs that differ only in num_stages, those with
       more stages than a program has K tiles all prefetch every tile; the shallowest of them stays.
    At Llama-3-8B's shapes M = 1, 8 and 512 keep all that (1) keeps; M = 32 loses the 128-row GEMM tiles."""
    ok = [c for c in configs if all(args[a] % c.kwargs["BLOCK_K"] == 0 for a in k_multiples)]
    k_split = min(args["K"], args["k_per_split"])
    limits = {"BLOCK_M": max(args["M"], MIN_DOT_M), "BLOCK_N": args["N"], "BLOCK_K": k_split}
    for name, size in limits.items():
        cap = max(triton.next_power_of_2(size), min((c.kwargs[name] for c in ok), default=0))
        ok = [c for c in ok if c.kwargs[name] <= cap]
    kept, seen = [], set()
    for c in sorted(ok, key=lambda c: c.num_stages):  # shallowest first, so it is the one kept
        deep = c.num_stages > triton.cdiv(k_split, c.kwargs["BLOCK_K"])
        key = (tuple(sorted(c.kwargs.items())), c.num_warps, "deep" if deep else c.num_stages)
        if key not in seen:
            seen.add(key)
            kept.append(c)
    return [c for c in ok if any(c is k for k in kept)]


def autotune(kernel, m1_configs: list[triton.Config], gemv_configs: list[triton.Config],
             gemm_configs: list[triton.Config], k_multiples: tuple[str, ...]) -> Kernels:
    """The launch shapes of `kernel`, each config list pruned per launch by `prune`. The first survivor
    runs without timing under the Triton interpreter (which cannot time kernels) and when the
    environment sets OPTC_AUTOTUNE=0 (a fast start, untuned: the GPU tests use it where they check
    formats, not speed); otherwise Triton times every survivor once per shape and keeps the fastest,
    per M bucket (`m_bucket`) and shape. M == 1 has its own autotuner, so a dot-free config that wins
    at one row is never reused for more."""

    def early_prune(configs, named_args, **kwargs):
        ok = prune(configs, {**named_args, **kwargs}, k_multiples)  # `launch` passes every argument by name
        return ok[:1] if interpreting() or os.environ.get("OPTC_AUTOTUNE", "1") == "0" else ok

    kw = {"prune_configs_by": {"early_config_prune": early_prune}}
    if "do_bench" in inspect.signature(triton.autotune).parameters:  # Triton >= 3.2
        kw["do_bench"] = _short_bench
    key = ["M_BUCKET", "N", "K", "k_per_split"]
    return Kernels(triton.autotune(m1_configs, key=key, **kw)(kernel),
                   triton.autotune(gemv_configs, key=key, **kw)(kernel),
                   triton.autotune(gemm_configs, key=["M_BUCKET", "N", "K"], **kw)(kernel))


def _short_bench(kernel_call, quantiles):
    return triton.testing.do_bench(kernel_call, warmup=AUTOTUNE_WARMUP_MS, rep=AUTOTUNE_REP_MS, quantiles=quantiles)


@triton.jit
def tile(M, N, K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # this program's output rows and columns, its split, and the K range [k_start, k_end) it sums
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = split * k_per_split
    return offs_m, offs_n, split, k_start, tl.minimum(k_start + k_per_split, K)


@triton.jit
def load_x(x_ptr, offs_m, mask_m, k0, k_end, stride_xm, BLOCK_K: tl.constexpr, WHOLE_K: tl.constexpr):
    # x tile (BLOCK_M, BLOCK_K) at K offset k0, with the tile's K offsets and mask; WHOLE_K: the
    # caller guarantees whole K tiles, so no K mask (which keeps the loads vectorizable)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if WHOLE_K:
        offs_k = tl.max_contiguous(tl.multiple_of(offs_k, BLOCK_K), BLOCK_K)
        mask_k = tl.full([BLOCK_K], 1, tl.int1)
        mask = mask_m[:, None]
    else:
        mask_k = offs_k < k_end
        mask = mask_m[:, None] & mask_k[None, :]
    x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    return x, offs_k, mask_k


@triton.jit
def store_tile(
    acc, out_ptr, bias_ptr, offs_m, offs_n, split, M, N, stride_om, stride_os,
    HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr,
):
    # acc: (BLOCK_M, BLOCK_N) fp32 for rows offs_m, columns offs_n
    mask_n = offs_n < N
    mask_mn = (offs_m < M)[:, None] & mask_n[None, :]
    if IS_SPLIT:  # fp32 partial sums; `_reduce_kernel` sums them and adds the bias
        out = out_ptr + split * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc, mask=mask_mn)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_mn)


@triton.jit
def _reduce_kernel(
    part_ptr, bias_ptr, out_ptr, N, num_splits, stride_ps, stride_pm, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # out[m, n] = cast(sum_s part[s, m, n] + bias[n]): one program per (row, N block), fp32 throughout
    row, pid_n = tl.program_id(0), tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    part = part_ptr + row.to(tl.int64) * stride_pm + offs_s[:, None] * stride_ps + offs_n[None, :]
    acc = tl.sum(tl.load(part, mask=(offs_s < num_splits)[:, None] & mask_n[None, :], other=0.0), axis=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def reduce_splits(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out (M, N) = (part (S, M, N) fp32 summed over S, + bias in fp32), cast to out's dtype: one launch."""
    num_splits, m, n = part.shape
    block_s = triton.next_power_of_2(num_splits)
    block_n = max(16, min(triton.next_power_of_2(n), 4096 // block_s))  # at most 4096 partials a program
    _reduce_kernel[(m, triton.cdiv(n, block_n))](
        part, bias if bias is not None else part, out, n, num_splits, part.stride(0), part.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_S=block_s, BLOCK_N=block_n, num_warps=4,
    )
    return out


def launch(
    kernels: Kernels, x: torch.Tensor, n: int,
    bias: torch.Tensor | None, split_k: int | None, k_align: int, split_heuristic: Callable[[int, int], int],
    **weight,
) -> torch.Tensor:
    """x (..., K) @ W^T (+ bias) -> (..., N) in x's dtype through `kernels` (from `autotune`); `weight`
    holds the kernel's own arguments. `split_k` (or `split_heuristic(n, k)` for the GEMV; the GEMM
    does not split) is rounded so every split covers whole multiples of `k_align` of K."""
    x2, out = rows_and_output(x, n)
    if x2 is None:
        return out
    m, k = x2.shape
    split_k, k_per_split = splits(m, n, k, split_k, k_align, split_heuristic)
    is_split = split_k > 1
    dest = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if is_split else out
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), split_k)
    kernels.for_rows(m)[grid](
        x_ptr=x2, bias_ptr=bias if bias is not None else x2, out_ptr=dest,  # x2: never read without a bias
        M=m, M_BUCKET=m_bucket(m), N=n, K=k, k_per_split=k_per_split,
        stride_xm=x2.stride(0), stride_om=dest.stride(-2), stride_os=dest.stride(0) if is_split else 0,
        HAS_BIAS=bias is not None, IS_SPLIT=is_split, FP32_DOT=fp32_dot(x), **weight,
    )
    if is_split:
        reduce_splits(dest, bias, out)
    return out.view(*x.shape[:-1], n)


def rows_and_output(x: torch.Tensor, n: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A launch's prelude: x (..., K) as rows (M, K) with a unit inner stride, and the output (M, N) in x's
    dtype; (None, the empty output shaped (..., N)) when there are no rows. Callers return
    `out.view(*x.shape[:-1], n)`."""
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    return (None, out.view(*x.shape[:-1], n)) if x2.shape[0] == 0 else (x2, out)


def splits(m: int, n: int, k: int, split_k: int | None, k_align: int,
           split_heuristic: Callable[[int, int], int]) -> tuple[int, int]:
    """(number of K splits, K per split) of a launch: `split_k`, or the heuristic's for the GEMV (the GEMM
    does not split), rounded so every split covers whole multiples of `k_align`."""
    if split_k is None:
        split_k = split_heuristic(n, k) if m <= GEMV_MAX_M else 1
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), k_align) * k_align
    return triton.cdiv(k, k_per_split), k_per_split


def first_call_compiles(kernels: Kernels, shapes: Iterable[tuple[int, int, int]], k_align: int,
                        split_heuristic: Callable[[int, int], int], k_multiples: tuple[str, ...],
                        **sizes: int) -> set[tuple]:
    """What first calls at each (M, N, K) of `shapes` compile on a cold cache, counted without a GPU: one
    entry per (launch shape, config, specialization). Triton compiles a config once per specialization of
    its integer arguments (== 1, divisible by 16) and its constexprs (IS_SPLIT here); `sizes` are the
    kernel's other size arguments (w4a16's group_size)."""
    out = set()
    for m, n, k in shapes:
        split_k, k_per_split = splits(m, n, k, None, k_align, split_heuristic)
        args = {"M": m, "N": n, "K": k, "k_per_split": k_per_split, **sizes}
        path = "m1" if m == 1 else "gemv" if m <= GEMV_MAX_M else "gemm"
        spec = tuple((v == 1, v % 16 == 0) for v in args.values()) + (split_k > 1,)
        out |= {(path, str(c), spec) for c in prune(kernels.for_rows(m).configs, args, k_multiples)}
    return out
