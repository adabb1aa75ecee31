"""optc's own C++ CPU kernels, one extension compiled with torch's cpp_extension when a model using them loads
(the kernel table's `extension` loader), by `optc warmup`, or on first use, and cached on disk. Its translation
units, compiled in parallel by ninja and linked into one module: qdot.cpp (grouped int4 / int8 code linears with
integer activations per block of 32: kernels/cpu_ext/qdot.py), bf16dot.cpp (dense bfloat16 linears whose rows do
not depend on the call's row count: kernels/cpu_ext/bf16dot.py), ops.cpp (a decode step's norms, gated
activation, rotary + KV store and decode attention, one call each: kernels/cpu_ext/ops.py), lora.cpp (a targeted
linear's LoRA deltas: runtime/lora.py), step.cpp (a decode step's decoder layers as one call, calling the others'
functions through their headers: kernels/cpu_ext/step.py) and bindings.cpp (the module definition). cpu_ext.h is
what they share: the ISA paths and their probe, the horizontal sum, at::parallel_for's grain sizes.

`load()` builds (or reuses) the extension under $OPTC_CACHE/cpu_ext/<torch version>-<source hash> and returns
the module, or None where it cannot be built (no C++ compiler, no ninja, a failed compile) or where torch runs this
CPU without AVX2 (the extension's flags assume it): a failure is logged once and every launcher bound to these
kernels runs what it runs without them (torch's packed and bfloat16 kernels, the op references, the node-by-node
step), so an install without a compiler still runs every artifact. `isa()` is the path qdot runs on this CPU:
AVX-512 VNNI where the CPU has it, else AVX2, capped to AVX2 when ATEN_CPU_CAPABILITY=avx2 (the cap that makes
torch's own kernels take their AVX2 paths, so that a capped measurement compares like with like); `bf16_isa()` is
bf16dot's the same way (AVX-512 BF16 or AVX2).

One process builds a folder at a time: a build holds an OS lock (flock) on the folder's LOCK_FILE, which the kernel
releases when its holder exits, SIGKILL included, so a killed build never leaves a lock behind that stalls the next
`optc serve`. A waiter says whose lock it waits on and gives up after LOCK_WAIT_SECONDS (logged; the launchers
fall back as on a failed build). This does not make a build any faster, nor share one folder across machines.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

AVX2, AVX512_VNNI, AVX512_BF16 = 2, 3, 4  # the kernels' `isa` argument: cpu_ext.h's `enum Isa`
ISA_NAMES = {AVX2: "avx2", AVX512_VNNI: "avx512_vnni", AVX512_BF16: "avx512_bf16"}
HERE = Path(__file__).parent
LOCK_FILE = "optc-build.lock"  # in the build folder: the holder's pid and start time, flocked while it builds
TORCH_LOCK_FILE = "lock"  # cpp_extension's own lock, a file whose mere existence makes every other build wait
LOCK_WAIT_SECONDS = 300.0  # the extension builds in about a minute on a loaded 2-core machine
LOCK_POLL_SECONDS = 0.2
# what a failed compile, a missing toolchain or a lock wait past its bound raise (TimeoutError is an OSError)
BUILD_ERRORS = (OSError, RuntimeError, ImportError, subprocess.CalledProcessError)

log = logging.getLogger("optc.kernels.cpu_ext")


@dataclass(frozen=True)
class Extension:
    """One C++ extension: the files of `folder` hashed into its build folder's name (`sources`; its .cpp files are
    the translation units compiled), the compiler flags, what runs `instead` where it cannot be built, and the
    units that compile slowest (started first, then the others by size, largest first)."""

    name: str
    sources: tuple[str, ...]
    flags: tuple[str, ...]
    instead: str
    slowest: tuple[str, ...] = ()
    folder: Path = HERE

    def tag(self) -> str:
        """A hash of the sources and flags: a change to either builds afresh."""
        sources = b"".join((self.folder / s).read_bytes() for s in self.sources)
        return hashlib.sha256(sources + " ".join(self.flags).encode() + b"omp").hexdigest()[:12]

    def build_dir(self, root: Path) -> Path:
        return root / f"torch{torch.__version__}-{self.tag()}"

    def is_built(self, root: Path) -> bool:
        return any(self.build_dir(root).glob("*.so"))


# -ffp-contract=off: products and sums round separately, as the references' do. AVX-512 code adds its own targets
# (`#pragma GCC target`), run only where the ISA probe finds them.
FLAGS = ("-O3", "-ffp-contract=off", "-mavx2", "-mf16c")
# every .cpp and header of this folder: a header's change builds afresh too
CPU = Extension("cpu", tuple(sorted(p.name for p in HERE.iterdir() if p.suffix in (".cpp", ".h"))), FLAGS,
                "torch's packed and bfloat16 kernels, the op references and the node-by-node step",
                slowest=("step.cpp", "bindings.cpp"))  # the two that parse torch's pybind header


def cache_root() -> Path:
    return Path(os.environ.get("OPTC_CACHE", Path.home() / ".cache" / "optc")) / "cpu_ext"


@functools.cache
def load() -> ModuleType | None:
    """The extension's module, or None (logged) where it cannot be built or torch runs this CPU without AVX2."""
    if lacks_avx2():
        return None
    return build(CPU, cache_root())


