"""`optc warmup`: compile optc's C++ CPU kernels (kernels/cpu_ext: one extension of several translation units,
compiled in parallel) into $OPTC_CACHE/cpu_ext, so that a first `optc serve` or `optc run` finds them there
instead of compiling them while it loads (about 30 s on 2 cores).

It is skipped, with the reason, where this machine cannot build or run it (no C++ compiler, no ninja, a CPU torch
runs without AVX2); a build that fails on a machine with a compiler is a failure (Status.FAILED: the CLI
exits 1). It compiles nothing else: no Triton kernel, no artifact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from optc.kernels import cpu_ext


class Status(StrEnum):
    BUILT = "built"  # compiled now
    CACHED = "cached"  # found built in the cache
    FAILED = "failed"  # a compiler and ninja exist, and the build failed
    SKIPPED = "skipped"  # this machine cannot build or run it


@dataclass(frozen=True)
class Outcome:
    name: str
    status: Status
    seconds: float
    detail: str  # the build folder (built, cached), or why not (failed, skipped)

    def line(self) -> str:
        return f"{self.name:<8} {self.status.value:<7} {self.seconds:6.1f} s  {self.detail}"

    def to_json(self) -> dict:
        return {"name": self.name, "status": self.status.value, "seconds": round(self.seconds, 2),
                "detail": self.detail}


def warmup() -> Outcome:
    """Build (or find built) the extension under cpu_ext.cache_root()."""
    ext, root = cpu_ext.CPU, cpu_ext.cache_root()
    missing = cpu_ext.missing_toolchain()
    if missing is not None:
        return Outcome(ext.name, Status.SKIPPED, 0.0, missing)
    if cpu_ext.lacks_avx2():
        return Outcome(ext.name, Status.SKIPPED, 0.0, "torch runs this CPU without AVX2, its only path")
    where = ext.build_dir(root)
    before = _libraries(where)
    start = time.perf_counter()
    try:
        cpu_ext.compile_extension(ext, root)
    except cpu_ext.BUILD_ERRORS as e:
        return Outcome(ext.name, Status.FAILED, time.perf_counter() - start,
                       f"{type(e).__name__}: {cpu_ext.failure(e)}")
    # ninja relinks a built library whose sources' mtimes moved (a checkout), so "cached" is "the library is
    # the one that was there", not "a library was there"
    status = Status.CACHED if before and _libraries(where) == before else Status.BUILT
    return Outcome(ext.name, status, time.perf_counter() - start, str(where))


def _libraries(folder: Path) -> dict[str, int]:
    """The folder's built libraries and their mtimes (ns)."""
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("*.so")}
