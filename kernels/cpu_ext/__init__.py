"""optc's own C++ CPU kernels (qdot.cpp: grouped int4 / int8 code linears with int16 activations per block of
32), compiled on first use with torch's cpp_extension and cached on disk, and the ISA path they run.

`load()` builds (or reuses) the extension under $OPTC_CACHE/cpu_ext/<torch version>-<source hash> and returns
the module, or None where it cannot be built (no C++ compiler, no ninja, a failed compile): the failure is
logged once and every launcher bound to these kernels runs torch's packed kernel instead (kernels/cpu_ext/qdot.py),
so an install without a compiler still runs every artifact. `isa()` is the path qdot runs on this CPU: AVX-512
VNNI where the CPU has it, else AVX2, capped to AVX2 when ATEN_CPU_CAPABILITY=avx2 (the cap that makes torch's
own kernels take their AVX2 paths, so that a capped measurement compares like with like).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
from pathlib import Path
from types import ModuleType

import torch

AVX2, AVX512_VNNI = 2, 3  # qdot.cpp's `isa` argument
ISA_NAMES = {AVX2: "avx2", AVX512_VNNI: "avx512_vnni"}
SOURCES = ("qdot.cpp", "qdot_body.h")
HERE = Path(__file__).parent

log = logging.getLogger("optc.kernels.cpu_ext")


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, or None (logged) where it cannot be built on this machine."""
    return build(Path(os.environ.get("OPTC_CACHE", Path.home() / ".cache" / "optc")) / "cpu_ext")


def build(root: Path) -> ModuleType | None:
    """Compile qdot.cpp into root/<torch version>-<source hash> (a no-op when built there already)."""
    digest = hashlib.sha256(b"".join((HERE / s).read_bytes() for s in SOURCES)).hexdigest()[:12]
    where = root / f"torch{torch.__version__}-{digest}"
    try:
        from torch.utils import cpp_extension

        where.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(f"optc_qdot_{digest}", [str(HERE / "qdot.cpp")], extra_cflags=["-O3"],
                                  build_directory=str(where), extra_include_paths=[str(HERE)])
    except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as e:  # what cpp_extension raises
        log.warning("optc's C++ CPU kernels could not be built (%s: %s); torch's packed kernels run instead",
                    type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None


@functools.cache
def isa() -> int | None:
    """qdot's ISA path on this CPU (AVX2 or AVX512_VNNI), None where the extension is absent or the CPU has
    no AVX2 (or ATEN_CPU_CAPABILITY caps torch below it)."""
    ext = load()
    if ext is None:
        return None
    best = ext.best_isa()
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if cap == "default" or best == 0:
        return None
    return AVX2 if cap == "avx2" else best
