"""optc's own C++ CPU kernels, compiled with torch's cpp_extension when a model using them loads (the kernel table's
`extension` loaders) or on first use, and cached on disk: qdot.cpp
(grouped int4 / int8 code linears with integer activations per block of 32), bf16dot.cpp (dense bfloat16
linears whose rows do not depend on the call's row count: kernels/cpu_ext/bf16dot.py) and ops.cpp (a decode
step's norms, gated activation, rotary + KV store and decode attention, one call each: kernels/cpu_ext/ops.py).

`load()` builds (or reuses) the extension under $OPTC_CACHE/cpu_ext/<torch version>-<source hash> and returns
the module, or None where it cannot be built (no C++ compiler, no ninja, a failed compile): the failure is
logged once and every launcher bound to these kernels runs torch's packed kernel instead (kernels/cpu_ext/qdot.py),
so an install without a compiler still runs every artifact. `load_ops()` is ops.cpp's module the same way (None:
its launchers run the op references). `isa()` is the path qdot runs on this CPU: AVX-512
VNNI where the CPU has it, else AVX2, capped to AVX2 when ATEN_CPU_CAPABILITY=avx2 (the cap that makes torch's
own kernels take their AVX2 paths, so that a capped measurement compares like with like); `bf16_isa()` is
bf16dot's the same way (AVX-512 BF16 or AVX2).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

AVX2, AVX512_VNNI, AVX512_BF16 = 2, 3, 4  # qdot.cpp's and bf16dot.cpp's `isa` argument
ISA_NAMES = {AVX2: "avx2", AVX512_VNNI: "avx512_vnni", AVX512_BF16: "avx512_bf16"}
HERE = Path(__file__).parent

log = logging.getLogger("optc.kernels.cpu_ext")


def cache_root() -> Path:
    return Path(os.environ.get("OPTC_CACHE", Path.home() / ".cache" / "optc")) / "cpu_ext"


@functools.cache
def load() -> ModuleType | None:
    """qdot's extension, or None (logged) where it cannot be built on this machine."""
    return build("qdot", ("qdot.cpp", "qdot_body.h"), ["-O3"], cache_root(), "torch's packed kernels")


@functools.cache
def load_bf16dot() -> ModuleType | None:
    """bf16dot's extension, or None (logged) where it cannot be built on this machine."""
    return build("bf16dot", ("bf16dot.cpp",), ["-O3"], cache_root(), "torch's bfloat16 matmul")


@functools.cache
def load_ops() -> ModuleType | None:
    """ops.cpp's extension, or None (logged) where it cannot be built or the CPU lacks AVX2 (its only path).
    -ffp-contract=off: its products and sums round separately, as the references' do."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return None
    return build("ops", ("ops.cpp",), ["-O3", "-ffp-contract=off", "-mavx2", "-mf16c"], cache_root(),
                 "the op references")


def build(name: str, sources: tuple[str, ...], flags: list[str], root: Path, instead: str,
          compile_only: tuple[str, ...] | None = None) -> ModuleType | None:
    """Compile the .cpp files of `sources` (all of them hashed; `compile_only`: just these, which include the
    others) into root/<torch version>-<hash>, a no-op when built there already; None, logged with what runs
    `instead`, where it fails."""
    digest = hashlib.sha256(b"".join((HERE / s).read_bytes() for s in sources) + " ".join(flags).encode() + b"omp")
    tag = digest.hexdigest()[:12]
    where = root / f"torch{torch.__version__}-{tag}"
    try:
        from torch.utils import cpp_extension

        where.mkdir(parents=True, exist_ok=True)
        _drop_stale_lock(where / "lock")
        if not any(where.glob("*.so")):
            print(f"optc: compiling its C++ CPU kernels ({name}), once: about a minute; cached in {where}",
                  file=sys.stderr, flush=True)
        compiled = [str(HERE / s) for s in compile_only or sources if s.endswith(".cpp")]
        # -fopenmp: at::parallel_for is a header that splits work only where the including code is compiled with
        # OpenMP (else it runs its whole range on the calling thread); libgomp.so.1 resolves to torch's own copy
        return cpp_extension.load(f"optc_{name}_{tag}", compiled, extra_cflags=[*flags, "-fopenmp"],
                                  extra_ldflags=["-fopenmp"], build_directory=str(where),
                                  extra_include_paths=[str(HERE)])
    except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as e:  # what cpp_extension raises
        log.warning("optc's C++ CPU kernels could not be built (%s: %s: %s); %s run instead", name,
                    type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "", instead)
        return None


STALE_LOCK_SECONDS = 600  # a build takes about a minute; a lock this old was left by a killed one


def _drop_stale_lock(lock: Path) -> None:
    """Remove the lock file torch's cpp_extension holds while it builds, when it is older than any build: a
    process killed mid-build leaves it, and cpp_extension then waits on it forever, even for a built module."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        log.warning("optc: removing %s, left %.0f minutes ago by a C++ kernel build that did not finish", lock,
                    age / 60)
        lock.unlink(missing_ok=True)


@functools.cache
def isa() -> int | None:
    """qdot's ISA path on this CPU (AVX2 or AVX512_VNNI), None where the extension is absent or the CPU has
    no AVX2 (or ATEN_CPU_CAPABILITY caps torch below it)."""
    return _capped(load())


@functools.cache
def bf16_isa() -> int | None:
    """bf16dot's ISA path on this CPU (AVX512_BF16 or AVX2), None where the extension is absent or the CPU has no
    AVX2 with FMA (or ATEN_CPU_CAPABILITY caps torch below it)."""
    return _capped(load_bf16dot())


def _capped(ext: ModuleType | None) -> int | None:
    """The extension's best path on this CPU under ATEN_CPU_CAPABILITY's cap."""
    if ext is None:
        return None
    best = ext.best_isa()
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if cap == "default" or best == 0:
        return None
    return AVX2 if cap == "avx2" else best
