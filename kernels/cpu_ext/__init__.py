"""optc's own C++ CPU kernels, compiled on first use with torch's cpp_extension and cached on disk.

`load_ops()` builds (or reuses) ops.cpp under $OPTC_CACHE/cpu_ext/<torch version>-<source hash> and returns the
module, or None where it cannot be built (no C++ compiler, no ninja, a failed compile, a CPU without AVX2): the
failure is logged once and every launcher bound to these kernels runs its op's torch reference instead.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).parent

log = logging.getLogger("optc.kernels.cpu_ext")


def cache_dir() -> Path:
    return Path(os.environ.get("OPTC_CACHE", Path.home() / ".cache" / "optc")) / "cpu_ext"


@functools.cache
def load_ops() -> ModuleType | None:
    """ops.cpp's module, or None (logged) where it cannot be built or this CPU lacks AVX2."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return None
    return build("ops", ("ops.cpp",), ["-O3", "-ffp-contract=off", "-mavx2", "-mf16c"], cache_dir())


def build(name: str, sources: tuple[str, ...], flags: list[str], root: Path) -> ModuleType | None:
    """Compile `sources` into root/<torch version>-<source hash> (a no-op when built there already)."""
    digest = hashlib.sha256(b"".join((HERE / s).read_bytes() for s in sources) + " ".join(flags).encode()).hexdigest()
    where = root / f"torch{torch.__version__}-{digest[:12]}"
    try:
        from torch.utils import cpp_extension

        where.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(f"optc_{name}_{digest[:12]}", [str(HERE / s) for s in sources], extra_cflags=flags,
                                  build_directory=str(where), extra_include_paths=[str(HERE)])
    except (OSError, RuntimeError, ImportError, SystemExit) as e:  # cpp_extension raises all of these
        log.warning("optc's C++ CPU kernels (%s) could not be built (%s: %s); the torch references run instead",
                    name, type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None
