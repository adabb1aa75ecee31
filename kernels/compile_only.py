"""Compile the Triton kernels for an NVIDIA GPU on a machine without one, and read their resources.

The Triton interpreter (TRITON_INTERPRET=1) checks what the kernels compute, but it runs programs
the compiler refuses, and it says nothing of registers, spills or shared memory. Inside
`compile_only(arch)`, every kernel launch compiles for that GPU through Triton's own pipeline down
to a cubin (with the ptxas bundled in the triton wheel) and returns without running; an autotuned
launch compiles every config its pruning keeps. Each launch is recorded with, per compiled config,
its registers and spilled bytes (read from the cubin by the bundled cuobjdump), its shared memory,
checked against the GPU's per-block limit, and its global loads by width (from the PTX: `ld.global`
and `cp.async`, counted as instructions in the program text, not as executed): a memory-bound kernel
should move its bulk in 16-byte loads.

What this cannot tell: whether a kernel computes the right thing or is fast on the device. It needs
a process in which TRITON_INTERPRET was unset when the kernel modules were imported (Triton decides
between interpreted and compiled kernels at import), and it leaves that process's kernel caches
holding kernels that cannot launch: use a process of its own (`benchmarks/kernels.py
--compile-only` does). CPU tensors stand in for CUDA ones; only their dtypes, sizes and alignment
are read.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime import driver
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

from optc.kernels._dot import interpreting

# the most dynamic shared memory one block may use, by compute capability (CUDA programming guide)
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


@dataclass(frozen=True)
class Compiled:
    """One compiled kernel: its name, launch config and resources."""

    name: str
    config: dict[str, object]  # the constexprs, num_warps and num_stages it was compiled with
    registers: int  # per thread
    spill_bytes: int  # local memory per thread (register spills and stack)
    shared_bytes: int
    max_shared: int
    loads: dict[int, int]  # global-load width in bytes -> instructions in the PTX

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= self.max_shared


@dataclass
class Launch:
    """One kernel launch of the host code: the configs it compiled (one unless autotuned)."""

    kernel: str
    configs: list[Compiled] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """Whether the launch can run: some config fits (the autotuner skips those that do not)."""
        return any(c.fits for c in self.configs)


class _CompileOnlyDriver(DriverBase):
    """What Triton's JIT asks a driver for before it compiles; anything a launch needs raises."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    @classmethod
    def is_active(cls) -> bool:
        return False

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise RuntimeError("compile_only: kernels are compiled, not launched")

    def get_benchmarker(self):
        raise RuntimeError("compile_only: kernels are compiled, not timed")


@contextmanager
def compile_only(arch: int = 90, all_configs: bool = True) -> Iterator[list[Launch]]:
    """Within it, kernel launches compile for `sm_{arch}` and return without running. Yields the
    list of Launch records, filled as launches happen. `all_configs=False` compiles only the first
    config an autotuned launch keeps."""
    if interpreting():
        raise RuntimeError("compile_only needs TRITON_INTERPRET unset before the kernel modules are imported")
    if arch not in MAX_SHARED:
        raise ValueError(f"arch {arch} is not one of {sorted(MAX_SHARED)}")
    launches: list[Launch] = []
    tuning: list[Launch] = []  # the autotuned launch in progress, if any
    jit_run, tune_run, active = JITFunction.run, Autotuner.run, driver._active

    def run_jit(fn, *args, grid, warmup, **kwargs):
        kernel = jit_run(fn, *args, grid=grid, warmup=True, **kwargs)
        named = {**dict(zip(fn.arg_names, args, strict=False)), **kwargs}
        config = {p.name: named[p.name] for p in fn.params if p.is_constexpr and p.name in named}
        config |= {"num_warps": kernel.metadata.num_warps, "num_stages": kernel.metadata.num_stages}
        launch = tuning[-1] if tuning else Launch(fn.__name__)
        launch.configs.append(_describe(kernel, config, arch))
        if not tuning:
            launches.append(launch)
        return kernel

    def run_tuner(tuner, *args, **kwargs):
        tuner.nargs = dict(zip(tuner.arg_names, args, strict=False))
        configs = tuner.prune_configs(kwargs)
        tuning.append(Launch(tuner.base_fn.__name__))
        try:
            for config in configs if all_configs else configs[:1]:
                tuner.fn.run(*args, **kwargs, **config.all_kwargs())
        finally:
            launches.append(tuning.pop())
            tuner.nargs = None

    driver.set_active(_CompileOnlyDriver(arch))
    JITFunction.run, Autotuner.run = run_jit, run_tuner
    try:
        yield launches
    finally:
        JITFunction.run, Autotuner.run, driver._active = jit_run, tune_run, active


def _describe(kernel, config: dict[str, object], arch: int) -> Compiled:
    registers, spill = _resource_usage(kernel.asm["cubin"])
    return Compiled(kernel.metadata.name, config, registers, spill, kernel.metadata.shared, MAX_SHARED[arch],
                    global_loads(kernel.asm["ptx"]))


_LD = re.compile(r"\bld\.global(?:\.[A-Za-z_:0-9]+)*?(?:\.v(\d))?\.[bfsu](\d+)\s")
_CP = re.compile(r"\bcp\.async\.c[ag]\.shared\.global[^;]*?,\s*(0x[0-9a-f]+|\d+)\s*[,;]")


def global_loads(ptx: str) -> dict[int, int]:
    """Global-load width in bytes -> how many such instructions the PTX holds (ld.global, cp.async)."""
    widths = [int(vec or 1) * int(bits) // 8 for vec, bits in _LD.findall(ptx)]
    widths += [int(size, 0) for size in _CP.findall(ptx)]
    return {w: widths.count(w) for w in sorted(set(widths), reverse=True)}


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, local bytes) of the cubin's one kernel, from `cuobjdump -res-usage`."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    if usage is None:
        raise RuntimeError(f"cannot read the resource usage in cuobjdump's output:\n{text}")
    registers, stack, local = map(int, usage.groups())
    return registers, stack + local