def build(ext: Extension, root: Path, wait_seconds: float = LOCK_WAIT_SECONDS) -> ModuleType | None:
    """`compile_extension`, or None where it fails, logged with what runs `ext.instead`."""
    try:
        return compile_extension(ext, root, wait_seconds)
    except BUILD_ERRORS as e:
        log.warning("optc's C++ CPU kernels could not be built (%s: %s: %s); %s run instead", ext.name,
                    type(e).__name__, failure(e), ext.instead)
        return None


def compile_extension(ext: Extension, root: Path, wait_seconds: float = LOCK_WAIT_SECONDS) -> ModuleType:
    """Compile `ext` into its build folder under `root` (a no-op when built there already) and import it, under the
    folder's build lock; raises what cpp_extension raises, or a TimeoutError naming the lock and its holder when
    another process held the lock for `wait_seconds`."""
    from torch.utils import cpp_extension

    where = ext.build_dir(root)
    where.mkdir(parents=True, exist_ok=True)
    with build_lock(where, ext.name, wait_seconds):
        # every builder of this folder holds our lock around cpp_extension's, so a `lock` file present now was
        # left by a build that was killed: cpp_extension would wait on it forever
        stale = where / TORCH_LOCK_FILE
        if stale.exists():
            log.warning("optc: removing %s, left by a C++ kernel build that did not finish", stale)
            stale.unlink(missing_ok=True)
        if not any(where.glob("*.so")):
            print(f"optc: compiling its C++ CPU kernels ({ext.name}), once: under a minute; cached in {where}",
                  file=sys.stderr, flush=True)
        # the translation units in the order ninja starts them: the slowest first, so that none is the build's tail
        units = sorted((ext.folder / s for s in ext.sources if s.endswith(".cpp")),
                       key=lambda p: (p.name not in ext.slowest, -p.stat().st_size))
        # -fopenmp: at::parallel_for is a header that splits work only where the including code is compiled with
        # OpenMP (else it runs its whole range on the calling thread); libgomp.so.1 resolves to torch's own copy
        return cpp_extension.load(f"optc_{ext.name}_{ext.tag()}", [str(p) for p in units],
                                  extra_cflags=[*ext.flags, "-fopenmp"], extra_ldflags=["-fopenmp"],
                                  build_directory=str(where), extra_include_paths=[str(ext.folder)])


@contextlib.contextmanager
def build_lock(where: Path, name: str, wait_seconds: float = LOCK_WAIT_SECONDS) -> Iterator[None]:
    """Hold an exclusive flock on where/LOCK_FILE, with this process's pid and start time written in it. A process
    that finds it held prints whose it is, polls, and raises a TimeoutError naming the file and the holder after
    `wait_seconds`. The kernel drops the flock when the holder's file is closed, which its death does."""
    path = where / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_seconds
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    print(f"optc: waiting for {holder(path)} to finish building the C++ CPU kernels in {where} "
                          f"(lock {path}; {name} waits at most {wait_seconds:.0f} s)", file=sys.stderr, flush=True)
                    said = True
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{path} is still held by {holder(path)} after {wait_seconds:.0f} s: "
                                       f"{name} not built") from None
                time.sleep(LOCK_POLL_SECONDS)
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "started": started, "building": name}).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def holder(path: Path) -> str:
    """Who holds the build lock `path`, as its holder wrote it: 'pid N (building NAME since TIME)'."""
    try:
        record = json.loads(path.read_text())
        return f"pid {record['pid']} (building {record['building']} since {record['started']})"
    except (OSError, ValueError, KeyError, TypeError):  # taken an instant ago, not yet written
        return "another process"


def missing_toolchain() -> str | None:
    """Why this machine cannot compile an extension (no C++ compiler, no ninja), or None where it can."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")  # what cpp_extension runs on Linux and macOS
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} (the CXX variable, else c++) is not on PATH"
    if not cpp_extension.is_ninja_available():
        return "no ninja: torch's cpp_extension builds with it (pip install ninja)"
    return None


def lacks_avx2() -> bool:
    """Whether torch runs this CPU on its DEFAULT path: no AVX2, or ATEN_CPU_CAPABILITY=default caps it there."""
    return torch.backends.cpu.get_cpu_capability() == "DEFAULT"


def failure(e: BaseException) -> str:
    """One line of why a build failed: the compiler's first error where its output holds one (cpp_extension's
    message is ninja's whole output, whose last line is only 'build stopped'), else the message's last line."""
    lines = str(e).strip().splitlines()
    errors = [line.strip() for line in lines if "error:" in line]
    return errors[0] if errors else (lines[-1].strip() if lines else "")


@functools.cache
def isa() -> int | None:
    """qdot's ISA path on this CPU (AVX2 or AVX512_VNNI), None where the extension is absent."""
    return _capped("qdot")


@functools.cache
def bf16_isa() -> int | None:
    """bf16dot's ISA path on this CPU (AVX512_BF16 or AVX2), None where the extension is absent."""
    return _capped("bf16dot")


def _capped(family: str) -> int | None:
    """The best path of kernel family `family` (the ISA probe's key) on this CPU under ATEN_CPU_CAPABILITY's cap
    (load() is None under the `default` cap)."""
    ext = load()
    best = ext.best_isa()[family] if ext is not None else 0
    if best == 0:
        return None
    return AVX2 if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2" else best
