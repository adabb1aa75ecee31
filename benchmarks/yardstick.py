"""The device's copy bandwidth, the yardstick that benchmarks/kernels.py's "% of copy" divides by, and the
arithmetic that turns a copy's time into it.

Measured with a copy kernel: a plain elementwise Triton copy (`copy_kernel`, 16-byte loads and stores per
thread) launched on the current stream `repeats` times between two CUDA events, outside any CUDA graph, at a
few sizes (each several times the L2), the best size kept. A copy of n bytes moves 2n (n read, n written).
Why not `dst.copy_(src)` captured in a CUDA graph, as benchmarks/kernels.py did: captured, the copy becomes a
memcpy node, a slower path than the kernels it is compared with; on an H200 (2026-11-26) it gave 2,716 GB/s
where a copy kernel moves ~4.3 TB/s, so every fraction against it read ~1.6x high. benchmarks/kernels.py
still reports that number, labelled, as a second column (`graph_memcpy_gbps`).

Not here: the kernels' own timing (benchmarks/kernels.py `time_ms`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SIZES = (256 << 20, 1 << 30, 2 << 30)  # bytes per buffer: each over 4x an H200's 60 MB L2
COPY_BLOCK = 8192  # int32 elements per program of 8 warps: 32 per thread, eight 16-byte loads and stores
METHOD = "triton copy kernel on a stream, CUDA events, no graph"


@dataclass(frozen=True)
class Yardstick:
    """The copy bandwidth kept (`gbps`, GB/s counting bytes read + written), how it was measured, the buffer size
    that gave it, and every size's GB/s."""

    gbps: float
    method: str
    nbytes: int
    by_size: dict[int, float]

    def label(self) -> str:
        return f"{self.gbps:.0f} GB/s ({self.method}, best of {'/'.join(_size(n) for n in self.by_size)})"


def copy_bytes(nbytes: int) -> int:
    """Bytes a copy of `nbytes` moves through device memory: each byte read once and written once."""
    return 2 * nbytes


def gbps(nbytes: float, ms: float) -> float:
    """GB/s (1e9 bytes per second) of `nbytes` moved in `ms` milliseconds."""
    if ms <= 0:
        raise ValueError(f"a time must be positive, got {ms} ms")
    return nbytes / (ms * 1e-3) / 1e9


def fraction_of(achieved_gbps: float, yardstick_gbps: float) -> float:
    """`achieved_gbps` as a fraction of the yardstick's bandwidth (1.0 = as fast as the copy)."""
    if yardstick_gbps <= 0:
        raise ValueError(f"a yardstick must be positive, got {yardstick_gbps} GB/s")
    return achieved_gbps / yardstick_gbps


def from_times(ms_per_copy: dict[int, float], method: str = METHOD) -> Yardstick:
    """The yardstick from each buffer size's time of one copy (ms): the size with the highest GB/s."""
    if not ms_per_copy:
        raise ValueError("no copy was timed")
    by_size = {n: gbps(copy_bytes(n), ms) for n, ms in ms_per_copy.items()}
    best = max(by_size, key=by_size.__getitem__)
    return Yardstick(by_size[best], method, best, by_size)


@triton.jit
def copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    # dst[i] = src[i] for i < n: one contiguous BLOCK per program, the tail masked
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def copy(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst[:] = src through `copy_kernel` (both contiguous, same dtype and size) -> dst."""
    assert src.is_contiguous() and dst.is_contiguous(), "copy needs contiguous tensors"
    assert src.dtype == dst.dtype and src.numel() == dst.numel(), \
        f"src {src.dtype} x {src.numel()} != dst {dst.dtype} x {dst.numel()}"
    n = src.numel()
    copy_kernel[(triton.cdiv(n, COPY_BLOCK),)](src, dst, n, BLOCK=COPY_BLOCK, num_warps=8)
    return dst


def measure(sizes: tuple[int, ...] = SIZES, warmup: int = 3, repeats: int = 20) -> Yardstick:
    """Time `copy` at each size in bytes (median of 5 event-timed runs of `repeats` copies) -> the yardstick."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = {}
    for nbytes in sizes:
        src = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")  # never zeros
        dst = torch.empty_like(src)
        for _ in range(warmup):
            copy(src, dst)
        runs = []
        for _ in range(5):
            start.record()
            for _ in range(repeats):
                copy(src, dst)
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / repeats)
        assert torch.equal(src, dst), "the copy kernel left dst unlike src"
        ms[nbytes] = sorted(runs)[len(runs) // 2]
        del src, dst
    return from_times(ms)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 30} GiB" if nbytes >= 1 << 30 else f"{nbytes >> 20} MiB"
